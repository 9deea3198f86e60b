"""CPU step time, predicted against measured by ``shard-planner run``: a small transformers Llama config (full
training and LoRA) beside the example model file, on 2 CPU ranks over gloo (issue 36 item 7).

Each case is planned on the cpu-gloo profile (2 ranks, --mem 4GB) and run ``--runs`` times in fresh processes
(``run PLAN --no-checkpoint --steps 7``: 2 warm-up steps, then 7 timed); a row is one run: its measured median step
time, the plan's predicted one, the error, and the load average before it. Steps are wall-clock on a 2-core
machine, so the load beside each run is part of the figure.

    case        model                                                                   options
    hf-full     transformers LlamaConfig: hidden 256, MLP 688, 4 layers, 4 heads        --seq-len 256
                (2 key/value), vocabulary 32000, fp32 weights
    hf-lora     the same                                                                --seq-len 256 --lora 8
    example     examples/llama.py (the tiny Llama, its own TRAINING defaults)

    python benchmarks/bench_cpu_step.py --label after                              # this checkout's code
    python benchmarks/bench_cpu_step.py --label before --code /path/to/older/checkout

Rows of other labels already in reports/benchmarks/cpu_step.csv are kept, so ``before`` and ``after`` end up side
by side in cpu_step.md (medians per case and label).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import OUT_DIR, ROOT, error_pct, print_table, write_csv
from shard_planner.fileio import write_atomic

CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, intermediate_size=688,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=32000,
              max_position_embeddings=512, rms_norm_eps=1e-5, torch_dtype="float32", tie_word_embeddings=False)
CASES = {  # name: (model, plan options)
    "hf-full": ("<config>", ["--seq-len", "256"]),
    "hf-lora": ("<config>", ["--seq-len", "256", "--lora", "8"]),
    "example": ("examples/llama.py", []),
}
PLAN = ["--profile", "cpu-gloo", "--gpus", "2", "--mem", "4GB", "--no-report"]
COLUMNS = ["case", "label", "run", "predicted_s", "measured_s", "error_pct", "load_1min"]


def _cli(code: Path, argv: list[str], cwd: Path) -> None:
    """``shard-planner ARGV`` with ``code``'s shard_planner, no trace cache; one line and exit on failure."""
    env = {**os.environ, "PYTHONPATH": str(code), "SHARD_PLANNER_TRACE_CACHE": "off"}
    env.pop("SHARD_PLANNER_SIZE", None)
    done = subprocess.run([sys.executable, "-m", "shard_planner.cli.main", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench_cpu_step: shard-planner {' '.join(argv)} failed ({done.returncode}): "
                 f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")


def measure(code: Path, label: str, cases: list[str], runs: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "config.json").write_text(json.dumps(CONFIG))
        for case in cases:
            model, options = CASES[case]
            model = str(work / "config.json") if model == "<config>" else str(code / model)
            plan = work / f"{case}.json"
            _cli(code, ["plan", model, *options, *PLAN, "-o", str(plan)], work)
            for i in range(runs):
                load = os.getloadavg()[0]
                _cli(code, ["run", str(plan), "--no-checkpoint", "--steps", "7"], work)
                m = json.loads((work / "measurement.json").read_text())
                predicted, measured = m["predicted_step_time_s"], m["summary"]["step_time_median_s"]
                rows.append(dict(case=case, label=label, run=i + 1, predicted_s=round(predicted, 4),
                                 measured_s=round(measured, 4), error_pct=round(error_pct(predicted, measured), 1),
                                 load_1min=round(load, 2)))
                print(f"  {label} {case} #{i + 1}: predicted {predicted:.4f} s, measured {measured:.4f} s, "
                      f"load {load:.2f}", flush=True)
    return rows


def summary_md(rows: list[dict]) -> str:
    """Medians per case and label: the table cpu_step.md quotes."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["case"], r["label"]), []).append(r)
    med = lambda g, k: statistics.median(float(r[k]) for r in g)  # noqa: E731
    lines = ["# CPU step time: predicted vs measured by `run` (benchmarks/bench_cpu_step.py)", "",
             "2 CPU ranks over gloo, profile cpu-gloo; medians over the runs. error = predicted / measured - 1. "
             "Wall-clock steps on a 2-core machine: the load beside each run is part of the figure.", "",
             "| case | label | runs | predicted_s | measured_s | error_pct | load |", "|---|---|---|---|---|---|---|"]
    for (case, label), g in sorted(groups.items()):
        loads = [float(r["load_1min"]) for r in g]
        lines.append(f"| {case} | {label} | {len(g)} | {med(g, 'predicted_s'):.4f} | {med(g, 'measured_s'):.4f} | "
                     f"{med(g, 'error_pct'):+.1f} | {min(loads):.1f}-{max(loads):.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="after", help="the rows' label (default after)")
    ap.add_argument("--code", type=Path, default=ROOT, help="checkout whose shard_planner runs (default this one)")
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    rows = measure(args.code.resolve(), args.label, args.cases, args.runs)
    path = OUT_DIR / "cpu_step.csv"
    kept = [r for r in csv.DictReader(path.open())] if path.exists() else []
    rows = [r for r in kept if r["label"] != args.label or r["case"] not in args.cases] + rows
    write_csv(rows, "cpu_step", columns=COLUMNS)
    print_table(rows, title="CPU step time, each run", columns=COLUMNS)
    write_atomic(OUT_DIR / "cpu_step.md", summary_md(rows))
    print(f"wrote {OUT_DIR / 'cpu_step.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
