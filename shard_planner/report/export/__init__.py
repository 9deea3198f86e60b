"""Exports: the plan in the form a training stack consumes.

    export_plan(plan, "fsdp2" | "accelerate" | "torchtitan" | "deepspeed", info=None) -> Export

fsdp2 is exact; the config-driven stacks cannot say everything a plan decides (grouped units, per-unit
policies, prefetch depth): each such export lists what it could not express and the nearest setting it
used, in the file (comments, or ``_comment`` for JSON) and in ``Export.notes``. Accelerate and DeepSpeed
need the model's classes and parameter counts: from ``info`` (``model_info_from_trace``), or by building
the plan's model on the meta device. A tensor-parallel plan's split is stated by each export (the fsdp2
snippet applies its styles: fsdp2_tp.py; DeepSpeed's AutoTP section: deepspeed_tp.py) or noted where the
stack cannot say it.
"""

from __future__ import annotations

from shard_planner.errors import UserError
from shard_planner.plan import Plan
from shard_planner.plan.engine import SINGLE
from shard_planner.report.export.accelerate import export_accelerate
from shard_planner.report.export.common import Export
from shard_planner.report.export.deepspeed import export_deepspeed
from shard_planner.report.export.fsdp2 import export_fsdp2
from shard_planner.report.export.model_info import (
    ModelInfo, model_info_for_plan, model_info_from_model, model_info_from_trace,
)
from shard_planner.report.export.single import export_single_device
from shard_planner.report.export.torchtitan import export_torchtitan

TARGETS = ("fsdp2", "accelerate", "torchtitan", "deepspeed")

__all__ = ["TARGETS", "Export", "ModelInfo", "export_plan", "model_info_for_plan", "model_info_from_model",
           "model_info_from_trace"]


def export_plan(plan: Plan, target: str, info: ModelInfo | None = None) -> Export:
    """``plan`` as ``target`` expects it."""
    if plan.engine == SINGLE and target in TARGETS:  # one device, no sharding: report/export/single.py
        return export_single_device(plan, target)
    match target:
        case "fsdp2":
            return Export("fsdp2", export_fsdp2(plan), ".py")
        case "torchtitan":
            return export_torchtitan(plan)
        case "accelerate":
            return export_accelerate(plan, info if info is not None else model_info_for_plan(plan))
        case "deepspeed":
            return export_deepspeed(plan, info if info is not None else model_info_for_plan(plan))
    raise UserError(f"cannot export to {target!r}: choose one of {', '.join(TARGETS)}")
