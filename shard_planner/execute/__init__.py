"""The executor: apply a plan with real FSDP2 and measure it (the only stage that imports
torch.distributed).

- :func:`apply_plan` (``apply.py``): shard a model exactly as a plan says, from any training script;
  :func:`describe_sharding` reads back what FSDP2 was told; :func:`build_mesh` makes the plan's mesh.
- :func:`run_plan` (``runner.py``): launch local ranks, train on synthetic batches, return a
  :class:`~shard_planner.plan.measurement.Measurement`; the ranks run ``worker.py``, also under torchrun.
- :class:`StorageTracker` (``memtrack.py``): exact live/peak tensor-storage bytes on CPU.

Names are imported on first use, so that ``import shard_planner.execute.memtrack`` stays light.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "apply_plan": "apply", "build_mesh": "apply", "describe_sharding": "apply", "check_plan_matches": "apply",
    "UnitSharding": "apply", "run_plan": "runner", "run_plan_file": "runner", "launch_plans": "runner", "run_plans": "runner",
    "StorageTracker": "memtrack",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"shard_planner.execute.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'shard_planner.execute' has no attribute {name!r}")
