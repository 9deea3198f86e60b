"""The solver's linear model against the simulators, for every plan of a corpus: its peak and step time
stay within the bounds solve/linear.py's docstring states (``PEAK_UNDER_COUNT``, ``PEAK_OVER_*``,
``TIME_RATIO``)."""

import dataclasses
import random

import pytest

from shard_planner.cost import CostModel
from shard_planner.plan import Cluster, Mesh, Prefetch, Training
from shard_planner.hardware.profile import load_profile
from shard_planner.solve import linear
from shard_planner.solve.choice import GlobalChoice
from shard_planner.solve.linear import MIB, build_linear_model, evaluate
from shard_planner.solve.simulate import cover_units, make_plan
from shard_planner.solve.space import build_space
from tests.models import cost_mlp, cost_synth, solve_traces
from tests.paths import EXAMPLES

MESHES = ((8, 1, 8), (16, 1, 8), (4, 2, 8), (8, 2, 4))  # shard, replicate, GPUs per node
PREFETCH = (Prefetch(0, 1), Prefetch(1, 1), Prefetch(2, 2))
COVERS_PER_CHOICE = 2


def _traces():
    from shard_planner.trace import trace_model

    return {
        "stack4": solve_traces.stack_trace(4), "stack6-unsplit": solve_traces.stack_trace(6, split_block=False),
        "synth8": cost_synth.synthetic_trace(layers=8, hidden=1024, seq=512, vocab=4096),
        "mlp": cost_mlp.analytic_trace(128, 4),
        "gpt2": trace_model(str(EXAMPLES / "gpt2.py")),
    }


def _profiles():
    return {"test-gpu": solve_traces.profile(), "test-gpu-2-per-node": solve_traces.profile(gpus_per_node=2),
            "h100": load_profile("h100-80gb"), "cpu-gloo": load_profile("cpu-gloo")}


def _without_overheads(profile):
    return dataclasses.replace(profile, per_op_overhead_s=0.0, per_unit_overhead_s=0.0,
                               per_param_tensor_optimizer_overhead_s=0.0)


def _random_cover(lm, rng):
    by_start: dict[int, list[int]] = {}
    for k, c in enumerate(lm.space.candidates):
        by_start.setdefault(c.start, []).append(k)
    pos, out = 0, []
    while pos < lm.space.n:
        k = rng.choice(by_start[pos])
        out.append(k)
        pos = lm.space.candidates[k].stop
    return tuple(out)


def _choices():
    for shard, replicate, gpn in MESHES:
        for prefetch in PREFETCH:
            for mb in (1, 4):
                for offload in (False, True):
                    if offload and prefetch != PREFETCH[0]:
                        continue
                    for optimizer, dtype in (("adamw", "bfloat16"), ("sgd", "float32")):
                        yield (shard, replicate, gpn), GlobalChoice(mb, prefetch, Mesh(shard, replicate), offload), \
                            Training(mb, optimizer, dtype)


def _corpus():
    """(label, linear peak MiB, linear µs, simulated peak bytes, simulated step s, bare step s, offload
    on a GPU) for every plan of the corpus."""
    rng = random.Random(11)
    rows = []
    for tname, trace in _traces().items():
        for pname, profile in _profiles().items():
            full, bare = CostModel(trace, profile), CostModel(trace, _without_overheads(profile))
            for (shard, replicate, gpn), choice, training in _choices():
                space = build_space(trace, shard_group=shard, gpus_per_node=gpn, max_group_size=4)
                lm = build_linear_model(trace, space, choice, training, bare.profile, bare)
                cluster = Cluster(shard * replicate, gpn, profile.name, 80 * 2**30)
                for _ in range(COVERS_PER_CHOICE):
                    cover = _random_cover(lm, rng)
                    lin = evaluate(lm, cover)
                    plan = make_plan(trace, cover_units(lm, cover), choice, training=training, cluster=cluster)
                    est = full.estimate(plan, timeline=False)
                    rows.append((f"{tname}/{pname}/{choice.label}/{training.optimizer}/cover {cover}",
                                 lin.peak_mib, lin.time_us, est.memory.peak_bytes, est.time.step_time_s,
                                 bare.time(plan).step_time_s, choice.cpu_offload and profile.device != "cpu"))
    return rows


@pytest.fixture(scope="module")
def corpus():
    return _corpus()


def test_corpus_is_large(corpus):
    assert len(corpus) > 1500


def test_linear_peak_within_the_docstring_bounds(corpus):
    bad = []
    for label, peak_mib, _, sim_peak, _, _, offload in corpus:
        under = linear.PEAK_UNDER_COUNT_OFFLOAD if offload else linear.PEAK_UNDER_COUNT
        lin = peak_mib * MIB
        if not (1 - under) * sim_peak <= lin <= linear.PEAK_OVER_FACTOR * sim_peak + linear.PEAK_OVER_SLACK_MIB * MIB:
            bad.append(f"{label}: linear {lin / MIB:.1f} MiB, simulated {sim_peak / MIB:.1f} MiB")
    assert not bad, "\n".join(bad[:20])


def test_linear_time_within_the_docstring_bounds(corpus):
    low, high = linear.TIME_RATIO
    bad = []
    for label, _, time_us, _, sim_s, bare_s, _ in corpus:
        lin_s = time_us / 1e6
        if not (low * bare_s <= lin_s <= high * bare_s and lin_s <= high * sim_s):
            bad.append(f"{label}: linear {lin_s * 1e3:.3f} ms, simulated {sim_s * 1e3:.3f} ms "
                       f"({bare_s * 1e3:.3f} ms without framework overheads)")
    assert not bad, "\n".join(bad[:20])


def test_the_bounds_are_not_loose(corpus):
    """The stated bounds are near what the corpus reaches: a change that makes the linear model much
    closer to (or further from) the simulators should restate them."""
    worst_under = max(1 - peak_mib * MIB / sim for _, peak_mib, _, sim, _, _, off in corpus if not off)
    ratios = [time_us / 1e6 / bare for _, _, time_us, _, _, bare, _ in corpus]
    assert worst_under > linear.PEAK_UNDER_COUNT / 3
    assert min(ratios) < linear.TIME_RATIO[0] + 0.15 and max(ratios) > linear.TIME_RATIO[1] - 0.15
