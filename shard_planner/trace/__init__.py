"""Tracing: run one forward + backward without real memory and record what the planner needs."""

from shard_planner.trace.types import Affine, ModelTrace, ModuleTrace

__all__ = ["Affine", "ModelTrace", "ModuleTrace"]
