"""Tier 3: predicted peak vs the peak of real FSDP2 runs (CPU/gloo): the executor's run_plans (one
launch per world size for many plans: world size 2 and 4), whose workers measure a steady-state step
with the StorageTracker.

Two models: tests/models/cost_mlp.py with its hand-written trace (exact by construction, so a miss is
the memory simulator's, not the tracer's; most plans are exact to the 28 bytes of AdamW step scalars
the simulator does not model), and examples/gpt2.py (tiny) and examples/unet.py (tiny, with
checkpointing: skip connections) with the tracer's trace — the whole pipeline. Every plan must be within 3% on its cleanest rank (ranks are symmetric here) and within 6% on
its worst (garbage held by reference cycles adds a storage or two on a rank at random).

Step time (the last test): gpt2 tiny plans with 1 to 9 units against the time model with its framework
overheads; a loose bound only (the machine is shared), and the ranking of plans far apart.
"""


import pytest


from tests.models import cost_mlp  # noqa: E402

from shard_planner.cost import simulate_memory  # noqa: E402
from shard_planner.execute import run_plans  # noqa: E402
from shard_planner.model.modelfile import load_model_file  # noqa: E402
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit  # noqa: E402
from shard_planner.hardware.profile import load_profile  # noqa: E402
from shard_planner.trace.structure import model_fingerprint  # noqa: E402
from tests.paths import EXAMPLES, MODELS  # noqa: E402

MODEL = str(MODELS / "cost_mlp.py")
GPT2 = str(EXAMPLES / "gpt2.py")
UNET = str(EXAMPLES / "unet.py")
L = cost_mlp.LAYERS
TOLERANCE = 0.03
GC_TOLERANCE = 0.06  # the worst rank: up to two extra storages of these small models held by garbage


def _plan(ws, fingerprint, *, units=None, fwd=0, bwd=1, mb=64, pd="bfloat16", opt="adamw", off=False,
          ckpt=False, reshard=True, root=False):
    if units is None:
        units = [Unit(("",), root)] + [Unit((f"blocks.{i}",), reshard, ckpt) for i in range(L)]
    return Plan(model=ModelRef(MODEL, fingerprint), cluster=Cluster(ws, ws, "cpu-gloo", 2**30), mesh=Mesh(ws),
                training=Training(mb, opt, pd, "float32", off), units=tuple(units), prefetch=Prefetch(fwd, bwd))


def _configs(ws, fp):
    grouped = [Unit(("",), False), Unit(("blocks.0", "blocks.1")), Unit(("blocks.2", "blocks.3"))]
    if ws == 2:
        return {
            "reshard True, bf16, prefetch 0/1": _plan(ws, fp),
            "reshard True, fp32": _plan(ws, fp, pd="float32"),
            "reshard False": _plan(ws, fp, reshard=False),
            "root reshards too": _plan(ws, fp, mb=512, root=True),
            "backward prefetch 2": _plan(ws, fp, bwd=2),
            "forward prefetch 2": _plan(ws, fp, fwd=2, mb=512),
            "forward prefetch 1, reshard False": _plan(ws, fp, fwd=1, mb=512, reshard=False),
            "checkpointing": _plan(ws, fp, ckpt=True),
            "checkpointing, activation-bound": _plan(ws, fp, ckpt=True, mb=512),
            "grouped units": _plan(ws, fp, units=grouped),
            "one unit (the root)": _plan(ws, fp, units=[Unit(("",), False)]),
            "CPU offload": _plan(ws, fp, off=True),
            "SGD with momentum": _plan(ws, fp, opt="sgd_momentum"),
            "micro-batch 8": _plan(ws, fp, mb=8),
            "activation-bound, fp32": _plan(ws, fp, mb=512, pd="float32"),
            "nested units (blocks.0 > blocks.0.fc)": _plan(ws, fp, units=[
                Unit(("",), False), Unit(("blocks.0",)), Unit(("blocks.0.fc",)), Unit(("blocks.1",)),
                Unit(("blocks.1.fc",)), Unit(("blocks.2",)), Unit(("blocks.3",))]),
            "inner modules as units, root owns the head": _plan(ws, fp, units=[
                Unit(("",), False)] + [Unit((f"blocks.{i}.fc",)) for i in range(L)]),
            "head as a unit, root owns nothing": _plan(ws, fp, units=[
                Unit(("",), False), Unit(("head",))] + [Unit((f"blocks.{i}",)) for i in range(L)]),
        }
    grouped_int = [Unit(("",), False), Unit(("blocks.0", "blocks.1"), 2), Unit(("blocks.2", "blocks.3"))]
    return {
        "reshard 2 of 4": _plan(ws, fp, reshard=2),
        "reshard 2 of 4, activation-bound": _plan(ws, fp, reshard=2, mb=512),
        "grouped, reshard 2 of 4, prefetch 1": _plan(ws, fp, units=grouped_int, mb=256, fwd=1),
        "reshard True, world size 4": _plan(ws, fp),
    }


