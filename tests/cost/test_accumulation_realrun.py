"""Gradient accumulation, predicted vs real (CPU/gloo, world size 2): the peak of one whole optimizer
step of n micro-steps, measured by the executor's storage tracker, against cost/accumulation.py, for
every gradient-sync policy, with parameters kept gathered or not, mixed precision (the held gradients
cast to the reduce dtype) and not (held in place), one and two parameters per unit; tests/models/cost_mlp.py
with its hand-written trace (a miss is the simulator's), and examples/gpt2.py tiny through the tracer."""

import pytest

from shard_planner.cost import simulate_memory
from shard_planner.execute import run_plans
from shard_planner.model.modelfile import load_model_file
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit
from shard_planner.hardware.profile import load_profile
from shard_planner.trace.structure import model_fingerprint
from tests.models import cost_mlp
from tests.paths import EXAMPLES, MODELS

MLP = str(MODELS / "cost_mlp.py")
GPT2 = str(EXAMPLES / "gpt2.py")
TOLERANCE = 0.03
GC_TOLERANCE = 0.06  # the worst rank (tests/cost/test_cost_realrun.py: garbage held by reference cycles)
EVERY, LAST = "every_micro_step", "last_micro_step"


def _training(mb, pd, n, sync, keep, rd="float32"):
    return Training(mb, "adamw", pd, rd, accumulation_steps=n, gradient_sync=sync, keep_params_gathered=keep)


def _mlp(fp, *, n, sync, keep=False, mb=64, pd="bfloat16", reshard=True, grouped=False):
    if grouped:
        units = [Unit(("",), False), Unit(("blocks.0", "blocks.1"), reshard), Unit(("blocks.2", "blocks.3"), reshard)]
    else:
        units = [Unit(("",), False)] + [Unit((f"blocks.{i}",), reshard) for i in range(cost_mlp.LAYERS)]
    return Plan(ModelRef(MLP, fp), Cluster(2, 2, "cpu-gloo", 2**30), Mesh(2), _training(mb, pd, n, sync, keep),
                tuple(units), Prefetch(0, 1))


def _gpt2(*, n, sync, keep=False):
    fp = model_fingerprint(load_model_file(GPT2).build())
    units = [Unit(("",), False)] + [Unit((f"blocks.{i}",)) for i in range(4)]
    return Plan(ModelRef(GPT2, fp), Cluster(2, 2, "cpu-gloo", 2**30), Mesh(2), _training(8, "bfloat16", n, sync, keep),
                tuple(units), Prefetch(0, 1))


def _configs():
    fp = model_fingerprint(load_model_file(MLP).build())
    return {
        "no accumulation (reference)": _mlp(fp, n=1, sync=EVERY),
        "3 micro-steps, sync every micro-step": _mlp(fp, n=3, sync=EVERY),
        "3 micro-steps, deferred sync (bf16 -> fp32 held)": _mlp(fp, n=3, sync=LAST),
        "2 micro-steps, deferred sync, mb 16": _mlp(fp, n=2, sync=LAST, mb=16),
        "2 micro-steps, deferred sync, 2 parameters per unit": _mlp(fp, n=2, sync=LAST, grouped=True),
        # fp32 held in place: at a larger micro-batch, so that the gradient garbage sometimes adds (cost/accumulation.py
        # [Note: Deferred gradient sync]) stays within the tolerance
        "3 micro-steps, deferred sync, fp32 (held in place), mb 512": _mlp(fp, n=3, sync=LAST, pd="float32", mb=512),
        "3 micro-steps, deferred sync, fp32 (held in place), mb 64": _mlp(fp, n=3, sync=LAST, pd="float32"),
        "3 micro-steps, deferred sync, parameters kept, mb 8": _mlp(fp, n=3, sync=LAST, keep=True, mb=8),
        "2 micro-steps, sync every step, parameters kept, fp32": _mlp(fp, n=2, sync=EVERY, keep=True, pd="float32",
                                                                    mb=256),
        "3 micro-steps, sync every step, parameters kept, mb 8": _mlp(fp, n=3, sync=EVERY, keep=True, mb=8),
        "2 micro-steps, deferred sync, kept, 2 parameters per unit, fp32, mb 512": _mlp(
            fp, n=2, sync=LAST, keep=True, grouped=True, pd="float32", mb=512),
        "gpt2 tiny (traced), 2 micro-steps, deferred sync": _gpt2(n=2, sync=LAST),
        "gpt2 tiny (traced), 2 micro-steps, sync every step": _gpt2(n=2, sync=EVERY),
    }


@pytest.mark.multiprocess
def test_accumulation_peak_within_3_percent_world_size_2():
    from shard_planner.trace import trace_model

    configs = _configs()
    profile = load_profile("cpu-gloo")
    runs = run_plans(list(configs.values()), world_size=2, steps=1, warmup=1, device="cpu", timeout_s=600)
    gpt2_trace = trace_model(GPT2, dtype="bfloat16")
    rows = []
    for (name, plan), run in zip(configs.items(), runs):
        trace = gpt2_trace if plan.model.path == GPT2 else cost_mlp.analytic_trace(compute_dtype=plan.training.param_dtype)
        est = simulate_memory(trace, plan, profile)
        best, worst = min(m.peak_bytes for m in run.memory), max(m.peak_bytes for m in run.memory)
        rows.append((name, best, est.peak_bytes, est.peak_event, (est.peak_bytes - best) / best,
                     (est.peak_bytes - worst) / worst))
    report = "\n".join(f"{n:56s} measured {m:9d} predicted {p:9d} ({ev}) {100 * e:+.2f}% (worst rank {100 * w:+.2f}%)"
                       for n, m, p, ev, e, w in rows)
    print(report)
    bad = [r for r in rows if abs(r[-2]) > TOLERANCE or abs(r[-1]) > GC_TOLERANCE]
    assert not bad, report
    by_name = {r[0]: r for r in rows}
    # deferred sync holds every unit's unsharded gradients: more than reduce-scattering every micro-step
    assert by_name["3 micro-steps, deferred sync (bf16 -> fp32 held)"][1] > by_name[
        "3 micro-steps, sync every micro-step"][1]
    # the peak of a deferred plan is in its last micro-step, where the held gradients meet the reduce-scatters
    assert "micro-step 3/3" in by_name["3 micro-steps, deferred sync (bf16 -> fp32 held)"][3]
