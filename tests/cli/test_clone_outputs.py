"""The README's first command, run in a fresh clone, leaves nothing untracked (issue 36, item 12): what
shard-planner writes there is ignored."""

import shutil
import subprocess

import pytest

from tests.paths import REPO


@pytest.mark.parametrize("path", ["plan.json", "plan.report/report.html", "plan.report/memory_timeline.png",
                                  "measurement.json", "trace.json", "profiles/local.toml"])
def test_what_the_readme_commands_write_is_ignored(path):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "-C", str(REPO), "check-ignore", "--no-index", "-q", path])
    assert done.returncode == 0, f"{path} would be untracked in a clone after the README's commands"


def test_sources_are_not_ignored():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    for path in ("examples/llama.py", "profiles/h100-80gb.toml", "reports/README.md", "shard_planner/plan/__init__.py"):
        assert subprocess.run(["git", "-C", str(REPO), "check-ignore", "--no-index", "-q", path]).returncode == 1, path
