"""End-to-end ``shard-planner plan`` on this machine: where the time goes (trace, screen, CP-SAT solves,
the simulators' re-checks, polish, simplify, frontier, report) and the predicted speedup of the chosen
plan over the best hand-written policy that fits.

    python benchmarks/bench_plan.py [--quick] [--no-report] [--transformers]

Rows:
- timing: Llama-style 8B on 8 GPUs at 40GB, 70B on 64 GPUs at 80GB (h100-80gb profile); targets
  (the command end to end, ``cli_s``) under 5 s and 10 s; with ``--transformers``, the same for a transformers
  ``LlamaForCausalLM`` of the Llama 3 8B / 70B configs (model ``hf-llama``; the model file,
  :data:`HF_LLAMA`, is written to a temporary folder);
- speedup: each example model at two budgets on 8 GPUs.

Columns: ``trace_s``; the planner's stages from ``PlanResult.timings`` (``screen_s``, ``solve_s``,
``frontier_s``, ``baselines_s``, ``polish_s``, ``simplify_s``; ``plan_s`` their total), and across
them ``cpsat_s`` (the CP-SAT solves, building the program included), ``recheck_s`` (the simulators'
checks, ``plans`` of them); ``report_s`` (write_report with the planner's estimate; timing rows only);
``cpu_s``: the process CPU time of trace + plan + report, which a busy machine does not inflate
(``trace_cpu_s``, ``plan_cpu_s``, ``report_cpu_s``: its parts; the report's includes importing matplotlib);
``step_ms`` the chosen plan's predicted step time and ``fastest_ms`` the fastest plan found (the
planner prefers a simpler plan within 1%). Timing rows also run the command itself, ``shard-planner plan
<model> --gpus N --mem SIZE`` in a fresh Python process, report included, as a user runs it: ``cli_s``
its end-to-end wall time (interpreter start, imports, trace, plan, report, exit: what the targets are
about) and ``cli_cpu_s`` its CPU time; the in-process columns above leave out the interpreter, the
imports done before the trace and the exit, and run without the command's collector settings
(shard_planner/cli/collector.py).

Writes reports/benchmarks/plan.csv and plan.md and prints the table. Wall clock on a shared 2-core
machine is noisy: the load average is printed; the CP-SAT solves stop at a deterministic work limit,
so the plans do not depend on it.
"""

from __future__ import annotations

import argparse
import csv
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shard_planner.errors import InfeasibleError  # noqa: E402
from shard_planner.model.modelfile import load_model_file  # noqa: E402
from shard_planner.hardware.profile import load_profile  # noqa: E402
from shard_planner.solve import PlanRequest, plan_model  # noqa: E402
from shard_planner.trace import trace_model  # noqa: E402
from shard_planner.units import format_bytes, parse_bytes  # noqa: E402

TIMING = [  # (label, example, size, gpus, budget, target_s)
    ("Llama 8B, 8 GPUs, 40GB", "llama", "8b", 8, "40GB", 5.0),
    ("Llama 70B, 64 GPUs, 80GB", "llama", "70b", 64, "80GB", 10.0),
]
# transformers' LlamaForCausalLM at the Llama 3 8B and 70B shapes (config.json of meta-llama/Meta-Llama-3-8B
# and -70B: hidden 4096/8192, 32/80 layers, 32/64 heads, 8 kv heads, intermediate 14336/28672, vocab 128256,
# rope theta 500000), token ids at seq 4096, the loss from the model's logits.
HF_LLAMA = '''
import os
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

CFG = {
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256),
    "70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                intermediate_size=28672, vocab_size=128256),
}[os.environ.get("SHARD_PLANNER_SIZE", "8b")]
SEQ = 4096


def build_model():
    return LlamaForCausalLM(LlamaConfig(**CFG, max_position_embeddings=8192, rope_theta=500000.0,
                                        attn_implementation="sdpa", tie_word_embeddings=False))


def make_batch(batch_size):
    ids = torch.randint(0, CFG["vocab_size"], (batch_size, SEQ + 1))
    return (ids[:, :-1].contiguous(),), ids[:, 1:].contiguous()


def loss_fn(output, targets):
    return F.cross_entropy(output.logits.flatten(0, -2).float(), targets.flatten())


TRAINING = {"micro_batch": 1, "seq_len": SEQ, "optimizer": "adamw"}
'''

SPEEDUP = [  # (example, size, gpus, tight budget, roomy budget): tight makes the hand-written policies choose
    ("gpt2", "xl", 8, "7GB", "12GB"),
    ("llama", "8b", 8, "30GB", "70GB"),
    ("vit", "large", 8, "5GB", "8GB"),
    ("encdec", "base", 8, "4GB", "6GB"),
    ("unet", "base", 8, "2.2GB", "4GB"),
]


def plan_once(example: str, size: str, gpus: int, budget: str, profile_name: str = "h100-80gb",
              report: bool = False, path: str | None = None) -> dict:
    """Trace and plan one case (and write its report when asked); the result, its timings, or the
    infeasibility message. ``path``: the model file (default examples/<example>.py)."""
    os.environ["SHARD_PLANNER_SIZE"] = size
    path = path or str(ROOT / "examples" / f"{example}.py")
    profile = load_profile(profile_name)
    c0, t0 = time.process_time(), time.perf_counter()
    micro_batch = int(load_model_file(path).training.get("micro_batch", 1))
    trace = trace_model(path, dtype="bfloat16")
    out = dict(trace_s=time.perf_counter() - t0, result=None, error="", report_s=None, report_cpu_s=None,
               trace_cpu_s=time.process_time() - c0)
    t1, c1 = time.perf_counter(), time.process_time()
    try:
        out["result"] = plan_model(trace, PlanRequest(gpus=gpus, mem_budget_bytes=parse_bytes(budget), profile=profile,
                                                      gpus_per_node=8, micro_batch=micro_batch, model_path=path,
                                                      profile_name=profile_name))
    except InfeasibleError as exc:
        out["error"] = str(exc)
    out["plan_s"], out["plan_cpu_s"] = time.perf_counter() - t1, time.process_time() - c1
    if report and out["result"] is not None:
        t2, c2 = time.perf_counter(), time.process_time()
        from shard_planner.report import write_report  # matplotlib: its import is part of the report's cost

        with tempfile.TemporaryDirectory() as tmp:
            write_report(out["result"].plan, tmp, trace=trace, profile=profile, estimate=out["result"].estimate)
        out["report_s"], out["report_cpu_s"] = time.perf_counter() - t2, time.process_time() - c2
    out["cpu_s"] = time.process_time() - c0
    return out


