"""Tracing: run one forward + backward without real memory and record what the planner needs."""

from shard_planner.trace.files import load_trace, trace_or_load
from shard_planner.trace.realrun import Difference, compare_with_real_run
from shard_planner.trace.tracer import trace_model
from shard_planner.trace.types import Affine, ModelTrace, ModuleTrace

__all__ = [
    "Affine",
    "Difference",
    "ModelTrace",
    "ModuleTrace",
    "compare_with_real_run",
    "load_trace",
    "trace_model",
    "trace_or_load",
]