def _gpt2_configs(ws):
    fp = model_fingerprint(load_model_file(GPT2).build())
    blocks = [f"blocks.{i}" for i in range(4)]

    def plan(mb, pd="bfloat16", reshard=True, ckpt=False, fwd=0, group=1):
        units = [Unit(("",), False)] + [Unit(tuple(blocks[i:i + group]), reshard, ckpt) for i in range(0, 4, group)]
        return Plan(ModelRef(GPT2, fp), Cluster(ws, ws, "cpu-gloo", 2**30), Mesh(ws), Training(mb, "adamw", pd),
                    tuple(units), Prefetch(fwd, 1))

    return {
        "gpt2 tiny (traced), bf16": plan(8),
        "gpt2 tiny (traced), fp32": plan(8, "float32"),
        "gpt2 tiny (traced), checkpointing": plan(32, ckpt=True),
        "gpt2 tiny (traced), reshard False, prefetch 1, 2 blocks/unit": plan(16, reshard=False, fwd=1, group=2),
    }


def _unet_configs(ws):
    """examples/unet.py (tiny) with checkpointing: the down blocks' outputs are both the next block's
    input and a skip connection the up path concatenates, so a checkpointed up block's input is partly
    held already (memory.py, [Note: Checkpointed inputs held elsewhere])."""
    fp = model_fingerprint(load_model_file(UNET).build())
    blocks = ["inc", "downs.0", "downs.1", "bottleneck", "ups.0.up", "ups.0.conv", "ups.1", "ups.2", "outc"]
    pairs = [("inc",), ("downs.0", "downs.1"), ("bottleneck",), ("ups.0.up", "ups.0.conv"), ("ups.1", "ups.2"),
             ("outc",)]  # grouped modules must be siblings

    def plan(groups, reshard=True, fwd=0, bwd=1):
        units = [Unit(("",), False)] + [Unit(g, reshard, True) for g in groups]
        return Plan(ModelRef(UNET, fp), Cluster(ws, ws, "cpu-gloo", 2**30), Mesh(ws), Training(8, "adamw", "bfloat16"),
                    tuple(units), Prefetch(fwd, bwd))

    return {
        "unet tiny (traced), per-block checkpointing": plan([(b,) for b in blocks]),
        "unet tiny (traced), pairs, reshard False, checkpointing, prefetch 1/2": plan(pairs, reshard=False, fwd=1, bwd=2),
    }


def _compare(ws):
    from shard_planner.trace import trace_model

    fp = model_fingerprint(load_model_file(MODEL).build())
    configs = _configs(ws, fp)
    if ws == 2:
        configs.update(_gpt2_configs(ws))
        configs.update(_unet_configs(ws))
    profile = load_profile("cpu-gloo")
    runs = run_plans(list(configs.values()), world_size=ws, steps=1, warmup=2, device="cpu", timeout_s=600)
    # Ranks are symmetric here (every dimension divides the world size), so each rank's peak measures
    # the same quantity; garbage held by reference cycles can add a storage or two on one rank at
    # random (memory.py, [Note: Measured peaks move by one activation]). Compare the cleanest rank to
    # 3% and the worst one to GC_TOLERANCE.
    measured = [min(((m.peak_bytes, m.peak_phase) for m in run.memory), key=lambda x: x[0]) for run in runs]
    worst = [max(m.peak_bytes for m in run.memory) for run in runs]
    print("per-rank peaks:", [[m.peak_bytes for m in run.memory] for run in runs])
    traced = {}
    rows = []
    for (name, plan), (peak, phase) in zip(configs.items(), measured):
        dtype = plan.training.param_dtype
        if plan.model.path in (GPT2, UNET):
            key = (plan.model.path, dtype)
            if key not in traced:
                traced[key] = trace_model(plan.model.path, dtype=dtype)
            trace = traced[key]
        else:
            trace = cost_mlp.analytic_trace(compute_dtype=dtype)
        est = simulate_memory(trace, plan, profile)
        rows.append((name, peak, phase, est.peak_bytes, est.peak_event, (est.peak_bytes - peak) / peak,
                     (est.peak_bytes - worst[len(rows)]) / worst[len(rows)]))
    report = "\n".join(f"{n:62s} measured {m:9d} ({ph}) predicted {p:9d} ({ev}) {100 * e:+.2f}% "
                       f"(worst rank {100 * w:+.2f}%)" for n, m, ph, p, ev, e, w in rows)
    print(report)
    return rows, report


