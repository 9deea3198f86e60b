"""The zoo: nine transformers architectures as a user gives them (tests/hf/zoo.py: decoder LMs Llama,
Mistral with a sliding window, GPT-2, Falcon with in-place ops on sub-outputs; a Mixtral MoE with eager
experts (data-dependent routing); BERT (encoder-only), T5 (encoder-decoder), ViT (trunc_normal_ init),
CLIP (a 0-d logit_scale, a model file)). Each: the exact parameter count, a trace, a plan at a roomy and a
tight budget, and one real 2-rank FSDP2 run (gloo) of every plan, in one world, with the measured peak
within 3% of the predicted one and within the usable budget the plan claims; plus plans that checkpoint a
block with a unit nested inside it. Every architecture with a decoder twice: with its KV cache (found by
the trace, never checkpointed: an AC'd plan is refused before it is estimated or run) and with
use_cache=False (checkpointed where the budget asks)."""

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (the optional extra: "
                    "pip install 'shard-planner[hf]')")

from shard_planner.execute import launch_plans  # noqa: E402
from shard_planner.hardware.profile import load_profile  # noqa: E402
from shard_planner.solve import plan_model  # noqa: E402
from shard_planner.solve.request import PlanRequest  # noqa: E402
from shard_planner.trace import trace_model  # noqa: E402
from tests.hf.zoo import (ALL, CACHED, NESTED_AC, PROFILE, ROOMY_BYTES, load_arch, nested_ac_plan,  # noqa: E402
                          reference_param_count, tight_budget_bytes, write_arch)

TOLERANCE = 0.03  # the cleanest rank's peak within 3% of the prediction (tests/cost/test_cost_realrun.py)
# Plans the cost model over-predicts by more, each with the bound it stays within and why:
# [Note: Nested units' gradients] in shard_planner/cost/memory.py. The nested MLP's unsharded gradients are
# reduce-scattered at its post-backward, before the rest of its block's backward, but counted through all
# of it. Measured +3.55% (1211328 B predicted, 1169820 B measured; +1.4% with no unit nested). The +1.1%
# measured before was with use_cache=True, whose recomputation grows the KV cache by what no plan prices
# (the same plan measured 1198620 B); a model with a cache is no longer checkpointed.
OVER_PREDICTED = {"llama-nocache checkpointed blocks, mlp nested": 0.05}
NAMES = [arch.name for arch in ALL]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """name -> (arch, given path, model file, trace, roomy result, tight result)."""
    root = tmp_path_factory.mktemp("zoo")
    profile = load_profile(PROFILE)
    out = {}
    for arch in ALL:
        path = write_arch(arch, Path(root) / arch.name)
        mf = load_arch(arch, path)
        trace = trace_model(mf)
        request = PlanRequest(gpus=2, mem_budget_bytes=ROOMY_BYTES, profile=profile, model_path=path)
        roomy = plan_model(trace, request)
        tight = plan_model(trace, PlanRequest(gpus=2, mem_budget_bytes=tight_budget_bytes(roomy, profile),
                                              profile=profile, model_path=path))
        out[arch.name] = (arch, path, mf, trace, roomy, tight)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_exact_parameter_count(name, zoo):
    arch, _path, mf, trace, _roomy, _tight = zoo[name]
    assert trace.param_count == reference_param_count(arch, mf)


@pytest.mark.parametrize("name", NAMES)
def test_roomy_and_tight_plans(name, zoo):
    _arch, _path, _mf, _trace, roomy, tight = zoo[name]
    profile = load_profile(PROFILE)
    assert roomy.plan.predicted.peak_bytes <= profile.tensor_budget_bytes(ROOMY_BYTES)
    usable = profile.tensor_budget_bytes(tight.plan.cluster.mem_budget_bytes)
    assert tight.plan.predicted.peak_bytes <= usable < roomy.plan.predicted.peak_bytes
    assert len(tight.plan.units) > 1  # the roomy plan (one unit) does not fit: the tight one splits


def test_the_zoo_covers_the_issue(zoo):
    """At least eight architectures, including each kind the issue names."""
    classes = {name: zoo[name][3].model_class for name in zoo}
    assert len(classes) >= 8
    assert classes["mixtral"] == "MixtralForCausalLM" and classes["bert"] == "BertForMaskedLM"
    assert classes["t5"] == "T5ForConditionalGeneration" and classes["vit"] == "ViTForImageClassification"
    assert classes["clip"] == "CLIPModel" and zoo["clip"][3].module("").scalar_param_bytes_by_dtype
    assert classes["falcon"] == "FalconForCausalLM"
    assert {zoo[name][0].given_as for name in zoo} == {"config.json", "folder", "model file"}


