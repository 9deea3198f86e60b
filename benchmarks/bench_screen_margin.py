"""What a full search gains over the degree screen, per tensor-parallel degree: the figures behind
``SCREEN_MARGIN`` (shard_planner/solve/layout_search.py [Note: Screening the layouts]).

    python benchmarks/bench_screen_margin.py [--cases 8b-8 70b-64 ...]

Per case, the README-style command ``shard-planner plan examples/llama.py`` runs in a fresh process with
``SCREEN_MARGIN`` patched to 1 (every degree searched in full, each from its screened plan) and no helper
processes (torch imported first, so the screens and searches run in that process and are recorded there).
Columns: the degree's screened samples/s, its searched samples/s, the search's gain over the screen, and how
far the screen sits behind the best screened degree. A degree whose screen or search finds no plan shows
``-``. Writes reports/benchmarks/screen_margin.{md,csv}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import EXAMPLES, OUT_DIR, print_table, write_csv  # noqa: E402
from shard_planner.fileio import write_atomic  # noqa: E402

CASES = {  # name: (SHARD_PLANNER_SIZE, SHARD_PLANNER_SEQ, gpus, --mem, --global-batch or None)
    "8b-8": ("8b", 4096, 8, "40GB", None),  # the README's first plan
    "70b-64": ("70b", 4096, 64, "80GB", None),
    "70b-256": ("70b", 8192, 256, "80GB", 512),  # torchtitan's Llama 3 70B layout's scale
    "405b-512": ("405b", 8192, 512, "80GB", 256),
}

# Runs in the child: every degree searched, each screen and search recorded, one JSON line printed.
_CHILD = """
import json, sys
import torch  # noqa: F401  (imported first: the command forks no helper, cli/background.py)
from shard_planner.cli.main import main
from shard_planner.solve import layout_search
screens, searches = {}, {}
real_screen, real_plan = layout_search.screen, layout_search.plan_model
def screen(trace, request):
    s = real_screen(trace, request)
    screens[trace.tp_size] = s.best.samples_per_s if s.best is not None else None
    return s
def plan_model(trace, request):
    r = real_plan(trace, request)
    searches[trace.tp_size] = r.plan.predicted.samples_per_s
    return r
layout_search.screen, layout_search.plan_model, layout_search.SCREEN_MARGIN = screen, plan_model, 1.0
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("RESULT " + json.dumps({"screens": screens, "searches": searches}))
"""


def run_case(name: str, out_dir: Path) -> list[dict]:
    size, seq, gpus, mem, global_batch = CASES[name]
    cmd = [sys.executable, "-c", _CHILD, "plan", str(EXAMPLES / "llama.py"), "--gpus", str(gpus), "--mem", mem,
           "-o", str(out_dir / f"{name}.json"), "--no-report"]
    if global_batch is not None:
        cmd += ["--global-batch", str(global_batch)]
    env = dict(os.environ, SHARD_PLANNER_SIZE=size, SHARD_PLANNER_SEQ=str(seq), PYTHONPATH=str(ROOT))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{name}: no result (exit {out.returncode}): {out.stderr.strip()[-2000:]}")
    got = json.loads(line[len("RESULT "):])
    screens = {int(d): v for d, v in got["screens"].items()}
    searches = {int(d): v for d, v in got["searches"].items()}
    top = max((v for v in screens.values() if v), default=None)
    rows = []
    for d in sorted(screens):
        s, f = screens[d], searches.get(d)
        rows.append({"case": name, "tp": d, "screen_samples_per_s": s, "search_samples_per_s": f,
                     "gain_pct": 100 * (f / s - 1) if s and f else None,
                     "screen_behind_best_pct": 100 * (1 - s / top) if s and top else None})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = ap.parse_args()
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases:
            rows += run_case(name, Path(tmp))
            print(f"{name} done", file=sys.stderr, flush=True)
    print_table(rows, title="full search vs degree screen")
    write_csv(rows, "screen_margin")
    near = [r["gain_pct"] for r in rows if r["gain_pct"] is not None and r["screen_behind_best_pct"] is not None
            and r["screen_behind_best_pct"] < 10]
    lines = ["# What a full search gains over the degree screen (benchmarks/bench_screen_margin.py)", "",
             "Each degree searched in full from its screened plan (`SCREEN_MARGIN` patched to 1); samples/s as "
             "the planner predicts them. The margin (shard_planner/solve/layout_search.py) must exceed the gain of "
             "any degree that could win.", "",
             "| case | TP | screen samples/s | search samples/s | gain | screen behind the best |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        def pct(v):
            return "-" if v is None else f"{v:+.2f}%"
        def num(v):
            return "-" if v is None else f"{v:.4g}"
        lines.append(f"| {r['case']} | {r['tp']} | {num(r['screen_samples_per_s'])} | "
                     f"{num(r['search_samples_per_s'])} | {pct(r['gain_pct'])} | {pct(r['screen_behind_best_pct'])} |")
    lines += ["", f"Largest gain of a degree screened less than 10% behind the best: "
              f"{max(near):+.2f}%." if near else "No degree within 10% of the best.", ""]
    write_atomic(OUT_DIR / "screen_margin.md", "\n".join(lines))


if __name__ == "__main__":
    main()