def cli_once(example: str, size: str, gpus: int, budget: str, path: str | None = None) -> dict:
    """``shard-planner plan`` in a fresh process, as a user runs it (report included; the h100-80gb
    profile and its 8 GPUs per node, as :func:`plan_once`): wall and CPU seconds of the whole command."""
    path = path or str(ROOT / "examples" / f"{example}.py")
    env = dict(os.environ, SHARD_PLANNER_SIZE=size)
    with tempfile.TemporaryDirectory() as tmp:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "shard_planner.cli.main", "plan", path, "--gpus", str(gpus),
                               "--mem", budget, "-o", str(Path(tmp) / "plan.json")],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        wall_s = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"shard-planner plan {path} failed ({done.returncode}): {done.stderr[-2000:]}")
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return dict(cli_s=wall_s, cli_cpu_s=cpu_s)


def row(kind: str, ex: str, size: str, gpus: int, budget: str, target, run: dict, cli: dict | None = None) -> dict:
    res = run["result"]
    plan = res.plan if res is not None else None
    t = res.timings if res is not None else None
    best, gain = speedup(plan) if plan else ("", None)
    total = run["trace_s"] + run["plan_s"] + (run["report_s"] or 0.0)
    return dict(kind=kind, model=f"{ex} {size}", gpus=gpus, budget=budget, trace_s=round(run["trace_s"], 2),
                screen_s=round(t.screen_s, 2) if t else "", solve_s=round(t.solve_s, 2) if t else "",
                cpsat_s=round(t.cpsat_s, 2) if t else "", recheck_s=round(t.simulate_s, 2) if t else "",
                plans=t.simulated_plans if t else "", polish_s=round(t.polish_s, 2) if t else "",
                simplify_s=round(t.simplify_s, 2) if t else "", frontier_s=round(t.frontier_s, 2) if t else "",
                baselines_s=round(t.baselines_s, 2) if t else "", plan_s=round(run["plan_s"], 2),
                report_s=round(run["report_s"], 2) if run["report_s"] is not None else "",
                total_s=round(total, 2), cli_s=round(cli["cli_s"], 2) if cli else "",
                cli_cpu_s=round(cli["cli_cpu_s"], 2) if cli else "",
                cpu_s=round(run["cpu_s"], 2), trace_cpu_s=round(run["trace_cpu_s"], 2),
                plan_cpu_s=round(run["plan_cpu_s"], 2),
                report_cpu_s=round(run["report_cpu_s"], 2) if run["report_cpu_s"] is not None else "",
                target_s=target,
                status=plan.solver.status[-120:] if plan else run["error"][:80],
                peak=format_bytes(plan.predicted.peak_bytes) if plan else "",
                step_ms=round(plan.predicted.step_time_s * 1e3, 2) if plan else "",
                fastest_ms=round(res.fastest_step_time_s * 1e3, 2) if res else "",
                best_hand_written=best, speedup_pct=round(100 * gain, 1) if gain is not None else "")


def speedup(plan) -> tuple[str, float | None]:
    fitting = [b for b in plan.baselines if b.fits]
    if not fitting:
        return "none fits", None
    best = min(fitting, key=lambda b: b.step_time_s)
    return best.description, best.step_time_s / plan.predicted.step_time_s - 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="timing rows only")
    ap.add_argument("--no-report", action="store_true", help="do not time the report in the timing rows")
    ap.add_argument("--transformers", action="store_true",
                    help="also time a transformers LlamaForCausalLM of the same configs (needs transformers)")
    args = ap.parse_args()
    rows = []
    print("load average at the start:", ", ".join(f"{x:.1f}" for x in os.getloadavg()), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf_path = Path(tmp) / "hf_llama.py"
        hf_path.write_text(HF_LLAMA)
        for ex, path in [("llama", None)] + ([("hf-llama", str(hf_path))] if args.transformers else []):
            for _label, _, size, gpus, budget, target in TIMING:
                rows.append(row("timing", ex, size, gpus, budget, target,
                                plan_once(ex, size, gpus, budget, report=not args.no_report, path=path),
                                cli_once(ex, size, gpus, budget, path=path)))
                print(rows[-1], flush=True)
    if not args.quick:
        for ex, size, gpus, tight, roomy in SPEEDUP:
            for budget in (tight, roomy):
                rows.append(row("speedup", ex, size, gpus, budget, "", plan_once(ex, size, gpus, budget)))
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
    (out / "plan.md").write_text("# shard-planner plan: where the time goes, and the predicted speedup\n\n"
                                 f"Machine: shared 2-core CPU (wall times noisy, cpu_s is not; load average at the "
                                 f"end {load}). "
                                 "Profile h100-80gb. cli_s: the whole `shard-planner plan` command in a fresh process "
                                 "(what target_s is about).\n\n" + "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
