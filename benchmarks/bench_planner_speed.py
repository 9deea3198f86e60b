"""Planner speed: trace, solve and frontier times for Llama-style 1B, 8B, 70B and 405B shapes.

Each size is traced (FakeTensorMode: no real memory, repeated blocks traced once), then planned for a
cluster of its usual scale on H100 80GB (examples/llama.py, sequence 4096, its micro-batch), each in a
fresh process so that one size's caches do not speed up the next:

    size  GPUs  budget per GPU
    1b    8     70 GiB
    8b    8     70 GiB
    70b   64    70 GiB
    405b  256   70 GiB

Reported: trace wall time; the whole ``plan_model`` wall time (the search over every prefetch choice
and mesh, the Pareto-frontier sweep and the hand-written baselines: the solver reports them as one
time); the time of ONE estimate (memory timeline + step time) of the chosen plan, against the peer
reference for one estimate (FSDPMemTracker in fake mode: 25-45 s for ONE 7-8B configuration,
REFERENCE.md); the frontier's size.

    python benchmarks/bench_planner_speed.py                # all four sizes (~5 min here)
    python benchmarks/bench_planner_speed.py --sizes 1b 8b

Writes reports/benchmarks/planner_speed.csv and planner_speed.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

CASES = {"1b": 8, "8b": 8, "70b": 64, "405b": 256}
BUDGET = "70GiB"
PROFILE = "h100-80gb"


def measure_one(size: str, gpus: int) -> dict:
    """Trace and plan one size in this process; returns the timings (called in a child process)."""
    common.quiet_logs()
    common.set_model_size(size)
    from shard_planner.solve import PlanRequest, plan_model
    from shard_planner.trace import trace_model
    from shard_planner.profile import load_profile
    from shard_planner.units import parse_bytes

    profile = load_profile(PROFILE)
    path = str(common.EXAMPLES / "llama.py")
    t0 = time.perf_counter()
    trace = trace_model(path)
    trace_s = time.perf_counter() - t0
    from shard_planner.cost import estimate
    from shard_planner.modelfile import load_model_file

    micro_batch = int(load_model_file(path).training["micro_batch"])
    row = dict(size=size, params_b=trace.param_count / 1e9,
               layers=sum(1 for m in trace.modules if m.fqn.count(".") == 1 and m.fqn.startswith("layers.")),
               gpus=gpus, trace_s=trace_s, reused_modules=trace.reused_modules, micro_batch=micro_batch)
    from shard_planner.errors import UserError

    t0 = time.perf_counter()
    try:
        plan = plan_model(trace, PlanRequest(gpus=gpus, mem_budget_bytes=parse_bytes(BUDGET), profile=profile,
                                             gpus_per_node=8, micro_batch=micro_batch, model_path=path)).plan
    except UserError as exc:  # e.g. infeasible: the time to find that out still counts
        row.update(plan_total_s=time.perf_counter() - t0, error=f"{type(exc).__name__}: {exc}"[:160])
        return row
    row["plan_total_s"] = time.perf_counter() - t0
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        estimate(trace, plan, profile)
    row.update(estimate_ms=(time.perf_counter() - t0) / reps * 1e3, solver_status=plan.solver.status,
               frontier_points=len(plan.frontier), units=len(plan.units),
               pred_peak_gib=plan.predicted.peak_bytes / 2**30, pred_step_s=plan.predicted.step_time_s)
    return row


def plot(rows: list[dict]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    x = range(len(rows))
    w = 0.27
    ax.bar([i - w for i in x], [r["trace_s"] for r in rows], w, label="trace (fake mode)")
    ax.bar(list(x), [r["plan_total_s"] for r in rows], w, label="plan (search + frontier + baselines)")
    ax.bar([i + w for i in x], [r["estimate_ms"] / 1e3 for r in rows], w, label="one estimate (memory + time)")
    ax.axhspan(25, 45, color="grey", alpha=0.2, label="FSDPMemTracker, ONE 7-8B config (REFERENCE.md)")
    ax.set_xticks(list(x), [f"{r['size']}\n{r['gpus']} GPUs" for r in rows])
    ax.set_ylabel("seconds (wall)")
    ax.set_yscale("log")
    ax.set_title("Planner speed, Llama-style shapes (CPU, 2 cores)")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one size, print JSON
    args = ap.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(measure_one(args.one, CASES[args.one])))
        return 0
    start = time.perf_counter()
    rows = []
    for size in args.sizes:
        proc = subprocess.run([sys.executable, __file__, "--one", size], capture_output=True, text=True,
                              env=dict(os.environ, CI="1"))
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"  {size}: failed ({tail})", flush=True)
            rows.append(dict(size=size, gpus=CASES[size], error=tail))
            continue
        rows.append(json.loads(line[len("RESULT "):]))
        print(f"  {size}: trace {rows[-1]['trace_s']:.1f} s, plan {rows[-1]['plan_total_s']:.1f} s"
              + (f" ({rows[-1]['error']})" if rows[-1].get("error") else ""), flush=True)
    columns = ["size", "params_b", "layers", "gpus", "trace_s", "reused_modules", "estimate_ms", "solver_status",
               "plan_total_s", "frontier_points", "units", "micro_batch", "pred_peak_gib", "pred_step_s", "error"]
    common.print_table(rows, title=f"Planner speed (budget {BUDGET} per GPU, {PROFILE})", columns=columns)
    common.write_csv(rows, "planner_speed", columns=columns)
    ok = [r for r in rows if "estimate_ms" in r]
    if ok:
        common.save_figure(plot(ok), "planner_speed")
    print(f"\nbench_planner_speed: {time.perf_counter() - start:.0f} s; outputs in {common.OUT_DIR}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CI", "1")
    sys.exit(main())
