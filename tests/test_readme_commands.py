"""The README's and docs/' commands run as written (issue 36 item 3's last clause and its must-show walk-through).

A fenced code block that runs on a CPU in seconds is marked on the line before it: ``<!-- test-run -->``, or
``<!-- test-run: multiprocess -->`` for one that starts gloo ranks. Each page's marked blocks run in order, line
by line in bash, in one temporary folder with the repository's examples/ linked in, so a later block may use
what an earlier one wrote (the README's ``run`` reads the plan its ``plan`` wrote); ``shard-planner`` is this
Python's. The walk-through (the README's blocks, multiprocess included) must plan, report, estimate, export to
all four targets and run, and each must leave what it promises.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = (README, *sorted((ROOT / "docs").glob("*.md")))
MARKED = re.compile(r"<!--\s*test-run(?::\s*(\w+))?\s*-->\s*\n```[^\n]*\n(.*?)\n```", re.S)
TIMEOUT_S = 600  # the whole of one command on a loaded 2-core machine; a plan of the tiny example takes seconds


@dataclass(frozen=True)
class Block:
    """A marked code block: its page, whether it starts several processes, its commands (continuations joined)."""

    page: Path
    multiprocess: bool
    commands: tuple[str, ...]


def marked_blocks(page: Path) -> list[Block]:
    blocks = []
    for m in MARKED.finditer(page.read_text()):
        joined = m.group(2).replace("\\\n", " ")
        commands = tuple(c.strip() for c in joined.splitlines() if c.strip() and not c.strip().startswith("#"))
        blocks.append(Block(page, m.group(1) == "multiprocess", commands))
    return blocks


def run_blocks(blocks: list[Block], folder: Path) -> dict[str, str]:
    """Each command in ``folder`` as bash runs it; {command: its output}. Fails on the first non-zero exit."""
    script = Path(sys.executable).parent / "shard-planner"
    assert script.is_file(), f"{script}: the commands call it; install the package (pip install -e .)"
    (folder / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    outputs = {}
    for block in blocks:
        for command in block.commands:
            done = subprocess.run(["bash", "-c", command], cwd=folder, env=env, capture_output=True, text=True,
                                  timeout=TIMEOUT_S)
            outputs[command] = done.stdout + done.stderr
            assert done.returncode == 0, (f"{block.page.relative_to(ROOT)}: `{command}` exited {done.returncode}:\n"
                                          f"{outputs[command][-3000:]}")
    return outputs


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_quick_commands_run_as_written(tmp_path, page):
    blocks = [b for b in marked_blocks(page) if not b.multiprocess]
    if not blocks:
        pytest.skip("no marked commands")
    run_blocks(blocks, tmp_path)


WALKTHROUGH = {"plan": "tiny/plan.json", "report": "tiny/plan.report/report.html", "estimate": None,
               "export --to fsdp2": "tiny/apply_sharding.py", "export --to accelerate": "tiny/fsdp.yaml",
               "export --to torchtitan": "tiny/shard_planner_torchtitan.py",
               "export --to deepspeed": "tiny/ds_config.json", "run": "tiny/measurement.json"}


def walkthrough_step(command: str) -> str | None:
    """The walk-through step a README command is ('export --to fsdp2', 'run', ...), or None."""
    words = shlex.split(command)
    if words[:1] != ["shard-planner"] or len(words) < 2:
        return None
    if words[1] == "export":
        return f"export --to {words[words.index('--to') + 1]}"
    return words[1]


@pytest.mark.multiprocess
def test_the_readme_walkthrough_on_the_tiny_example(tmp_path):
    blocks = marked_blocks(README)
    steps = {walkthrough_step(c) for b in blocks for c in b.commands}
    assert set(WALKTHROUGH) <= steps, f"the README's walk-through lacks {sorted(set(WALKTHROUGH) - steps)}"
    outputs = run_blocks(blocks, tmp_path)
    for step, written in WALKTHROUGH.items():
        assert written is None or (tmp_path / written).is_file(), f"`{step}` did not write {written}"
    run_output = next(out for command, out in outputs.items() if walkthrough_step(command) == "run")
    assert "predicted" in run_output, run_output[-2000:]
