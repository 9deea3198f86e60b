"""How long the cost model takes to estimate one plan of an 80-layer model (target: < 5 ms, because
the solver evaluates thousands).

    python benchmarks/bench_cost.py [--quick] [--repeats N]

Traces: a hand-written 80-layer Llama-70B-shaped trace (tests/models/cost_synth.py) and, unless
--quick, the tracer's trace of examples/llama.py at SHARD_PLANNER_SIZE=70b (80 layers). For each plan:
the first estimate (a fresh CostModel: builds the per-segmentation tables and the schedule) and the
median of N more with the same segmentation (the solver's steady state), with and without the memory
timeline, all with the CostModel's memo of estimates off (``memo_size=0``: every call simulates); and
``memo_hit_ms``, an estimate the memo already holds (a cover the solver checks again). Prints a table
and writes reports/benchmarks/cost.csv.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "models"))

from shard_planner.cost import CostModel  # noqa: E402
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit  # noqa: E402
from shard_planner.hardware.profile import load_profile  # noqa: E402


def plans(trace, layer_type: str):
    layers = [m.fqn for m in trace.modules if m.type_name == layer_type]

    def make(gpus=64, group=1, reshard=True, ckpt=False, fwd=1, bwd=1, mb=1):
        units = [Unit(("",), False)] + [Unit(tuple(layers[i:i + group]), reshard, ckpt)
                                        for i in range(0, len(layers), group)]
        return Plan(ModelRef("bench", trace.fingerprint), Cluster(gpus, 8, "h100-80gb", 80 * 2**30), Mesh(gpus),
                    Training(mb), tuple(units), Prefetch(fwd, bwd))

    return {
        "1 layer/unit, reshard, no AC": make(),
        "1 layer/unit, full AC, mb 2": make(ckpt=True, mb=2),
        "2 layers/unit, prefetch 2/2": make(group=2, fwd=2, bwd=2),
        "1 layer/unit, reshard 8 of 64": make(reshard=8),
        "1 layer/unit, reshard False": make(reshard=False),
        "4 layers/unit, 8 GPUs": make(gpus=8, group=4),
    }, len(layers)


def timeit(fn, repeats: int) -> tuple[float, float]:
    """(median, min) seconds: the machine is shared, the minimum is the undisturbed cost."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), min(samples)


def bench(name, trace, layer_type, profile, repeats):
    rows = []
    ps, n_layers = plans(trace, layer_type)
    for label, plan in ps.items():
        model = CostModel(trace, profile, memo_size=0)
        t0 = time.perf_counter()
        est = model.estimate(plan, timeline=False)
        first = time.perf_counter() - t0
        # the solver's steady state: same segmentation, other decisions (micro-batch changes each call)
        variants = [replace(plan, training=replace(plan.training, micro_batch=b)) for b in (1, 2, 3, 4)]
        i = iter(range(10**9))
        fast, fast_min = timeit(lambda: model.estimate(variants[next(i) % 4], timeline=False), repeats)
        full, full_min = timeit(lambda: model.estimate(plan), repeats)
        mem, _ = timeit(lambda: model.memory(plan, timeline=False), repeats)
        tim, _ = timeit(lambda: model.time(plan), repeats)
        memo = CostModel(trace, profile)
        memo.estimate(plan, timeline=False)
        hit, _ = timeit(lambda: memo.estimate(plan, timeline=False), repeats)
        rows.append(dict(trace=name, layers=n_layers, plan=label, units=len(plan.units),
                         first_ms=round(first * 1e3, 3), estimate_ms=round(fast * 1e3, 3),
                         estimate_min_ms=round(fast_min * 1e3, 3),
                         with_timeline_ms=round(full * 1e3, 3), with_timeline_min_ms=round(full_min * 1e3, 3),
                         memory_ms=round(mem * 1e3, 3), time_ms=round(tim * 1e3, 3),
                         memo_hit_ms=round(hit * 1e3, 4),
                         peak_gib=round(est.memory.peak_bytes / 2**30, 2),
                         step_time_s=round(est.time.step_time_s, 4), target_ms=5.0,
                         meets_target=fast * 1e3 < 5.0))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip tracing examples/llama.py 70b")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args(argv)
    import cost_synth

    profile = load_profile("h100-80gb")
    rows = bench("synthetic 70B-shape", cost_synth.synthetic_trace(80, 8192, 4096), "Block", profile, args.repeats)
    if not args.quick:
        from shard_planner.trace import trace_model

        os.environ["SHARD_PLANNER_SIZE"] = "70b"
        t0 = time.perf_counter()
        trace = trace_model(str(ROOT / "examples" / "llama.py"))
        print(f"traced examples/llama.py 70b in {time.perf_counter() - t0:.1f} s")
        layer_type = next(m.type_name for m in trace.modules if m.fqn.endswith("layers.0"))
        rows += bench("examples/llama.py 70b", trace, layer_type, profile, args.repeats)
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in cols))
    out = ROOT / "reports" / "benchmarks" / "cost.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out.relative_to(ROOT)}")
    return 0 if all(r["meets_target"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