@pytest.mark.parametrize("name", NAMES)
def test_a_forward_cache_is_found_and_never_checkpointed(name, zoo):
    """[Note: A forward that builds a cache] (shard_planner/trace/cache.py): found in every decoder built
    with its cache and in no other model; the plans of those checkpoint nothing, the frontier included."""
    _arch, _path, _mf, trace, roomy, tight = zoo[name]
    assert (trace.forward_cache is not None) == (name in CACHED), trace.forward_cache
    if name in CACHED:
        units = [u for r in (roomy, tight) for u in r.plan.units]
        assert not any(u.activation_checkpoint for u in units)
        for point in tight.plan.frontier:  # "no AC" only: no "AC" or "selective AC" of a unit
            assert all(point.description[:m.start()].endswith("no ")
                       for m in re.finditer(r"\bAC\b", point.description)), point.description


def test_without_a_cache_the_tight_plans_may_checkpoint(zoo):
    """The same decoders built with use_cache=False: checkpointing is back in the search space (some tight
    plan or its frontier uses it)."""
    from shard_planner.solve.space import build_space, checkpointing_allowed

    for name in CACHED:
        trace = zoo[f"{name}-nocache"][3]
        assert checkpointing_allowed(trace) and not checkpointing_allowed(zoo[name][3])
        space = build_space(trace, shard_group=2, gpus_per_node=2)
        assert any(c.option.activation_checkpoint for c in space.candidates)
        assert not any(c.option.activation_checkpoint for c in build_space(zoo[name][3], shard_group=2,
                                                                             gpus_per_node=2).candidates)


def test_a_checkpointed_plan_of_a_cached_model_is_refused_in_one_line(zoo):
    """estimate (the cost API and `shard-planner estimate`) and run (before the ranks start) refuse it,
    naming use_cache=False."""
    from dataclasses import replace

    from shard_planner.cost import estimate
    from shard_planner.errors import PlanError
    from shard_planner.plan import Unit

    profile = load_profile(PROFILE)
    _arch, _path, _mf, trace, roomy, _tight = zoo["llama"]
    units = (Unit(("",), False), *(Unit((f"model.layers.{i}",), True, activation_checkpoint=True) for i in range(2)))
    plan = replace(roomy.plan, units=units, frontier=(), baselines=())
    for refuse in (lambda: estimate(trace, plan, profile),
                   lambda: launch_plans([plan], world_size=2, steps=1, warmup=0, device="cpu")):
        with pytest.raises(PlanError) as err:
            refuse()
        assert "use_cache=False" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.multiprocess
def test_every_plan_runs_within_3_percent_and_the_usable_budget(zoo, capsys):
    profile = load_profile(PROFILE)
    plans, labels = [], []
    for name in NAMES:
        _arch, _path, _mf, _trace, roomy, tight = zoo[name]
        plans += [roomy.plan, tight.plan]
        labels += [f"{name} roomy", f"{name} tight"]
    for name, block, nested in NESTED_AC:
        _arch, _path, _mf, trace, roomy, _tight = zoo[name]
        plans.append(nested_ac_plan(roomy.plan, trace, profile, block, nested))
        labels.append(f"{name} checkpointed blocks, {nested} nested")
    measurements = launch_plans(plans, world_size=2, steps=2, warmup=1, device="cpu").measurements
    errors, over = [], []
    for label, plan, m in zip(labels, plans, measurements):
        predicted = m.predicted_peak_bytes - m.predicted_overhead_bytes
        cleanest = min(r.peak_bytes for r in m.memory)  # ranks are symmetric (tests/cost/test_cost_realrun.py)
        errors.append((label, (predicted - cleanest) / cleanest))
        # Within the usable budget the plan claims, up to the prediction error accepted above: a tight plan the
        # planner fills to the usable edge runs above it by what the model under-predicts (BERT's tight plan:
        # 1,156,480 B predicted, 1,180,972 B measured, -2.1%, 0.2% above its usable 1,178,688 B); never above --mem.
        usable = profile.tensor_budget_bytes(plan.cluster.mem_budget_bytes)
        if (cleanest + m.predicted_overhead_bytes > usable * (1 + TOLERANCE)
                or cleanest + m.predicted_overhead_bytes > plan.cluster.mem_budget_bytes):
            over.append(label)
        print(f"{label}: predicted {predicted} B, measured {[r.peak_bytes for r in m.memory]} B, "
              f"step {sorted(m.step_time_s)[len(m.step_time_s) // 2] * 1e3:.0f} ms")
    assert [e for e in errors if abs(e[1]) > TOLERANCE and not 0 < e[1] <= OVER_PREDICTED.get(e[0], 0)] == []
    assert over == []
