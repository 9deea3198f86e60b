"""The decisions the solver loops over outside its program (:class:`GlobalChoice`): micro-batch, prefetch,
layout, CPU offload and accumulation. Each CP-SAT program (solve/linear.py) is built at one of them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from shard_planner.plan import Mesh, Plan, Prefetch, Training
from shard_planner.solve.accumulation import NO_ACCUMULATION, Accumulation


@dataclass(frozen=True)
class GlobalChoice:
    """The decisions the solver loops over outside the program."""

    micro_batch: int
    prefetch: Prefetch
    mesh: Mesh
    cpu_offload: bool = False
    accumulation: Accumulation = NO_ACCUMULATION  # micro-steps per optimizer step and their policies

    @property
    def label(self) -> str:
        mesh = f"{self.mesh.replicate}x{self.mesh.shard} HSDP" if self.mesh.replicate > 1 else f"FSDP {self.mesh.shard}"
        off = ", CPU offload" if self.cpu_offload else ""
        acc = f", {self.accumulation.label}" if self.accumulation.steps > 1 else ""
        return (f"micro-batch {self.micro_batch}{acc}, prefetch fwd {self.prefetch.forward}/bwd "
                f"{self.prefetch.backward}, {mesh}{off}")

    @classmethod
    def of_plan(cls, plan: Plan) -> "GlobalChoice":
        """The choice ``plan`` was made at (its micro-batch, prefetch, mesh, offload and accumulation)."""
        t = plan.training
        return cls(t.micro_batch, plan.prefetch, plan.mesh, t.cpu_offload,
                   Accumulation(t.accumulation_steps, t.gradient_sync, t.keep_params_gathered))

    def training(self, base: Training) -> Training:
        """The plan's training section for this choice: ``base`` (optimizer, dtypes) with its decisions."""
        return replace(base, micro_batch=self.micro_batch, cpu_offload=self.cpu_offload,
                       **self.accumulation.training_fields())