@pytest.mark.multiprocess
def test_predicted_peak_within_3_percent_world_size_2():
    rows, report = _compare(2)
    assert len(rows) >= 12
    bad = [r for r in rows if abs(r[-2]) > TOLERANCE or abs(r[-1]) > GC_TOLERANCE]
    assert not bad, report
    # the configurations exercise both a backward (reduce-scatter) peak and a forward/loss peak
    assert {r[2] for r in rows} >= {"forward", "backward"}


@pytest.mark.multiprocess
def test_predicted_peak_within_3_percent_world_size_4_int_reshard():
    rows, report = _compare(4)
    bad = [r for r in rows if abs(r[-2]) > TOLERANCE or abs(r[-1]) > GC_TOLERANCE]
    assert not bad, report


# ---- step time: predicted vs measured (CPU/gloo, examples/gpt2.py tiny, world size 2) ----------------
# The machine is shared and loaded (other test runs): measured step times move by tens of percent, at
# times 2x, from run to run, and profiles/cpu-gloo.toml was calibrated at the quietest moment found. So
# this checks only a loose bound on the fastest timed step, and the ranking of plans whose measured
# times differ a lot. The errors are printed, with those of the same model without framework overheads.
TIME_FACTOR = 4.0  # predicted within [measured / 4, measured * 4]
RANK_MARGIN = 0.25  # the ranking must agree when the measured times differ by more than this fraction


def _gpt2_time_configs():
    fp = model_fingerprint(load_model_file(GPT2).build())
    blocks = [f"blocks.{i}" for i in range(4)]

    def plan(units, mb=4, pd="float32"):
        return Plan(ModelRef(GPT2, fp), Cluster(2, 2, "cpu-gloo", 2**30), Mesh(2), Training(mb, "adamw", pd),
                    tuple(units), Prefetch(0, 1))

    root = Unit(("",), False)
    return {
        "1 unit (the root)": plan([root]),
        "5 units (a block each)": plan([root] + [Unit((b,)) for b in blocks]),
        "9 units (attention and MLP each)": plan([root] + [Unit((f"{b}.{m}",)) for b in blocks for m in ("attn", "mlp")]),
        "5 units, checkpointing": plan([root] + [Unit((b,), True, True) for b in blocks]),
    }


@pytest.mark.multiprocess
def test_predicted_step_time_within_a_loose_factor():
    import dataclasses

    from shard_planner.cost import simulate_time
    from shard_planner.trace import trace_model

    configs = _gpt2_time_configs()
    profile = load_profile("cpu-gloo")
    bare = dataclasses.replace(profile, per_op_overhead_s=0.0, per_unit_overhead_s=0.0,
                               per_param_tensor_optimizer_overhead_s=0.0)
    runs = run_plans(list(configs.values()), world_size=2, steps=5, warmup=2, device="cpu", timeout_s=600)
    trace = trace_model(GPT2, dtype="float32")
    rows = []
    for (name, plan), run in zip(configs.items(), runs):
        predicted = simulate_time(trace, plan, profile).step_time_s
        without = simulate_time(trace, plan, bare).step_time_s
        rows.append((name, predicted, min(run.step_time_s), without))  # fastest step: load only adds time
    report = "\n".join(
        f"{n:34s} predicted {p * 1e3:6.1f} ms, measured {m * 1e3:6.1f} ms ({100 * (p - m) / m:+.0f}%); "
        f"without overheads {w * 1e3:6.1f} ms ({100 * (w - m) / m:+.0f}%)" for n, p, m, w in rows)
    print(report)
    assert all(m / TIME_FACTOR <= p <= m * TIME_FACTOR for _, p, m, _ in rows), report
    by_name = {n: (p, m) for n, p, m, _ in rows}
    for a, b in (("1 unit (the root)", "9 units (attention and MLP each)"),
                 ("1 unit (the root)", "5 units (a block each)")):
        (pa, ma), (pb, mb) = by_name[a], by_name[b]
        if abs(ma - mb) > RANK_MARGIN * min(ma, mb):
            assert (pa < pb) == (ma < mb), report
