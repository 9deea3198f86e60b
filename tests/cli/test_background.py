"""The helper process of a command (shard_planner/cli/background.py): calls in order, results and
exceptions back, a helper that dies or is abandoned leaves nothing behind; and `plan` through it writes
the plan and report it writes in-process.

The forked path needs an interpreter without torch imported ([Note: when the helper is not forked]), so
those checks run small scripts in a fresh Python."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from shard_planner.cli.background import Helper, helper_process
from tests.paths import EXAMPLES, REPO

PRELUDE = textwrap.dedent("""
    import os, sys, time
    from shard_planner.cli.background import Helper, HelperDied, helper_process

    def add(a, b):
        return a + b

    def fail(message):
        raise ValueError(message)

    def fail_with_a_local_class():
        class LocalError(Exception):
            pass
        raise LocalError("only the helper knows this class")

    def say(text):
        print(text, flush=False)
        return os.getpid()

    def die(code):
        os._exit(code)

    def sleep(s):
        time.sleep(s)
""")


def _script(body: str) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_calls_run_in_a_forked_helper_in_order_and_results_come_back():
    out = _script("""
        print("before the fork", end="\\n")  # buffered: written once, not by both processes
        with helper_process() as h:
            assert h.forked and h.pid != os.getpid()
            first, second, pid = h.submit(add, 1, 2), h.submit(add, "a", "b"), h.submit(say, "from the helper")
            assert second.result() == "ab" and first.result() == 3  # asked out of order
            assert pid.result() == h.pid
        print("done")
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["before the fork", "from the helper", "done"]


def test_exceptions_come_back_and_the_helper_goes_on():
    out = _script("""
        with helper_process() as h:
            try:
                h.submit(fail, "bad input").result()
            except ValueError as exc:
                assert str(exc) == "bad input", exc
                assert "in the helper process" in exc.__notes__[0] and "in fail" in exc.__notes__[0]
            try:
                h.submit(fail_with_a_local_class).result()
            except RuntimeError as exc:  # its class does not exist outside the helper
                assert "LocalError: only the helper knows this class" in str(exc), exc
            assert h.submit(add, 2, 2).result() == 4
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_helper_that_dies_is_named_with_its_exit_status():
    out = _script("""
        with helper_process() as h:
            try:
                h.submit(die, 3).result()
            except HelperDied as exc:
                print(exc)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "the helper process exited with code 3 during die"


def test_leaving_the_block_early_kills_the_helper():
    out = _script("""
        try:
            with helper_process() as h:
                pid = h.pid
                h.submit(sleep, 60)
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
        try:
            os.kill(pid, 0)
            print("alive")
        except ProcessLookupError:
            print("gone")
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "gone"


def test_with_torch_imported_calls_run_here_when_asked():
    """The test process has torch imported: no fork; a call runs at result(), its exception as raised."""
    import torch  # noqa: F401

    with helper_process() as h:
        assert not h.forked and h.pid is None
        calls = []
        lazy = h.submit(calls.append, "ran")
        assert calls == []
        lazy.result()
        assert calls == ["ran"]
        with pytest.raises(ZeroDivisionError):
            h.submit(divmod, 1, 0).result()
    Helper().close()  # closing an unforked helper is a no-op


def _plan(args, cwd, env=None):
    return subprocess.run([sys.executable, "-m", "shard_planner.cli.main", "plan", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env=env)


def _without_created(path):
    plan = json.loads(path.read_text())
    plan.pop("created", None)
    plan.get("solver", {}).pop("seconds", None)
    return plan


def test_plan_through_the_helper_writes_what_plan_writes_in_process(tmp_path):
    """`shard-planner plan` in a fresh process (traced in the helper, figures rendered in both) and in
    this one (torch imported: no helper) give the same plan.json and the same report files."""
    from shard_planner.cli.main import main

    model = str(EXAMPLES / "gpt2.py")
    args = [model, "--gpus", "2", "--mem", "2GB", "--profile", "cpu-gloo"]
    out = _plan([*args, "-o", str(tmp_path / "forked" / "plan.json")], REPO)
    assert out.returncode == 0, out.stderr
    assert "(in the helper process, beside the imports)" in out.stdout
    assert main(["plan", *args, "-o", str(tmp_path / "here" / "plan.json")]) == 0
    assert _without_created(tmp_path / "forked" / "plan.json") == _without_created(tmp_path / "here" / "plan.json")
    for name in ("frontier.png", "memory_timeline.png", "units.png"):
        forked, here = tmp_path / "forked" / "plan.report" / name, tmp_path / "here" / "plan.report" / name
        assert forked.read_bytes() == here.read_bytes(), name
    md = [re.sub(r"in [0-9.]+ s", "in S s", (tmp_path / where / "plan.report" / "report.md").read_text())
          for where in ("forked", "here")]  # the solver's wall time differs
    assert md[0] == md[1]


@pytest.mark.parametrize("body, message", [
    ("def build_model():\n    raise ValueError('no such layer')\n", "build_model() raised ValueError: no such layer"),
    ("import os\ndef build_model():\n    os._exit(0)\n", "the process tracing it exited with code 0: does the model file call exit()"),
])
def test_a_model_file_that_fails_in_the_helper_is_one_line(body, message, tmp_path):
    (tmp_path / "model.py").write_text(body + "def make_batch(b):\n    return None, None\n")
    out = _plan(["model.py", "--gpus", "2", "--mem", "2GB", "-o", "plan.json"], tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shard-planner: error: model.py") and message in lines[0], lines
    assert os.listdir(tmp_path) == ["model.py"]
