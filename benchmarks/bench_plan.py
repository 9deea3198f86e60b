"""End-to-end ``shard-planner plan`` on this machine: wall time (trace + solve + frontier + baselines) and
the predicted speedup of the chosen plan over the best hand-written policy that fits.

    /work/venv/bin/python benchmarks/bench_plan.py [--quick]

Rows:
- timing: Llama-style 8B on 8 GPUs at 40GB, 70B on 64 GPUs at 80GB (h100-80gb profile); targets
  under 5 s and 15 s;
- speedup: each example model at two budgets on 8 GPUs.

Writes reports/benchmarks/plan.csv and plan.md and prints the table. Timings are wall clock on a
shared 2-core machine: noisy; the CP-SAT status column says whether each solve was proven optimal.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shard_planner.errors import InfeasibleError  # noqa: E402
from shard_planner.modelfile import load_model_file  # noqa: E402
from shard_planner.profile import load_profile  # noqa: E402
from shard_planner.solve import plan_model  # noqa: E402
from shard_planner.trace import trace_model  # noqa: E402
from shard_planner.units import format_bytes, parse_bytes  # noqa: E402

TIMING = [  # (label, example, size, gpus, budget, target_s)
    ("Llama 8B, 8 GPUs, 40GB", "llama", "8b", 8, "40GB", 5.0),
    ("Llama 70B, 64 GPUs, 80GB", "llama", "70b", 64, "80GB", 15.0),
]
SPEEDUP = [  # (example, size, gpus, tight budget, roomy budget): tight makes the hand-written policies choose
    ("gpt2", "xl", 8, "7GB", "12GB"),
    ("llama", "8b", 8, "30GB", "70GB"),
    ("vit", "large", 8, "5GB", "8GB"),
    ("encdec", "base", 8, "4GB", "6GB"),
    ("unet", "base", 8, "2.2GB", "4GB"),
]


def plan_once(example: str, size: str, gpus: int, budget: str, profile_name: str = "h100-80gb"):
    os.environ["SHARD_PLANNER_SIZE"] = size
    path = str(ROOT / "examples" / f"{example}.py")
    profile = load_profile(profile_name)
    t0 = time.perf_counter()
    micro_batch = int(load_model_file(path).training.get("micro_batch", 1))
    trace = trace_model(path, dtype="bfloat16")
    t1 = time.perf_counter()
    try:
        plan = plan_model(trace, gpus=gpus, mem_budget_bytes=parse_bytes(budget), profile=profile,
                          gpus_per_node=8, micro_batch=micro_batch, model_path=path, profile_name=profile_name)
    except InfeasibleError as exc:
        return None, t1 - t0, time.perf_counter() - t1, str(exc)
    return plan, t1 - t0, time.perf_counter() - t1, ""


def speedup(plan) -> tuple[str, float | None]:
    fitting = [b for b in plan.baselines if b.fits]
    if not fitting:
        return "none fits", None
    best = min(fitting, key=lambda b: b.step_time_s)
    return best.description, best.step_time_s / plan.predicted.step_time_s - 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="timing rows only")
    args = ap.parse_args()
    rows = []
    print("load average at the start:", ", ".join(f"{x:.1f}" for x in os.getloadavg()), flush=True)
    for label, ex, size, gpus, budget, target in TIMING:
        plan, trace_s, solve_s, err = plan_once(ex, size, gpus, budget)
        best, gain = speedup(plan) if plan else ("", None)
        rows.append(dict(kind="timing", model=f"{ex} {size}", gpus=gpus, budget=budget,
                         trace_s=round(trace_s, 2), solve_s=round(solve_s, 2), total_s=round(trace_s + solve_s, 2),
                         target_s=target, status=plan.solver.status if plan else err[:80],
                         peak=format_bytes(plan.predicted.peak_bytes) if plan else "",
                         step_ms=round(plan.predicted.step_time_s * 1e3, 1) if plan else "",
                         best_hand_written=best, speedup_pct=round(100 * gain, 1) if gain is not None else ""))
        print(rows[-1], flush=True)
    if not args.quick:
        for ex, size, gpus, tight, roomy in SPEEDUP:
            for budget in (tight, roomy):
                plan, trace_s, solve_s, err = plan_once(ex, size, gpus, budget)
                best, gain = speedup(plan) if plan else ("", None)
                rows.append(dict(kind="speedup", model=f"{ex} {size}", gpus=gpus, budget=budget,
                                 trace_s=round(trace_s, 2), solve_s=round(solve_s, 2),
                                 total_s=round(trace_s + solve_s, 2), target_s="",
                                 status=plan.solver.status if plan else err[:80],
                                 peak=format_bytes(plan.predicted.peak_bytes) if plan else "",
                                 step_ms=round(plan.predicted.step_time_s * 1e3, 1) if plan else "",
                                 best_hand_written=best, speedup_pct=round(100 * gain, 1) if gain is not None else ""))
                print(rows[-1], flush=True)
    out = ROOT / "reports" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "plan.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    cols = list(rows[0])
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    (out / "plan.md").write_text("# shard-planner plan: wall time and predicted speedup\n\n"
                                 f"Machine: shared 2-core CPU (timings noisy; load average at the end {load}). "
                                 "Profile h100-80gb.\n\n" + "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
