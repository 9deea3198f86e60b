"""The README's example plan, as a user runs it, and the picture the README shows.

    python benchmarks/bench_readme_example.py [--skip-variants]

Runs the README's first command, ``SHARD_PLANNER_SIZE=8b shard-planner plan examples/llama.py --gpus 8 --mem
40GB`` (Llama 3 8B on 8 H100s with 40 GB each), in a fresh process in a temporary folder, its report included,
and puts the report's frontier (``frontier.png``) and memory timeline (``memory_timeline.png``) side by side in
docs/img/readme_example.png. Unless ``--skip-variants``, also the variants docs/plan.md describes: the same plan
without tensor parallelism (``--tp 1``), and ``--global-batch 500``, searched over the degrees and at ``--tp 1``.

Writes reports/benchmarks/readme_example.md: each command with its exit code, wall and CPU seconds, the load
average, and everything it printed. The README and docs/ quote figures from it (tests/test_readme_figures.py
checks each against this report). The report's plots are being reworked; re-run this after a change to them.
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import OUT_DIR, load_text  # noqa: E402
from shard_planner.fileio import write_atomic  # noqa: E402

IMAGE = ROOT / "docs" / "img" / "readme_example.png"
PANELS = ("frontier.png", "memory_timeline.png")
SIZE = "8b"
FIRST = "plan examples/llama.py --gpus 8 --mem 40GB -o plan.json"
VARIANTS = (f"{FIRST} --tp 1 --no-report",
            f"{FIRST} --global-batch 500 --no-report",
            f"{FIRST} --global-batch 500 --tp 1 --no-report")


@dataclass(frozen=True)
class Outcome:
    """One command as run: what was typed, its exit code, wall and CPU seconds, the load before it, its output."""

    command: str
    exit_code: int
    wall_s: float
    cpu_s: float
    load_before: str
    output: str


def run_command(args: str, folder: Path) -> Outcome:
    """``shard-planner ARGS`` with SHARD_PLANNER_SIZE=8b in ``folder`` (examples/ linked in), as a user runs it."""
    examples = folder / "examples"
    if not examples.exists():
        examples.symlink_to(ROOT / "examples")
    argv = [sys.executable, "-m", "shard_planner.cli.main", *shlex.split(args)]
    env = {**os.environ, "SHARD_PLANNER_SIZE": SIZE, "PYTHONPATH": str(ROOT)}
    load, before, t0 = load_text(), resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True)
    wall_s, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return Outcome(f"SHARD_PLANNER_SIZE={SIZE} shard-planner {args}", done.returncode, wall_s, cpu_s, load,
                   (done.stdout + done.stderr).rstrip())


def write_image(report_dir: Path, out: Path = IMAGE) -> None:
    """The report's frontier and memory timeline side by side, scaled to one height, as one PNG."""
    from PIL import Image  # matplotlib's own dependency

    panels = [Image.open(report_dir / name).convert("RGB") for name in PANELS]
    height = min(p.height for p in panels)
    panels = [p.resize((round(p.width * height / p.height), height)) for p in panels]
    joined = Image.new("RGB", (sum(p.width for p in panels), height), "white")
    x = 0
    for panel in panels:
        joined.paste(panel, (x, 0))
        x += panel.width
    out.parent.mkdir(parents=True, exist_ok=True)
    joined.save(out, optimize=True)


def markdown(outcomes: list[Outcome]) -> str:
    """The report: each command, how it ended and what it printed, verbatim."""
    md = ["# The README's example plan, as a user runs it", "",
          "`python benchmarks/bench_readme_example.py`: each command in a fresh process in a temporary folder, on "
          "this project's shared 2-core CPU machine (wall times noisy: the load average before each is given). "
          f"The first command's report gives the README's picture ({IMAGE.relative_to(ROOT)}).", ""]
    for o in outcomes:
        md += [f"## `{o.command}`", "",
               f"exit code {o.exit_code}; {o.wall_s:.1f} s wall, {o.cpu_s:.1f} s CPU (helper process included); "
               f"load before: {o.load_before}", "", "```", o.output, "```", ""]
    return "\n".join(md)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-variants", action="store_true", help="run the README's first command only")
    args = ap.parse_args()
    outcomes = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for command in (FIRST, *(() if args.skip_variants else VARIANTS)):
            outcomes.append(run_command(command, folder))
            print(f"{outcomes[-1].command}: exit {outcomes[-1].exit_code}, {outcomes[-1].wall_s:.1f} s", flush=True)
            if command == FIRST and outcomes[0].exit_code != 0:
                print(outcomes[0].output, file=sys.stderr)
                return 1
            if command == FIRST:
                write_image(folder / "plan.report")
    write_atomic(OUT_DIR / "readme_example.md", markdown(outcomes))
    print(f"wrote {IMAGE.relative_to(ROOT)} and {OUT_DIR / 'readme_example.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
