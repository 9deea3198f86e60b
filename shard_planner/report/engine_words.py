"""What the report calls the things of the plan's engine (plan/engine.py): one :class:`EngineWords` per engine.

    words = engine_words(plan)  # words.unit: "unit" (FSDP2) or "region" (one device)

- ``fsdp2``: every unit's parameters are sharded over the shard group, all-gathered before its forward and
  backward, its gradients reduce-scattered: the report names units, their reshard and the prefetch, sharded
  and unsharded parameters, the collectives and the communication they expose.
- ``single``: one device, plain PyTorch (cost/engines/single.py [Note: The single-device step]): every floating
  parameter held once in the stored dtype, no collective, no gathered copy; a unit is only a region
  activation-checkpointed or not. The report names regions and their parameters and leaves out reshard,
  prefetch, unsharded copies and every communication figure (``shards`` False).

Every section asks :func:`engine_words` for its words, so that the plan's engine is looked up here alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from shard_planner.plan import Plan
from shard_planner.plan.engine import DESCRIPTIONS, FSDP2, PARAMETERS, SINGLE


@dataclass(frozen=True)
class EngineWords:
    """The report's words for one engine (module docstring)."""

    description: str  # what the engine is (plan/engine.py DESCRIPTIONS)
    shards: bool  # shards the parameters and runs collectives; False: one device, none of that to show
    unit: str  # a unit, in a table column or a count: "unit", "region"
    unit_long: str  # a unit, in a caption or a title: "FSDP unit", "region"
    decisions: str  # what a unit decides, for the folded rows: "reshard, checkpointing"
    schedule: str  # the events of the memory timeline, for its caption
    frozen: str  # what becomes of frozen parameters, for the units caption
    params: str  # the memory category sharded_params (report/plots.py CATEGORY_LABELS), as this engine holds it
    # (UnitRow field, units table column, units figure label) of the parameter bytes, in the table's order
    param_columns: tuple[tuple[str, str, str], ...]
    use: str  # how to use the plan: the report's last section
    root: str = ""  # what the root row of the units table is, when the engine's words do not say it


FSDP2_WORDS = EngineWords(
    description=DESCRIPTIONS[FSDP2], shards=True, unit="unit", unit_long="FSDP unit",
    decisions="reshard, checkpointing",
    schedule="the FSDP2 schedule (all-gathers, unit forward and backward, reduce-scatters, optimizer step)",
    frozen="all-gathered like the others, with no gradient, reduce-scatter or optimizer state",
    params=PARAMETERS[FSDP2],
    param_columns=(("sharded_param_bytes", "sharded params/rank (MiB)", "sharded params per rank"),
                   ("unsharded_param_bytes", "unsharded params (MiB)", "unsharded params (while gathered)")),
    use="Check it for real: shard-planner run plan.json (CPU/gloo or GPUs; measured vs predicted). Apply it in your "
        "own training script: shard_planner.execute.apply_plan(model, plan, mesh), or without shard-planner: "
        "shard-planner export plan.json --to fsdp2 -o apply_sharding.py. For a training stack: --to accelerate, "
        "torchtitan or deepspeed (each export lists what that stack cannot express, with the nearest setting).")

SINGLE_WORDS = EngineWords(
    description=DESCRIPTIONS[SINGLE], shards=False, unit="region", unit_long="region", decisions="checkpointing",
    schedule="the single-device step (each region's forward and backward, a checkpointed one's recomputation, the "
             "loss, the optimizer step)",
    frozen="held like the others, with no gradient or optimizer state",
    params=PARAMETERS[SINGLE],
    param_columns=(("sharded_param_bytes", "params (MiB)", "parameters (as the device holds them)"),),
    root="The first row, the root, holds the modules outside every region.",
    use="Check it for real: shard-planner run plan.json (CPU or one GPU; measured vs predicted). Apply it in your "
        "own training script: shard_planner.execute.apply_plan(model, plan) casts the model and checkpoints its "
        "regions, or without shard-planner: shard-planner export plan.json --to fsdp2 -o prepare_model.py writes "
        "the same in plain PyTorch. For a training stack: --to accelerate (a one-process config); torchtitan and "
        "deepspeed cannot run a single-device plan.")

_WORDS = {FSDP2: FSDP2_WORDS, SINGLE: SINGLE_WORDS}


def engine_words(plan: Plan) -> EngineWords:
    """The report's words for ``plan``'s engine."""
    return _WORDS[plan.engine]
