"""The planner's local search (shard_planner/solve/polish.py) on bench_plan.py's cases: what it adds
to the planner's time and what it gains, by the simulators.

    /work/venv/bin/python benchmarks/bench_polish.py [--quick]

Per case: the planner's wall time, the polish step's own (search and the full simulators' re-check of
its answer: ``PlanResult.timings.polish_s``), the chosen plan's predicted step time, and the solver
line's end (which says "polished by local search: -x% step time in n moves" when it helped).
``--quick``: the two timing cases (Llama 8B/8/40GB, 70B/64/80GB) only. Wall clock on a shared 2-core
machine: noisy; the search is time-limited, so under load it may stop earlier.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_plan  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the timing cases only")
    args = ap.parse_args()
    cases = [(ex, size, gpus, budget) for _, ex, size, gpus, budget, _ in bench_plan.TIMING]
    if not args.quick:
        cases += [(ex, size, gpus, b) for ex, size, gpus, tight, roomy in bench_plan.SPEEDUP for b in (tight, roomy)]
    print("load average at the start:", ", ".join(f"{x:.1f}" for x in os.getloadavg()), flush=True)
    print(f"{'case':28} {'plan s':>8} {'polish s':>9} {'step ms':>10}  solver line (end)")
    for ex, size, gpus, budget in cases:
        run = bench_plan.plan_once(ex, size, gpus, budget)
        label = f"{ex} {size} {gpus} GPUs {budget}"
        if run["result"] is None:
            print(f"{label:28} {run['plan_s']:8.2f} {'':>9} {'':>10}  infeasible: {run['error'][:60]}")
            continue
        plan, timings = run["result"].plan, run["result"].timings
        status = plan.solver.status
        tail = status[status.index("polished"):] if "polished" in status else "(not improved)"
        print(f"{label:28} {run['plan_s']:8.2f} {timings.polish_s:9.2f} {plan.predicted.step_time_s * 1e3:10.2f}  {tail}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
