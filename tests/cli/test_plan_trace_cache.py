"""`plan` twice on one model: the second takes every trace (each degree's, and the tensor-parallel styles) from
the trace cache (shard_planner/trace/trace_cache.py) and writes the same plan; a changed model file is
traced again."""

from __future__ import annotations

import json
import shutil

import pytest

from shard_planner.cli.main import main
from shard_planner.trace.trace_cache import CACHE_ENV
from tests.paths import EXAMPLES


def _plan(model, out):
    return main(["plan", str(model), "--gpus", "8", "--mem", "4GB", "-o", str(out), "--no-report",
                 "--time-limit", "0.5"])


def _decisions(path):
    """The plan file without the solver's wall seconds (the one figure that differs between two runs)."""
    plan = json.loads(path.read_text())
    plan["solver"].pop("seconds")
    return plan


def _no_tracing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("traced again: the trace cache was not used")

    monkeypatch.setattr("shard_planner.trace.tracer.trace_model", refuse)
    monkeypatch.setattr("shard_planner.trace.tp_degrees.degree_styles", refuse)


def test_a_second_plan_traces_nothing_and_plans_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    model = tmp_path / "llama.py"
    shutil.copy(EXAMPLES / "llama.py", model)
    assert _plan(model, tmp_path / "first.json") == 0
    assert len(list((tmp_path / "cache").glob("*.pickle"))) == 3  # degree 1, the styles, degree 2
    with monkeypatch.context() as m:
        _no_tracing(m)
        assert _plan(model, tmp_path / "second.json") == 0
    assert _decisions(tmp_path / "second.json") == _decisions(tmp_path / "first.json")
    model.write_text(model.read_text() + "\n# edited\n")
    with monkeypatch.context() as m, pytest.raises(AssertionError, match="traced again"):
        _no_tracing(m)
        main(["plan", str(model), "--gpus", "8", "--mem", "4GB", "-o", str(tmp_path / "third.json"),
              "--no-report"])


def test_with_every_trace_cached_the_helpers_screen_every_degree_above_1(tmp_path, monkeypatch):
    """cli/plan_degrees.py ``_deal``: a cached trace is a file read, so the helper that reads it screens it too
    (forked after this process imported the planner: cli/plan.py [Note: Importing before the helpers fork]),
    and this process screens degree 1 only."""
    import torch  # noqa: F401  (torch imported: the helpers' calls run in this process, where they are recorded)

    from shard_planner.cli import background, plan_degrees

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    model = tmp_path / "llama.py"
    shutil.copy(EXAMPLES / "llama.py", model)
    assert _plan(model, tmp_path / "first.json") == 0
    screened_there, submitted = {}, []
    traced, submit = plan_degrees._trace_and_screen, background.Helper.submit

    def recording(model, hf, dtype, styles, degree, request):
        screened_there[degree] = request is not None
        return traced(model, hf, dtype, styles, degree, request)

    monkeypatch.setattr(plan_degrees, "_trace_and_screen", recording)
    monkeypatch.setattr(background.Helper, "submit", lambda self, fn, *a: submitted.append(fn) or submit(self, fn, *a))
    assert _plan(model, tmp_path / "second.json") == 0
    assert screened_there == {2: True}  # tiny llama: 4 and 8 refused before a trace
    assert plan_degrees._trace_and_screen in submitted
    assert _decisions(tmp_path / "second.json") == _decisions(tmp_path / "first.json")


def test_the_deal_of_cached_degrees_screens_them_in_both_helpers_in_turn():
    from shard_planner.cli.plan_degrees import _deal

    first, second = object(), object()
    assert _deal([2, 4, 8], second, first, cached=True) == {2: (second, True), 4: (first, True), 8: (second, True)}
    assert _deal([2, 4, 8], second, first) == {2: (second, False), 4: (first, False), 8: (second, True)}  # traced


def test_what_plan_imports_before_forking_its_helpers_is_not_torch():
    """cli/plan.py [Note: Importing before the helpers fork]: the planner, imported before the fork when the
    trace is cached, must not import torch (cli/background.py forks no helper from a process that has: the
    warm command would then run every helper call in itself), nor the report this process imports later."""
    import subprocess
    import sys

    code = ("import sys; from shard_planner.cli.plan import _import_planner, _import_report; _import_planner(); "
            "from shard_planner.cli.background import _worth_forking; print(_worth_forking()); _import_report(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(os_can_fork())


def os_can_fork() -> bool:
    import os

    return hasattr(os, "fork") and (os.cpu_count() or 1) >= 2
