"""The decisions the solver loops over outside its program (:class:`GlobalChoice`): micro-batch, prefetch,
layout, CPU offload and accumulation. Each CP-SAT program (solve/linear.py) is built at one of them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from shard_planner.plan import Mesh, Plan, Prefetch, Training
from shard_planner.plan.engine import FSDP2, SINGLE
from shard_planner.solve.accumulation import NO_ACCUMULATION, Accumulation


# The (forward, backward) prefetch depths the search tries: FSDP2's default, one explicit unit ahead, two both ways;
# the single-device step has none to choose
PREFETCH_CHOICES = (Prefetch(0, 1), Prefetch(1, 1), Prefetch(2, 2))


def prefetch_choices(engine: str) -> tuple[Prefetch, ...]:
    """The prefetch depths worth trying for plans run by ``engine``: FSDP2's all, the single-device step's
    default only (nothing is gathered: the depths change nothing, plan/engine.py)."""
    return PREFETCH_CHOICES if engine != SINGLE else PREFETCH_CHOICES[:1]


@dataclass(frozen=True)
class GlobalChoice:
    """The decisions the solver loops over outside the program."""

    micro_batch: int
    prefetch: Prefetch
    mesh: Mesh
    cpu_offload: bool = False
    accumulation: Accumulation = NO_ACCUMULATION  # micro-steps per optimizer step and their policies
    engine: str = FSDP2  # what runs the plans (plan/engine.py): the same for every choice of one request

    @property
    def label(self) -> str:
        mesh = f"{self.mesh.replicate}x{self.mesh.shard} HSDP" if self.mesh.replicate > 1 else f"FSDP {self.mesh.shard}"
        off = ", CPU offload" if self.cpu_offload else ""
        acc = f", {self.accumulation.label}" if self.accumulation.steps > 1 else ""
        if self.engine == SINGLE:  # nothing gathered or synced: no prefetch or sync to say (plan/engine.py)
            steps = f", {self.accumulation.steps} micro-steps" if self.accumulation.steps > 1 else ""
            return f"micro-batch {self.micro_batch}{steps}, one device"
        return (f"micro-batch {self.micro_batch}{acc}, prefetch fwd {self.prefetch.forward}/bwd "
                f"{self.prefetch.backward}, {mesh}{off}")

    @classmethod
    def of_plan(cls, plan: Plan) -> "GlobalChoice":
        """The choice ``plan`` was made at (its micro-batch, prefetch, mesh, offload and accumulation)."""
        t = plan.training
        return cls(t.micro_batch, plan.prefetch, plan.mesh, t.cpu_offload,
                   Accumulation(t.accumulation_steps, t.gradient_sync, t.keep_params_gathered), plan.engine)

    def training(self, base: Training) -> Training:
        """The plan's training section for this choice: ``base`` (optimizer, dtypes) with its decisions."""
        return replace(base, micro_batch=self.micro_batch, cpu_offload=self.cpu_offload,
                       **self.accumulation.training_fields())
