"""Planner speed: the README's ``shard-planner plan`` command end to end, and where its time goes.

Each case is the command a user runs, in a fresh process, report included (h100-80gb profile, its default
tensor-parallel degree search):

    case    model                                              GPUs  budget
    8b      SHARD_PLANNER_SIZE=8b examples/llama.py            8     40GB   (the README's first plan)
    hf-8b   a transformers Llama-3-8B config.json              8     40GB
    70b     SHARD_PLANNER_SIZE=70b examples/llama.py           64    80GB

Per run: the wall seconds of the command, its CPU seconds (the command and its helper processes, from
``getrusage(RUSAGE_CHILDREN)`` of this process, so that a loaded machine's wall clock can be read against
them), the load average before it, and the split: ``imports`` (the command's own imports, from its ``time:``
line), each traced degree (CPU seconds of each helper call: ``trace tp1`` includes that helper's torch
import, ``styles`` the derivation of the tensor-parallel styles with the other helper's torch import, ``tp2``..
``tp8`` each degree's trace with its screen when a helper screened it), ``screen`` (the screens this
process ran), ``solve`` (the chosen degree's search, frontier, baselines, polish and simplification) and
``report``. ``cache``: ``cold`` runs with an empty trace cache (shard_planner/trace/trace_cache.py),
``warm`` after one run of the same command filled it; code that has no trace cache runs cold either way.

    python benchmarks/bench_planner_speed.py --label after                        # this checkout's code
    python benchmarks/bench_planner_speed.py --label before --code /path/to/older/checkout --cache cold
    python benchmarks/bench_planner_speed.py --cases 8b --runs 1

Rows of another case, label or cache already in reports/benchmarks/planner_speed.csv are kept, so a ``before`` and an
``after`` measured separately end up side by side in planner_speed.csv and planner_speed.md (medians per
case, label and cache).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = Path(os.environ.get("SHARD_PLANNER_BENCH_OUT", ROOT / "reports" / "benchmarks"))
CACHE_ENV = "SHARD_PLANNER_TRACE_CACHE"  # shard_planner/trace/trace_cache.py

# Meta-Llama-3-8B's config.json (huggingface.co/meta-llama/Meta-Llama-3-8B), the fields a LlamaConfig reads
HF_LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                    max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu",
                    tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=128000, eos_token_id=128001)
CASES = {  # name: (model, SHARD_PLANNER_SIZE, gpus, budget)
    "8b": ("examples/llama.py", "8b", 8, "40GB"),
    "hf-8b": ("<config>", None, 8, "40GB"),
    "70b": ("examples/llama.py", "70b", 64, "80GB"),
}
COLUMNS = ["case", "label", "cache", "run", "wall_s", "cpu_s", "load_1min", "imports_s", "trace_tp1_cpu_s",
           "styles_cpu_s", "trace_tp2_cpu_s", "trace_tp4_cpu_s", "trace_tp8_cpu_s", "screen_s", "solve_s",
           "report_s", "chosen", "step_ms", "peak_gib"]


# --- the child: one command, instrumented -------------------------------------------------------------------

def child(calls_file: str, argv: list[str]) -> int:
    """Run ``shard-planner plan argv`` in this process as the CLI does, recording each helper call's CPU
    seconds (appended to ``calls_file``) and the command's ``time:`` line figures; print them as one
    ``RESULT`` JSON line. (The file is an argument, not a variable: the trace cache keys on the environment.)"""
    from shard_planner.cli import background, plan as plan_cli
    from shard_planner.cli.main import main

    served = background._reply

    def recorded_reply(fn, args):
        c0 = time.process_time()
        out = served(fn, args)
        degree = next((a for a in args if type(a) is int), 1)
        with open(calls_file, "a") as f:
            f.write(json.dumps(dict(fn=fn.__name__, degree=degree, cpu_s=time.process_time() - c0)) + "\n")
        return out

    found: dict = {}
    timed = plan_cli.time_line

    def _layout_screen_s(t) -> float:  # the field's name before the layout search (older checkouts, --code)
        return getattr(t, "layout_screen_s", None) or getattr(t, "degree_screen_s", 0.0)

    def recorded_time_line(result, trace_s, report_s, import_s=None, *flags):
        t, p = result.timings, result.plan
        found.update(imports_s=import_s, report_s=report_s, screen_s=_layout_screen_s(t) or t.screen_s,
                     solve_s=t.solve_s + t.frontier_s + t.baselines_s + t.polish_s + t.simplify_s,
                     chosen=p.mesh.description, step_ms=p.predicted.step_time_s * 1e3,
                     peak_gib=p.predicted.peak_bytes / 2**30, trace_tp1_s=trace_s)
        return timed(result, trace_s, report_s, import_s, *flags)

    background._reply, plan_cli.time_line = recorded_reply, recorded_time_line
    code = main(["plan", *argv])
    print("RESULT " + json.dumps(found), flush=True)
    return code


# --- the parent: cases, runs, the report --------------------------------------------------------------------

def command_line(case: str, config_dir: Path, out_dir: Path) -> tuple[list[str], dict]:
    model, size, gpus, budget = CASES[case]
    model = str(config_dir / "config.json") if model == "<config>" else str(ROOT / model)
    env = {"SHARD_PLANNER_SIZE": size} if size else {}
    return [model, "--gpus", str(gpus), "--mem", budget, "-o", str(out_dir / "plan.json")], env


def run_once(code: Path, case: str, cache_dir: str, config_dir: Path) -> dict:
    """One command in a fresh process with ``code``'s shard_planner; its row (without labels)."""
    with tempfile.TemporaryDirectory() as tmp:
        argv, extra = command_line(case, config_dir, Path(tmp))
        calls = Path(tmp) / "calls.jsonl"
        env = {k: v for k, v in os.environ.items() if k != "SHARD_PLANNER_SIZE"}
        env.update(extra, PYTHONPATH=str(code), **{CACHE_ENV: cache_dir})
        load = os.getloadavg()[0]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "--child", str(calls), *argv], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        wall_s = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if done.returncode != 0 or line is None:
            raise RuntimeError(f"{case} failed ({done.returncode}): {(done.stderr or done.stdout)[-1500:]}")
        helper_calls = [json.loads(ln) for ln in calls.read_text().splitlines()] if calls.exists() else []
    row = dict(json.loads(line[len("RESULT "):]), wall_s=wall_s, load_1min=load,
               cpu_s=(after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
    row.update(split_of(helper_calls))
    return row


def split_of(helper_calls: list[dict]) -> dict:
    """CPU seconds of the helper calls by what they did: each degree's trace (with its screen when a
    helper screened it) and the styles' derivation."""
    split: dict[str, float] = {}
    for c in helper_calls:
        name = {"_load_and_trace": "trace_tp1_cpu_s", "_degree_styles": "styles_cpu_s"}.get(c["fn"])
        if name is None and "trace" in c["fn"]:
            name = f"trace_tp{c['degree']}_cpu_s"
        if name is not None:
            split[name] = split.get(name, 0.0) + c["cpu_s"]
    return split


def measure(code: Path, label: str, cases: list[str], caches: list[str], runs: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as config_dir:
        (Path(config_dir) / "config.json").write_text(json.dumps(HF_LLAMA3_8B))
        for case in cases:
            for cache in caches:
                with tempfile.TemporaryDirectory() as warm_dir:
                    if cache == "warm":  # fill it once, unrecorded
                        run_once(code, case, warm_dir, Path(config_dir))
                    for i in range(runs):
                        with tempfile.TemporaryDirectory() as cold_dir:
                            r = run_once(code, case, warm_dir if cache == "warm" else cold_dir, Path(config_dir))
                        rows.append(dict(r, case=case, label=label, cache=cache, run=i + 1))
                        print(f"  {label} {case} {cache} #{i + 1}: wall {r['wall_s']:.2f} s, CPU {r['cpu_s']:.2f} s, "
                              f"load {r['load_1min']:.2f}", flush=True)
    return rows


def merged(rows: list[dict]) -> list[dict]:
    """``rows`` after the rows already in planner_speed.csv of another (case, label, cache)."""
    path = OUT_DIR / "planner_speed.csv"
    kept = []
    measured = {(r["case"], r["label"], r["cache"]) for r in rows}
    if path.exists():
        with open(path, newline="") as f:
            kept = [r for r in csv.DictReader(f) if r.get("label") and (r["case"], r["label"], r["cache"]) not in measured]
    return kept + rows


def summary_md(rows: list[dict]) -> str:
    """Medians per (case, label, cache), and the runs' load averages."""
    def med(group, key):
        vals = [float(r[key]) for r in group if r.get(key) not in (None, "")]
        return f"{statistics.median(vals):.2f}" if vals else "-"

    keys = sorted({(r["case"], r["label"], r["cache"]) for r in rows},
                  key=lambda k: (list(CASES).index(k[0]), "(" in k[1], not k[1].startswith("before"), k[2]))
    split = COLUMNS[7:16]
    lines = ["# Planner speed: `shard-planner plan` end to end (benchmarks/bench_planner_speed.py)", "",
             "Medians over the runs; seconds. `cpu_s`: the command and its helper processes; the split columns "
             "ending in `_cpu_s` are CPU seconds of one helper call each (`trace_tp1` and `styles` include that "
             "helper's `import torch`), the others the command's own wall seconds from its `time:` line. Load: "
             "the 1-minute load average before each run (2 cores; a run of this benchmark alone keeps it near 2). "
             "`cold`: an empty trace cache; `warm`: the same command run once before (shard_planner/trace/"
             "trace_cache.py); code without the cache is always cold. The machine is shared: wall seconds "
             "follow the other processes' load, CPU seconds much less.", "",
             "| case | label | cache | runs | wall_s | cpu_s | load | " + " | ".join(split) + " | chosen |",
             "|" + "---|" * (8 + len(split))]
    for case, label, cache in keys:
        g = [r for r in rows if (r["case"], r["label"], r["cache"]) == (case, label, cache)]
        loads = [float(r["load_1min"]) for r in g]
        lines.append(f"| {case} | {label} | {cache} | {len(g)} | {med(g, 'wall_s')} | {med(g, 'cpu_s')} | "
                     f"{min(loads):.1f}-{max(loads):.1f} | " + " | ".join(med(g, c) for c in split)
                     + f" | {g[0].get('chosen', '')} |")
    return "\n".join(lines) + "\n"


def write(rows: list[dict]) -> None:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    with open(OUT_DIR / "planner_speed.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: (f"{r[c]:.3f}" if isinstance(r.get(c), float) else r.get(c, "")) for c in COLUMNS})
    (OUT_DIR / "planner_speed.md").write_text(summary_md(rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--label", default="after", help="the rows' label (default after)")
    ap.add_argument("--code", type=Path, default=ROOT, help="checkout whose shard_planner runs (default this one)")
    ap.add_argument("--cache", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--md-only", action="store_true", help="only write planner_speed.md from planner_speed.csv")
    args = ap.parse_args(argv)
    if args.md_only:
        return rewrite_md()
    rows = measure(args.code.resolve(), args.label, args.cases, args.cache, args.runs)
    rows = merged(rows)
    write(rows)
    print(summary_md(rows))
    return 0


def rewrite_md() -> int:
    """planner_speed.md again from planner_speed.csv (after relabelling rows by hand)."""
    with open(OUT_DIR / "planner_speed.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    (OUT_DIR / "planner_speed.md").write_text(summary_md(rows))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2], sys.argv[3:]))
    sys.exit(main())
