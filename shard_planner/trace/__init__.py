"""Tracing: run one forward + backward without real memory and record what the planner needs.

The trace's types are imported here; the tracer (and torch with it) only when one of its names is first
used, so the planner, the report and trace files work without importing torch (``plan`` traces in its
helper process while the command imports the planner: cli/background.py)."""

import importlib

from shard_planner.trace.types import Affine, ModelTrace, ModuleTrace

_LAZY = {
    "Difference": "realrun",
    "compare_with_real_run": "realrun",
    "load_trace": "files",
    "trace_for_plan": "tracer",
    "trace_model": "tracer",
    "trace_or_load": "files",
}

__all__ = ["Affine", "ModelTrace", "ModuleTrace", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
