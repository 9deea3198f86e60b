"""Per-unit figures for the report: what each FSDP unit holds and what it costs.

A parameter belongs to the innermost unit that contains its module; the root unit owns everything
else (plan.py's rule, the one FSDP2 applies). Per unit and per rank:

- sharded parameter bytes: the unit's parameters as built, divided over the shard group (FSDP2 shards
  every parameter on dim 0; padding to a multiple of the group size is ignored, < 1 row per tensor);
- unsharded parameter bytes: the same parameters in ``training.param_dtype``, the dtype FSDP2
  all-gathers in under ``MixedPrecisionPolicy(param_dtype=...)``;
- activations kept for backward at the plan's micro-batch: the traced saved tensors of the unit's own
  modules, or, for a checkpointed unit, only the inputs of its modules (what checkpointing keeps);
- compute, communication and exposed communication time: the cost model's ``UnitTime``.

Identical consecutive units (same structural hashes, same reshard and checkpoint decision: the 80
blocks of a 70B model) are folded into one row with their count, so plots and tables stay readable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from shard_planner.cost.types import Estimate, UnitTime
from shard_planner.plan import Plan, Unit
from shard_planner.trace.types import ModelTrace

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class UnitRow:
    """One unit, or ``count`` identical consecutive units (figures are then per unit)."""

    label: str  # "blocks.0" or "blocks.0 .. blocks.31" for a fold
    count: int  # units this row stands for
    modules: tuple[str, ...]  # the first unit's modules
    reshard_after_forward: bool | int
    activation_checkpoint: bool
    param_count: int | None = None  # per unit; None without a trace
    sharded_param_bytes: int | None = None  # per unit, per rank
    unsharded_param_bytes: int | None = None  # per unit, while gathered
    activation_bytes: int | None = None  # per unit, kept for backward at the plan's micro-batch
    compute_s: float | None = None  # per unit: forward + backward (recomputation included)
    comm_s: float | None = None  # per unit: all-gathers + reduce-scatter
    exposed_comm_s: float | None = None  # per unit: communication the compute stream waited for

    @property
    def reshard_text(self) -> str:
        r = self.reshard_after_forward
        return f"to {r} ranks" if not isinstance(r, bool) else ("yes" if r else "no")


def unit_owners(plan: Plan, modules: Iterable[tuple[str, str | None]]) -> dict[str, int]:
    """fqn -> index in ``plan.units`` of the unit that owns the module's own parameters.

    ``modules``: (fqn, parent fqn) pairs in named_modules() order (a parent before its children)."""
    unit_of = {fqn: i for i, u in enumerate(plan.units) for fqn in u.modules}
    owners: dict[str, int] = {}
    for fqn, parent in modules:
        if fqn in unit_of:
            owners[fqn] = unit_of[fqn]
        else:
            owners[fqn] = owners[parent] if parent is not None else unit_of[""]
    return owners


def _unit_sizes(plan: Plan, trace: ModelTrace) -> list[dict]:
    owners = unit_owners(plan, ((m.fqn, m.parent) for m in trace.modules))
    b = plan.training.micro_batch
    sizes = [dict(params=0, built_bytes=0, saved_bytes=0.0) for _ in plan.units]
    for m in trace.modules:
        s = sizes[owners[m.fqn]]
        s["params"] += m.param_count
        s["built_bytes"] += m.param_bytes
        s["saved_bytes"] += m.saved_bytes_self.at(b)
    for i, u in enumerate(plan.units):
        if u.activation_checkpoint:  # a checkpointed unit keeps only its inputs until its backward
            sizes[i]["saved_bytes"] = sum(trace.module(f).input_bytes.at(b) for f in u.modules)
    return sizes


def _fold_key(unit: Unit, hashes: dict[str, str] | None):
    modules = tuple(hashes.get(f, f) for f in unit.modules) if hashes else unit.modules
    return (modules, unit.reshard_after_forward, unit.activation_checkpoint)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def unit_rows(plan: Plan, trace: ModelTrace | None = None, estimate: Estimate | None = None,
              *, fold: bool = True) -> tuple[UnitRow, ...]:
    """Rows in forward order (the root first), folding identical consecutive units when ``fold``."""
    sizes = _unit_sizes(plan, trace) if trace is not None else None
    hashes = {m.fqn: m.structural_hash for m in trace.modules} if trace is not None else None
    times: dict[str, UnitTime] = {t.name: t for t in estimate.time.units} if estimate is not None else {}
    param_bytes = DTYPE_BYTES[plan.training.param_dtype]

    # Runs of identical consecutive units (never the root, which owns the leftovers).
    runs: list[list[int]] = []
    for i, u in enumerate(plan.units):
        if (fold and runs and not u.is_root and not plan.units[runs[-1][-1]].is_root
                and _fold_key(u, hashes) == _fold_key(plan.units[runs[-1][-1]], hashes)
                and (sizes is None or sizes[i] == sizes[runs[-1][-1]])):
            runs[-1].append(i)
        else:
            runs.append([i])

    rows = []
    for run in runs:
        first, last = plan.units[run[0]], plan.units[run[-1]]
        label = first.name if len(run) == 1 else f"{first.name} .. {last.name}"
        row = dict(label=label, count=len(run), modules=first.modules,
                   reshard_after_forward=first.reshard_after_forward,
                   activation_checkpoint=first.activation_checkpoint)
        if sizes is not None:
            s = sizes[run[0]]
            row.update(param_count=s["params"],
                       sharded_param_bytes=-(-s["built_bytes"] // plan.mesh.shard),
                       unsharded_param_bytes=s["params"] * param_bytes,
                       activation_bytes=int(s["saved_bytes"]))
        unit_times = [times[plan.units[i].name] for i in run if plan.units[i].name in times]
        if len(unit_times) == len(run):
            row.update(compute_s=_mean([t.fwd_compute_s + t.bwd_compute_s for t in unit_times]),
                       comm_s=_mean([t.all_gather_s + t.reduce_scatter_s for t in unit_times]),
                       exposed_comm_s=_mean([t.exposed_comm_s for t in unit_times]))
        rows.append(UnitRow(**row))
    return tuple(rows)
