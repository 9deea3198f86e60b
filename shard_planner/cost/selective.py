"""Selective activation checkpointing: what a unit keeps between its forward and backward, and what
its backward recomputes, from the trace's forward kernel records (trace/kernel_ops.py).

[Note: Selective checkpointing memory] torch 2.13's selective checkpointing (torch/utils/checkpoint.py:
non-reentrant ``checkpoint(..., context_fn=create_selective_checkpoint_contexts(policy))``) runs the
region's forward under ``_CachingTorchDispatchMode``: every op's output whose policy is MUST_SAVE is
stored (a detached alias: the storage stays alive) whether or not a later op saves it for backward;
the saved tensors of the region are packed into holders (freed), and the region's inputs are kept by
the recompute closure (as full checkpointing). In backward ``_CachedTorchDispatchMode`` re-runs the
forward: a stored op returns its stored output (the entry is dropped, ``_CONSUMED``), every other op
runs again. So per checkpointed block, with S the unit's ``ac_save_ops``:

- held from forward to backward: its inputs nobody else holds (``kept``, as full checkpointing) plus
  the **stash**: the storages newly allocated by forward ops of a class in S, summed over the block's
  subtree (``KernelRecord.new_bytes``; a storage is counted at the op that allocates it);
- recomputation: the level before the block's backward less the stash, plus the traced forward rise
  (the stash is consumed as the recomputation reaches each stored op; exact when the forward's peak
  is at its end, as in a transformer block where saved tensors accumulate; an upper bound of the
  remaining stash is not added);
- a stored output that is also the block's output (a residual ``add`` when elementwise ops are kept, a
  block ending in a Linear) is held once: the next block already counts it (as its input or saved
  tensor), so it leaves the stash (``ModuleTrace.output_bytes_by_class``). Measured on
  tests/models/exec_net.py keeping matmul + elementwise outputs: +7.7% before, see
  tests/execute/test_selective_run.py. Not modelled: such an output nobody after the block keeps.

[Note: Selective checkpointing time] The recomputation runs the forward's ops that are not stored:
device time is the block's forward device time (CostModel.block_compute_s: FLOPs, kernel records or
measured) times the share of it the non-stored classes take, priced the same way (kernel records by
the roofline when the profile uses it, else their traced FLOPs); every op still goes through the
dispatcher (a stored op returns its cached output from the Python dispatch mode), so the host time is
the block's forward op count, as for full checkpointing.

[Note: Alternate matmuls] With ``"alternate_matmul"`` (torchtitan's rule, shard_planner/plan/checkpointing.py
[Note: torchtitan's op-level policy]) the block's matmuls are numbered in forward order: the subtree's
modules by first forward entry (``ModelTrace.forward_order``), a module's own matmuls at its position.
A module whose own matmuls are numbered i+1..i+c keeps the odd numbers among them: that share of each of
its matmul records is stored (its new bytes) and skipped by the recomputation (its price). Exact where
each module runs one matmul per call (a Linear per module); a container interleaving its own matmuls with
its children's is counted as if its own came first. The block's output is held once (as above) when the
block's last matmul is kept.

A module whose forward has no kernel records (its op sequences did not pair across the traced batch
sizes, or a trace written before ``new_bytes``) is priced as not checkpointed: its saved tensors are
kept and it is not recomputed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from shard_planner.plan.checkpointing import ALTERNATE_MATMUL, is_selective, keeps_alternate_matmuls
from shard_planner.cost.tables import CostTables
from shard_planner.dtypes import dtype_bytes
from shard_planner.plan import Unit
from shard_planner.plan.numerics import Numerics
from shard_planner.trace.types import ModelTrace, ModuleTrace

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SelectiveBlocks:
    """Per block of the tables, at one micro-batch and param dtype: the stash a selective block keeps
    (bytes, 0 for every other block) and the share of its forward device time the recomputation skips
    (a selective block's stored ops, a fully checkpointed block's early-stop tail; 0 for every other
    block)."""

    stash: tuple[float, ...]
    skipped_share: tuple[float, ...]


def _has_records(m: ModuleTrace) -> bool:
    return bool(m.fwd_kernels) and all(r.new_bytes is not None for r in m.fwd_kernels)


def supports_selective(trace: ModelTrace) -> bool:
    """Whether ``trace`` records the storages its forward ops allocate (traces written before
    ``KernelRecord.new_bytes`` do not: the planner then offers no selective checkpointing)."""
    return any(r.new_bytes is not None for m in trace.modules for r in m.fwd_kernels)


def keeps_something(trace: ModelTrace, fqn: str, save_ops: tuple[str, ...]) -> bool:
    """Whether ``fqn``'s forward runs an op of a class in ``save_ops``: else selective checkpointing
    stores nothing and recomputes everything, which is full checkpointing."""
    kept = set(save_ops) | ({"matmul"} if ALTERNATE_MATMUL in save_ops else set())  # the 1st matmul at least
    return any(r.op_class in kept for m in trace.subtree(fqn) for r in m.fwd_kernels)


def subtree_selective(trace: ModelTrace, fqn: str, save_ops: tuple[str, ...], micro_batch: int,
                      price: Callable[[ModuleTrace, tuple], float]) -> tuple[float, float, float]:
    """For ``fqn``'s subtree with ``save_ops`` stored: (stash bytes in the compute dtype, priced forward
    of the stored ops, priced forward of all ops); ``price(module, records)`` prices records of the
    module (``records is None``: its whole forward). See [Note: Selective checkpointing memory] and
    [Note: Alternate matmuls]."""
    alternate = keeps_alternate_matmuls(save_ops)
    modules = trace.subtree(fqn)
    if alternate:
        position = {f: i for i, f in enumerate(trace.forward_order)}
        modules = sorted(modules, key=lambda m: position.get(m.fqn, len(position)))
    stash = skipped = total = 0.0
    matmuls = 0  # alternate: the block's matmuls numbered so far
    for m in modules:
        if not m.fwd_ops_self:
            continue
        whole = price(m, None)
        total += whole
        if not _has_records(m):  # priced as not checkpointed (module docstring)
            stash += m.saved_bytes_self.at(micro_batch)
            skipped += whole
            continue
        kept = tuple(r for r in m.fwd_kernels if r.op_class in save_ops)
        stash += sum(r.new_bytes.at(micro_batch) for r in kept)
        skipped += price(m, kept) if kept else 0.0
        mm = tuple(r for r in m.fwd_kernels if r.op_class == "matmul") if alternate else ()
        if mm:
            c = sum(r.count for r in mm)
            share = ((matmuls + c + 1) // 2 - (matmuls + 1) // 2) / c  # odd numbers in matmuls+1 .. matmuls+c
            matmuls += c
            stash += share * sum(r.new_bytes.at(micro_batch) for r in mm)
            skipped += share * price(m, mm)
    # a stored output that is the block's own output is held once: the next block counts it
    outputs = trace.module(fqn).output_bytes_by_class
    stash -= sum(outputs[c].at(micro_batch) for c in save_ops if c in outputs)
    if alternate and matmuls % 2 and "matmul" in outputs:  # the last matmul (odd) is kept
        stash -= outputs["matmul"].at(micro_batch)
    return max(0.0, stash), skipped, total


def early_stop_share(trace: ModelTrace, fqn: str, micro_batch: int,
                     price: Callable[[ModuleTrace, tuple | None], float]) -> float:
    """The share of ``fqn``'s priced forward that a full checkpointing recomputation does not run: its
    subtree's kernels after the last tensor the subtree saves (trace/capture.py [Note: Early stop of the
    recomputation]); 0 for a trace without them."""
    m = trace.module(fqn)
    if not m.fwd_tail_kernels:
        return 0.0
    total = sum(price(x, None) for x in trace.subtree(fqn) if x.fwd_ops_self)
    return min(1.0, price(m, m.fwd_tail_kernels) / total) if total > 0 else 0.0


def selective_blocks(trace: ModelTrace, t: CostTables, units: tuple[Unit, ...], numerics: Numerics,
                     subtree: Callable[[str, tuple[str, ...]], tuple[float, float, float]],
                     tail: Callable[[str], float]) -> SelectiveBlocks | None:
    """The :class:`SelectiveBlocks` of ``units`` segmented as ``t``; None when no unit is checkpointed.
    ``subtree(fqn, save_ops)``: :func:`subtree_selective` of that subtree at the plan's micro-batch;
    ``tail(fqn)``: :func:`early_stop_share` of a fully checkpointed one (its stash is 0). A selective
    unit's early stop is not priced: its recomputation skips the stored ops already."""
    if not any(u.activation_checkpoint for u in units):
        return None
    scale = dtype_bytes(numerics.activation_dtype) / dtype_bytes(trace.compute_dtype)  # memory.py [Note: Activations]
    stash, share = [], []
    for blk in t.blocks:
        u = units[blk.unit]
        checkpointed = blk.unit_module and u.activation_checkpoint
        if not (checkpointed and is_selective(u.activation_checkpoint)):  # none, or full: its early stop
            stash.append(0.0)
            share.append(tail(blk.fqn) if checkpointed else 0.0)
            continue
        s, skipped, total = subtree(blk.fqn, u.ac_save_ops)
        stash.append(s * scale)
        share.append(min(1.0, skipped / total) if total > 0 else 0.0)
    return SelectiveBlocks(stash=tuple(stash), skipped_share=tuple(share))


def flops_price(micro_batch: int) -> Callable[[ModuleTrace, tuple | None], float]:
    """Prices records by their traced FLOPs (the module's own forward FLOPs for ``None``)."""
    def price(m: ModuleTrace, records) -> float:
        if records is None:
            return m.fwd_flops_self.at(micro_batch)
        return sum(r.flops.at(micro_batch) for r in records)
    return price
