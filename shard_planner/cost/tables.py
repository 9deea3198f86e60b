"""Per-trace and per-segmentation tables the memory and time simulators read.

The simulators are called thousands of times by the solver with plans that differ only in their
decisions, so everything that depends on the trace and the choice of units alone is computed once here
(and kept per segmentation by the CostModel, cost/model.py): which unit owns each parameter, and the
*block sequence* of one forward pass.

A **block** is a stretch of forward computation with one owner unit:

- every module of a unit (a grouped unit ``fully_shard([m1, m2])`` gives one block per module, in
  forward order), with any units nested inside it folded in (their parameters are gathered when the
  block starts and resharded when it ends: a slight over-estimate of how long they are live);
- every maximal subtree the root owns that contains no unit (embeddings, a final norm, a head);
- the own operations of a container module that holds units (the root's ``forward`` body, a
  ``Sequential`` of blocks), placed after its children.

Blocks are in forward order (the trace's ``forward_order``); backward runs them in reverse.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shard_planner.cost.unit_params import UnitParams, float_numel_of
from shard_planner.dtypes import FLOAT_DTYPES
from shard_planner.errors import PlanError
from shard_planner.plan import ROOT, Unit, unit_name
from shard_planner.trace.types import ZERO, Affine, ModelTrace

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class Block:
    """One stretch of forward computation owned by one unit (see the module docstring)."""

    fqn: str  # the module: its subtree, or (``self_only``) the container's own operations
    unit: int  # index into the plan's units of the owner
    nested: tuple[int, ...]  # units nested inside this block's module
    unit_module: bool  # the block is a module listed in its unit (activation checkpointing applies)
    own_float_numel: int  # the trainable floating elements of this block the owner unit holds (they get gradients)
    saved: Affine  # bytes saved for backward by the subtree (nested units included)
    input: Affine
    output: Affine
    fwd_rise: Affine
    bwd_rise: Affine
    fwd_flops: Affine
    bwd_flops: Affine
    fwd_ops: int = 0  # aten ops of the block's forward (subtree, nested units included), per step
    bwd_ops: int = 0
    # of ``input``, storages already held elsewhere (ModuleTrace.input_shared_bytes): a checkpointed
    # block keeps ``input - input_shared`` new bytes (memory.py, [Note: Checkpointed inputs held elsewhere])
    input_shared: Affine = ZERO
    self_only: bool = False  # a container's own operations, its children (and their units) left out
    # held by the forward's output until it is dropped after the loss (trace/held.py), subtree included
    held: Affine = ZERO
    # a container's own code (``self_only``): its trace's fwd_tail_rise_bytes, and the index of the first block
    # of its subtree (where the level it rises from was): cost/memory.py [Note: A container's own code]
    tail_rise: Affine = ZERO
    forward_grads: Affine = ZERO  # of ``saved``, parameter gradients made in forward (ModuleTrace.forward_grad_bytes)
    first_block: int = -1
    # tensor-parallel collectives of the block's modules (trace ModuleTrace.tp_collectives), forward order:
    # each (kind, full bytes per micro-batch) on the compute stream's critical path (cost/tp_comm.py)
    tp_fwd: tuple[tuple[str, Affine], ...] = ()
    tp_bwd: tuple[tuple[str, Affine], ...] = ()

    @property
    def name(self) -> str:
        """For people (the memory timeline's labels): the module, ``<fqn>:self`` for its own operations."""
        return f"{self.fqn}:self" if self.self_only else self.fqn


@dataclass(frozen=True)
class CostTables:
    """What the simulators need about a trace under one segmentation into units."""

    # the units' modules: the segmentation these tables are of. Only the modules: the tables are shared
    # by every plan of that segmentation, whatever its units' reshard and checkpoint decisions.
    segmentation: tuple[tuple[str, ...], ...]
    blocks: tuple[Block, ...]
    # per unit, the parameters it owns (cost/unit_params.py): by built dtype, the floating elements of
    # its first module in forward order that holds some (their gradient is the last one autograd
    # produces for the unit: memory.py, [Note: Reduce-scatter buffers]) and its 0-d parameters, which
    # are replicated whole on every rank with their gradients and optimizer states (unit_bytes.py)
    unit_params: tuple[UnitParams, ...]
    unit_first_block: tuple[int, ...]  # -1 for a unit that never runs (kept for its parameters)
    unit_last_block: tuple[int, ...]
    forward_units: tuple[int, ...]  # units in pre-forward order (the root first)
    model_params: UnitParams  # every parameter of the model, as one unit's (the optimizer step reads them)
    unit_names: tuple[str, ...]
    # per unit, whether FSDP2 runs its pre-backward: some output of its modules requires grad (the module
    # is in the trace's backward order); not for a frozen unit with no trainable input (a frozen
    # embedding): docs/frozen_facts.md [Note: Pre-backward all-gather needs an output that requires grad]
    unit_backward: tuple[bool, ...]
    buffer_bytes: int  # every module's buffers: not sharded by FSDP2, resident on every rank
    largest_module_float_bytes: int  # the largest one module's own floating parameters, as built
    model_fwd_flops: Affine  # the whole model (the loss excluded: trace.loss_flops), per micro-batch
    model_bwd_flops: Affine
    param_tensors: int = 0  # trainable parameter tensors of the model (the optimizer's per-tensor overhead)


def build_tables(trace: ModelTrace, units: tuple[Unit, ...],
                 subtree_sum: Callable[[str, str], Affine] | None = None) -> CostTables:
    """The tables of ``trace`` segmented into ``units`` (only their modules matter):
    :func:`segment_tables` of their modules."""
    return segment_tables(trace, tuple(u.modules for u in units), subtree_sum)


def segment_tables(trace: ModelTrace, segmentation: tuple[tuple[str, ...], ...],
                   subtree_sum: Callable[[str, str], Affine] | None = None,
                   params_of: Callable[[Sequence], UnitParams] | None = None) -> CostTables:
    """The tables of ``trace`` segmented into units of the modules ``segmentation`` (one tuple of module
    names per unit). ``subtree_sum(fqn, attr)``: the sum of a module field over a subtree, memoised by
    the caller (CostModel.subtree_sum: the sums do not depend on the units); None: summed here, for
    this call only. ``params_of(modules)``: :func:`unit_params_of`'s, the caller's (a unit owns the same
    modules in most segmentations); None: ``UnitParams.of_modules``."""
    if subtree_sum is None:
        subtree_sum = subtree_summer(trace)
    if params_of is None:
        params_of = UnitParams.of_modules
    module_unit, root_index, owner, contains_unit = _owners(trace, segmentation)

    n_units = len(segmentation)
    # Parameters of modules that never run (calls == 0) still belong to their unit but no block touches
    # them; the root block list keeps them in the unit totals only.
    # each unit's modules in forward order, those that never run last (UnitParams.of_modules takes the first
    # with trainable floating parameters as the one whose gradient autograd produces last)
    order = {fqn: i for i, fqn in enumerate(trace.forward_order)}
    modules_of: list[list] = [[] for _ in range(n_units)]
    for m in sorted(trace.modules, key=lambda m: order.get(m.fqn, len(order))):
        modules_of[owner[m.fqn]].append(m)
    params = tuple(params_of(ms) for ms in modules_of)
    blocks = _block_sequence(trace, module_unit, owner, contains_unit, subtree_sum)
    in_backward = set(trace.backward_order)

    first_block = [-1] * n_units
    last = [-1] * n_units
    for i, b in enumerate(blocks):
        for u in (b.unit, *b.nested):
            if first_block[u] < 0:
                first_block[u] = i
            last[u] = i
    first_block[root_index], last[root_index] = 0, len(blocks) - 1
    forward_units = tuple(sorted((u for u in range(n_units) if first_block[u] >= 0),
                                 key=lambda u: (first_block[u], u != root_index)))

    fwd_total = subtree_sum(ROOT, "fwd_flops_self")
    bwd_total = subtree_sum(ROOT, "bwd_flops_self")
    return CostTables(
        segmentation=segmentation, blocks=tuple(blocks), unit_params=params,
        unit_first_block=tuple(first_block), unit_last_block=tuple(last), forward_units=forward_units,
        model_params=params_of(trace.modules),
        unit_names=tuple(unit_name(modules) for modules in segmentation),
        unit_backward=tuple(i == root_index or any(fqn in in_backward for fqn in modules)
                            for i, modules in enumerate(segmentation)),
        buffer_bytes=sum(m.buffer_bytes for m in trace.modules),
        largest_module_float_bytes=largest_module_float_bytes(trace),
        model_fwd_flops=fwd_total, model_bwd_flops=bwd_total,
        param_tensors=sum(m.trainable_param_tensors for m in trace.modules),
    )


def _owners(trace: ModelTrace, segmentation: tuple[tuple[str, ...], ...]):
    """Which unit lists each module (``module_unit``), the root unit's index, the owner of every module
    (the innermost unit containing it) and whether a module's subtree holds a unit below it."""
    module_unit: dict[str, int] = {}
    root_index = -1
    for i, modules in enumerate(segmentation):
        for fqn in modules:
            if fqn not in trace:
                raise PlanError(f"unit {unit_name(modules)}: module {fqn!r} is not in the model ({trace.model_path})")
            module_unit[fqn] = i
        if modules == (ROOT,):
            root_index = i
    if root_index < 0:
        raise PlanError("a plan needs a unit for the root module")

    # Owner of each module: the innermost unit containing it.
    owner: dict[str, int] = {}
    contains_unit: dict[str, bool] = {}

    def visit_owner(fqn: str, inherited: int) -> bool:
        m = trace.module(fqn)
        own = module_unit.get(fqn, inherited)
        owner[fqn] = own
        below = False
        for c in m.children:
            below = visit_owner(c, own) or below
        contains_unit[fqn] = below
        return below or (fqn in module_unit and fqn != ROOT)

    visit_owner(ROOT, root_index)
    return module_unit, root_index, owner, contains_unit


def _block_sequence(trace: ModelTrace, module_unit: dict[str, int], owner: dict[str, int],
                    contains_unit: dict[str, bool], subtree_sum: Callable[[str, str], Affine]) -> list[Block]:
    """The blocks of one forward pass, in forward order (the module docstring)."""
    fwd_index = {fqn: i for i, fqn in enumerate(trace.forward_order)}

    def called_children(fqn: str) -> list[str]:
        """Children that run, looking through containers that are never called (a ModuleList)."""
        kids: list[str] = []
        for c in trace.module(fqn).children:
            if trace.module(c).calls > 0 and c in fwd_index:
                kids.append(c)
            elif contains_unit[c] or any(trace.module(g.fqn).calls > 0 for g in trace.subtree(c)):
                kids.extend(called_children(c))
        return sorted(kids, key=fwd_index.__getitem__)

    def own_gradient_numel(fqn: str, unit: int) -> int:
        return sum(float_numel_of(m.trainable_sharded_param_bytes_by_dtype)
                   for m in trace.subtree(fqn) if owner[m.fqn] == unit)

    def nested_units(fqn: str) -> tuple[int, ...]:
        found = []
        for m in trace.subtree(fqn)[1:]:
            if m.fqn in module_unit and module_unit[m.fqn] not in found:
                found.append(module_unit[m.fqn])
        return tuple(found)

    blocks: list[Block] = []

    def whole_block(fqn: str, unit: int, unit_module: bool) -> Block:
        m = trace.module(fqn)
        tp_fwd, tp_bwd = tp_collectives_of(trace.subtree(fqn))
        return Block(
            fqn=fqn, unit=unit, nested=nested_units(fqn), unit_module=unit_module,
            own_float_numel=own_gradient_numel(fqn, unit),
            saved=subtree_sum(fqn, "saved_bytes_self"), input=m.input_bytes, output=m.output_bytes,
            fwd_rise=m.fwd_peak_rise_bytes, bwd_rise=m.bwd_peak_rise_bytes,
            fwd_flops=subtree_sum(fqn, "fwd_flops_self"), bwd_flops=subtree_sum(fqn, "bwd_flops_self"),
            fwd_ops=subtree_sum(fqn, "fwd_ops_self"), bwd_ops=subtree_sum(fqn, "bwd_ops_self"),
            input_shared=m.input_shared_bytes, tp_fwd=tp_fwd, tp_bwd=tp_bwd,
            held=subtree_sum(fqn, "held_bytes_self"), forward_grads=subtree_sum(fqn, "forward_grad_bytes"),
        )

    def decompose(fqn: str) -> None:
        if fqn != ROOT and fqn in module_unit:
            blocks.append(whole_block(fqn, module_unit[fqn], True))
            return
        if not contains_unit[fqn]:
            if fqn != ROOT or not blocks:
                blocks.append(whole_block(fqn, owner[fqn], False))
            return
        first = len(blocks)
        for c in called_children(fqn):
            decompose(c)
        m = trace.module(fqn)
        tp_fwd, tp_bwd = tp_collectives_of((m,))
        blocks.append(Block(
            fqn=fqn, self_only=True, tp_fwd=tp_fwd, tp_bwd=tp_bwd, unit=owner[fqn], nested=(), unit_module=False,
            own_float_numel=float_numel_of(m.trainable_sharded_param_bytes_by_dtype),
            saved=m.saved_bytes_self, input=ZERO, output=ZERO, fwd_rise=ZERO, bwd_rise=m.bwd_head_rise_bytes,
            fwd_flops=m.fwd_flops_self, bwd_flops=m.bwd_flops_self,
            fwd_ops=m.fwd_ops_self, bwd_ops=m.bwd_ops_self, held=m.held_bytes_self,
            tail_rise=m.fwd_tail_rise_bytes, first_block=first, forward_grads=m.forward_grad_bytes,
        ))

    decompose(ROOT)
    return blocks


def tp_collectives_of(modules) -> tuple[tuple[tuple[str, Affine], ...], tuple[tuple[str, Affine], ...]]:
    """The forward and backward tensor-parallel collectives ``modules`` issue: (kind, full bytes) each."""
    fwd = tuple((c.kind, c.full_bytes) for m in modules for c in m.tp_collectives if c.phase == "fwd")
    bwd = tuple((c.kind, c.full_bytes) for m in modules for c in m.tp_collectives if c.phase == "bwd")
    return fwd, bwd


def largest_module_float_bytes(trace: ModelTrace) -> int:
    """The largest one module's own trainable floating parameters, as built (what the single-tensor
    optimizer step's temporaries scale with: cost/optimizer.py ``optimizer_temporaries_bytes``)."""
    return max((sum(nb for dt, nb in m.trainable_param_bytes_by_dtype.items() if dt in FLOAT_DTYPES)
                for m in trace.modules), default=0)


def subtree_summer(trace: ModelTrace) -> Callable[[str, str], Affine]:
    """A memoised ``subtree_sum(fqn, attr)``: the module's own value plus its children's sums (in that
    order: the sums are bit for bit those every caller has always seen). The CostModel holds one per trace."""
    sums: dict[tuple[str, str], Affine] = {}

    def subtree_sum(fqn: str, attr: str) -> Affine:
        key = (fqn, attr)
        if key not in sums:
            m = trace.module(fqn)
            total = getattr(m, attr)
            for c in m.children:
                total = total + subtree_sum(c, attr)
            sums[key] = total
        return sums[key]

    return subtree_sum


def unit_params_of(trace: ModelTrace) -> Callable[[Sequence], UnitParams]:
    """A memoised ``UnitParams.of_modules(modules)`` for ``trace``'s modules, keyed by their names in the
    order given (the order is read: the first with trainable floating parameters). The CostModel holds
    one per trace, as it holds :func:`subtree_summer`'s."""
    memo: dict[tuple[str, ...], UnitParams] = {}

    def params_of(modules: Sequence) -> UnitParams:
        key = tuple(m.fqn for m in modules)
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = UnitParams.of_modules(modules)
        return hit

    return params_of
