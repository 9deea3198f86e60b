"""Per-unit figures for the report: what each FSDP unit holds and what it costs.

A parameter belongs to the innermost unit that contains its module; the root unit owns everything
else (plan/__init__.py's rule, the one FSDP2 applies). Per unit and per rank:

- parameters, and of them the trainable ones (a fine-tune's frozen base has no gradient, reduce-scatter or
  optimizer state: cost/unit_params.py [Note: Frozen parameters in a unit]);
- sharded parameter bytes: the unit's parameters as built, divided over the shard group (FSDP2 shards
  every parameter on dim 0; padding to a multiple of the group size is ignored, < 1 row per tensor);
- unsharded parameter bytes: the same parameters in the plan's compute dtype, the dtype FSDP2
  all-gathers in under ``MixedPrecisionPolicy(param_dtype=...)`` (plan/numerics.py);
- on an engine that does not shard (one device: report/engine_words.py), both from the plan's engine instead
  (cost/api.py ``plan_unit_bytes``): what the device holds, each floating parameter in the stored dtype, and no
  unsharded copy (cost/engines/single.py);
- activations kept for backward at the plan's micro-batch: the traced saved tensors of the unit's own
  modules, or, for a checkpointed unit, only the inputs of its modules (what checkpointing keeps);
- compute, FSDP collectives and exposed communication time, the last in its parts (waiting, FSDP2's copies,
  slowdown, tensor-parallel collectives): the cost model's ``UnitTime``.

Consecutive units of the same block (same structural hashes: the 80 blocks of a 70B model) are folded
into one row per decision (reshard, checkpointing) with their count, figures per unit (times and kept
activations averaged), so plots and tables stay readable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from shard_planner.dtypes import dtype_bytes
from shard_planner.cost import cost_tables, plan_unit_bytes
from shard_planner.cost.selective import flops_price, subtree_selective
from shard_planner.cost.types import Estimate, ExposedParts, UnitTime
from shard_planner.plan import Plan, Unit
from shard_planner.plan import ownership
from shard_planner.report.engine_words import engine_words
from shard_planner.trace.types import ModelTrace


@dataclass(frozen=True)
class UnitRow:
    """One unit, or ``count`` identical consecutive units (figures are then per unit)."""

    label: str  # "blocks.0" or "blocks.0 .. blocks.31" for a fold
    count: int  # units this row stands for
    modules: tuple[str, ...]  # the first unit's modules
    reshard_after_forward: bool | int
    activation_checkpoint: bool | str  # "selective" too
    interleaved: bool = False  # the row's units alternate with other rows' units (e.g. every other block)
    param_count: int | None = None  # per unit; None without a trace
    trainable_param_count: int | None = None  # of those, the ones that train (requires_grad as built)
    sharded_param_bytes: int | None = None  # per unit, per rank
    unsharded_param_bytes: int | None = None  # per unit, while gathered
    activation_bytes: int | None = None  # per unit, kept for backward at the plan's micro-batch
    compute_s: float | None = None  # per unit: forward + backward (recomputation included)
    comm_s: float | None = None  # per unit: all-gathers + reduce-scatter
    exposed_comm_s: float | None = None  # per unit: what communication adds to the step, all parts
    exposed_parts: ExposedParts | None = None  # per unit: its parts (cost/types.py [Note: The parts of exposed
    # communication]), adding up to exposed_comm_s

    @property
    def reshard_text(self) -> str:
        r = self.reshard_after_forward
        return f"to {r} ranks" if not isinstance(r, bool) else ("yes" if r else "no")


def unit_owners(plan: Plan, fqns: Iterable[str]) -> dict[str, int]:
    """fqn -> index in ``plan.units`` of the unit that owns the module's own parameters (a plan always
    has a root unit, so every module has one; see shard_planner.plan.ownership)."""
    return ownership.owners({fqn: i for i, u in enumerate(plan.units) for fqn in u.modules}, fqns)


def _unit_sizes(plan: Plan, trace: ModelTrace) -> list[dict]:
    owners = unit_owners(plan, (m.fqn for m in trace.modules))
    b = plan.training.micro_batch
    sizes = [dict(params=0, trainable=0, built_bytes=0, saved_bytes=0.0) for _ in plan.units]
    for m in trace.modules:
        s = sizes[owners[m.fqn]]
        s["params"] += m.param_count
        s["trainable"] += m.trainable_param_count
        s["built_bytes"] += m.param_bytes
        s["saved_bytes"] += m.saved_bytes_self.at(b)
    checkpointed = {f for u in plan.units if u.activation_checkpoint for f in u.modules}
    for i, u in enumerate(plan.units):
        if any(_inside(f, checkpointed) for f in u.modules):  # nested in a checkpointed unit: recomputed too
            sizes[i]["saved_bytes"] = 0
        elif u.activation_checkpoint:  # a checkpointed unit keeps only its inputs until its backward
            sizes[i]["saved_bytes"] = sum(trace.module(f).input_bytes.at(b) for f in u.modules)
            if u.activation_checkpoint == "selective":  # and the stored op outputs (cost/selective.py)
                sizes[i]["saved_bytes"] += sum(subtree_selective(trace, f, u.ac_save_ops, b, flops_price(b))[0]
                                               for f in u.modules)
    return sizes


def _engine_param_bytes(plan: Plan, trace: ModelTrace) -> list[tuple[int, int]]:
    """Per unit of ``plan``, (held, unsharded) bytes of its parameters by the plan's engine's rules (cost/api.py
    ``plan_unit_bytes``: ``UnitBytes.sharded``, what one rank holds, and ``unsharded``, its gathered copy)."""
    return [(round(b.sharded), round(b.unsharded)) for b in plan_unit_bytes(cost_tables(trace, plan.units), plan)]


def _inside(fqn: str, ancestors: set[str]) -> bool:
    """``fqn`` is a proper descendant of one of ``ancestors`` (the root, "", contains everything)."""
    parts = fqn.split(".") if fqn else []
    return fqn != "" and ("" in ancestors or any(".".join(parts[:k]) in ancestors for k in range(1, len(parts))))


def _shape_key(unit: Unit, hashes: dict[str, str] | None):
    """What makes two units the same block: their modules' structural hashes, or without a trace the
    shape of their names (``blocks.3`` and ``blocks.4`` are both ``blocks.<n>``)."""
    if hashes:
        return tuple(hashes.get(f, f) for f in unit.modules)
    return tuple(re.sub(r"(^|\.)\d+(?=\.|$)", r"\1<n>", f) for f in unit.modules)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def unit_rows(plan: Plan, trace: ModelTrace | None = None, estimate: Estimate | None = None,
              *, fold: bool = True) -> tuple[UnitRow, ...]:
    """Rows in forward order (the root first), folding identical consecutive units when ``fold``."""
    sizes = _unit_sizes(plan, trace) if trace is not None else None
    hashes = {m.fqn: m.structural_hash for m in trace.modules} if trace is not None else None
    times: dict[str, UnitTime] = {t.name: t for t in estimate.time.units} if estimate is not None else {}
    param_bytes = dtype_bytes(plan.training.numerics.compute_dtype)  # floating parameters' gathered dtype
    # an engine that does not shard: its figures (cost/engines/); FSDP2's are this module's, padding ignored
    held = _engine_param_bytes(plan, trace) if trace is not None and not engine_words(plan).shards else None

    # Runs of consecutive units of the same block shape (never the root, which owns the leftovers).
    runs: list[list[int]] = []
    for i, u in enumerate(plan.units):
        prev = plan.units[runs[-1][-1]] if runs else None
        if (fold and prev is not None and not u.is_root and not prev.is_root
                and _shape_key(u, hashes) == _shape_key(prev, hashes)):
            runs[-1].append(i)
        else:
            runs.append([i])
    # Within a run, one row per decision (reshard, checkpoint): a run with one decision is one row; an
    # interleaved run (every other block checkpointed) of 4+ units gets a row per decision; else a row per unit.
    groups: list[tuple[list[int], bool, int]] = []  # (unit indices, interleaved, length of the run)
    for run in runs:
        decisions: dict[tuple, list[int]] = {}
        for i in run:
            decisions.setdefault((plan.units[i].reshard_after_forward, plan.units[i].activation_checkpoint), []).append(i)
        if len(decisions) == 1:
            groups.append((run, False, len(run)))
        elif len(run) >= 4:
            groups += [(members, True, len(run)) for members in decisions.values()]
        else:
            groups += [([i], False, 1) for i in run]

    rows = []
    for members, interleaved, run_length in groups:
        first, last = plan.units[members[0]], plan.units[members[-1]]
        label = first.name if len(members) == 1 else f"{first.name} .. {last.name}"
        if interleaved:
            label = f"{label} ({len(members)} of {run_length})"
        row = dict(label=label, count=len(members), interleaved=interleaved, modules=first.modules,
                   reshard_after_forward=first.reshard_after_forward,
                   activation_checkpoint=first.activation_checkpoint)
        if sizes is not None:
            s = sizes[members[0]]
            row.update(param_count=s["params"], trainable_param_count=s["trainable"],
                       activation_bytes=int(_mean([sizes[i]["saved_bytes"] for i in members])))
            if held is None:  # FSDP2's (module docstring)
                row.update(sharded_param_bytes=-(-s["built_bytes"] // plan.mesh.shard_group_size),
                           unsharded_param_bytes=s["params"] * param_bytes)
            else:
                row.update(sharded_param_bytes=held[members[0]][0], unsharded_param_bytes=held[members[0]][1])
        unit_times = [times[plan.units[i].name] for i in members if plan.units[i].name in times]
        if len(unit_times) == len(members):
            parts = [t.parts for t in unit_times]
            row.update(compute_s=_mean([t.fwd_compute_s + t.bwd_compute_s for t in unit_times]),
                       comm_s=_mean([t.all_gather_s + t.reduce_scatter_s for t in unit_times]),
                       exposed_comm_s=_mean([t.exposed_comm_s for t in unit_times]),
                       exposed_parts=ExposedParts(*(_mean([getattr(p, f) for p in parts]) for f, _ in ExposedParts.NAMES)))
        rows.append(UnitRow(**row))
    return tuple(rows)


def exposed_columns(rows: Sequence[UnitRow]) -> list[tuple[str, str]]:
    """The parts of exposed communication (cost/types.py ``ExposedParts.NAMES``) some row has: the units table's
    columns and the units figure's bars, so that they add up to the exposed figure beside them."""
    return [(field, name) for field, name in ExposedParts.NAMES
            if any(r.exposed_parts is not None and getattr(r.exposed_parts, field) > 0 for r in rows)]
