"""The search space: which modules can become FSDP units, and the options each candidate unit has.

Built from the trace's module tree, without running anything:

- **Items** are the modules the planner may wrap, in forward order. Starting from the root, a module
  is *expanded* into its children when it is a container that carries a large share of the
  parameters (``EXPAND_SHARE``), has (almost) no parameters of its own and is not one of several
  identical siblings — the root, a decoder, a ``ModuleList`` of blocks, but not a block; a module
  whose only child with parameters is expanded is walked through too (BERT's ``encoder`` holding the
  ``encoder.layer`` list). What remains after expansion are the items: embeddings, the blocks, the
  final norm, the head.
  Parameter-less modules (dropout, activations) are not items. Neither is a module whose forward
  never runs (a ``ModuleList``: expanded into its children instead) nor one whose subtree holds only
  part of a group of tied weights (``ModuleTrace.tied_with``; e.g. GPT-2's ``wte``/``lm_head``):
  those parameters stay with the root unit, since FSDP2 shards each Parameter in one unit only.
- **Segments** are contiguous runs of items that are siblings (same parent), at most
  ``max_group_size`` long (2 for models of more than ``LONG_SEQUENCE_ITEMS`` items): one
  ``fully_shard([m1, m2, ...])`` call each.
- **Options** per segment: ``reshard_after_forward`` in {True, False, an int divisor of the shard
  group}, activation checkpointing off, full or (repeated blocks, traces with ``new_bytes`` records)
  selective with torchtitan's op-level classes (shard_planner/plan/checkpointing.py), *nested* (a single item whose large children become
  units of their own inside it, e.g. a block's attention and MLP), or *in root* (a single item left
  to the root unit: gathered at the start of the step and kept, as FSDP2 does with the root's own
  parameters). No checkpointing at all for a model whose forward builds a cache
  (:func:`checkpointing_allowed`).

Global choices (prefetch depths, micro-batch, mesh, CPU offload) are not part of a segment: the
solver loops over them (:mod:`shard_planner.solve.planner`).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass

from shard_planner.plan.checkpointing import DEFAULT_SAVE_OPS, SELECTIVE, checkpointing_refusal, is_selective
from shard_planner.cost.selective import keeps_something, supports_selective
from shard_planner.parallel.mesh import Mesh
from shard_planner.plan.ownership import contiguous_among, split_groups, tie_groups
from shard_planner.plan import ROOT
from shard_planner.trace.types import ModelTrace

logger = logging.getLogger(__name__)

# A container is expanded into its children when its subtree holds at least this share of the
# model's parameters (a decoder, the list of blocks), so that what remains are blocks-sized items.
EXPAND_SHARE = 0.25
# ... and when its own parameters are at most this share of its subtree (else it is a block).
OWN_PARAM_SHARE = 0.01
# A single item can be split into nested units when its children with parameters hold at least this
# share of its parameters (a block's attention and MLP).
NESTED_CHILD_SHARE = 0.5
# Children below this share of the item stay with the item's own unit when nesting.
NESTED_MIN_CHILD_SHARE = 0.1
DEFAULT_MAX_GROUP_SIZE = 4
# Deep models (more items than this) group at most 2 siblings per unit: the candidates grow with the
# group size, and with 80+ blocks a group of 2 already amortises the collectives' latency.
LONG_SEQUENCE_ITEMS = 40
LONG_SEQUENCE_MAX_GROUP_SIZE = 2


@dataclass(frozen=True)
class Item:
    """A module the planner may wrap, in forward order."""

    fqn: str
    parent: str
    param_count: int  # the whole subtree
    nested_children: tuple[str, ...]  # children that become units when the item is nested; () if not nestable
    may_join_root: bool  # a one-off module (embedding, norm, head), not a repeated block


@dataclass(frozen=True)
class Option:
    """What one candidate unit does. ``in_root``: the segment is left to the root unit."""

    reshard_after_forward: bool | int = True
    activation_checkpoint: bool | str = False  # "selective": DEFAULT_SAVE_OPS kept (shard_planner/plan/checkpointing.py)
    nested: bool = False
    in_root: bool = False

    @property
    def label(self) -> str:
        if self.in_root:
            return "in root"
        r = self.reshard_after_forward
        parts = [f"reshard {r}" if not isinstance(r, bool) else ("reshard" if r else "keep")]
        if self.activation_checkpoint:
            parts.append("SAC" if is_selective(self.activation_checkpoint) else "AC")
        if self.nested:
            parts.append("nested")
        return "+".join(parts)


@dataclass(frozen=True)
class Candidate:
    """One segment ``items[start:stop]`` with one option: one boolean of the program."""

    start: int
    stop: int
    option: Option


@dataclass(frozen=True)
class SearchSpace:
    items: tuple[Item, ...]
    candidates: tuple[Candidate, ...]
    root_only_params: int  # parameters no item owns (root's own, expanded containers' own, unused modules)

    @property
    def n(self) -> int:
        return len(self.items)


def first_calls(trace: ModelTrace) -> dict[str, float]:
    """Per module, the forward position of the module or of its first called descendant (a ModuleList
    is never called; ``math.inf`` where nothing in the subtree is), for every module at once."""
    order = {fqn: i for i, fqn in enumerate(trace.forward_order)}
    out: dict[str, float] = {}

    def visit(fqn: str) -> float:
        if fqn not in out:
            out[fqn] = min([order.get(fqn, math.inf)] + [visit(c) for c in trace.module(fqn).children])
        return out[fqn]

    visit(ROOT)
    return out


def find_items(trace: ModelTrace) -> tuple[Item, ...]:
    """The modules the planner may wrap, in forward order (see the module docstring)."""
    total = max(trace.param_count, 1)
    first_call = first_calls(trace).__getitem__

    def with_params(fqns):
        return [c for c in fqns if trace.subtree_param_count(c) > 0 and first_call(c) < math.inf]

    def wrappable(fqn: str) -> bool:
        """May be a unit: its forward runs (FSDP2's hooks fire; a ModuleList's never do) and its
        subtree holds all or none of every tie group (FSDP2 cannot shard one Parameter in two units)."""
        return trace.module(fqn).calls >= 1 and not (tied and splits_ties(trace, fqn))

    tied = any(m.tied_with for m in trace.modules)

    def expandable(fqn: str) -> bool:
        m = trace.module(fqn)
        sub = trace.subtree_param_count(fqn)
        kids = with_params(m.children)
        if fqn == ROOT:
            return bool(kids)
        twins = sum(1 for c in trace.module(m.parent).children if trace.module(c).structural_hash == m.structural_hash)
        if twins != 1 or sub < EXPAND_SHARE * total or m.param_count > OWN_PARAM_SHARE * sub:
            return False  # a block of a stack stays whole (nesting splits it instead)
        # A container with a single child (BertEncoder.layer, CLIPEncoder.layers: a ModuleList inside a
        # module with one child) is walked through when that child is itself expanded.
        return len(kids) >= 2 or (len(kids) == 1 and expandable(kids[0]))

    items: list[str] = []
    parents: dict[str, str] = {}

    def visit(fqn: str) -> None:
        for c in sorted(with_params(trace.module(fqn).children), key=first_call):
            if expandable(c) or (not wrappable(c) and with_params(trace.module(c).children)):
                visit(c)  # a module that may not be a unit leaves its own parameters to the root
            elif wrappable(c):
                items.append(c)
                parents[c] = fqn

    if expandable(ROOT):
        visit(ROOT)
    hash_counts = Counter(trace.module(f).structural_hash for f in items)
    out = []
    for fqn in items:
        sub = trace.subtree_param_count(fqn)
        kids = [c for c in with_params(trace.module(fqn).children)
                if trace.subtree_param_count(c) >= NESTED_MIN_CHILD_SHARE * sub and wrappable(c)]
        kids.sort(key=first_call)
        nestable = len(kids) >= 2 and sum(trace.subtree_param_count(c) for c in kids) >= NESTED_CHILD_SHARE * sub
        out.append(Item(
            fqn=fqn, parent=parents[fqn], param_count=sub,
            nested_children=tuple(kids) if nestable else (),
            may_join_root=hash_counts[trace.module(fqn).structural_hash] == 1,
        ))
    return tuple(out)


def splits_ties(trace: ModelTrace, fqn: str) -> bool:
    """Whether the subtree of ``fqn`` holds some but not all modules of a tie group (wrapping ``fqn``
    would give the group two owner units)."""
    inside = {m.fqn for m in trace.subtree(fqn)}
    groups = tie_groups((m.fqn, m.tied_with) for m in trace.modules if m.tied_with)
    return bool(split_groups(groups, inside.__contains__))


def checkpointing_allowed(trace: ModelTrace) -> bool:
    """Whether any unit of ``trace``'s model may be checkpointed: the solver's reading of
    shard_planner/plan/checkpointing.py's [Note: No checkpointing of a forward that builds a cache]."""
    return checkpointing_refusal(trace.model_path, trace.forward_cache) is None


def reshard_choices(shard_group: int, gpus_per_node: int) -> tuple[bool | int, ...]:
    """True, False, and the int divisors worth trying: the node size when the group spans nodes
    (re-gather inside the node over NVLink instead of across the network in backward)."""
    mesh = Mesh(shard=shard_group)
    per_node = mesh.shard_ranks_per_node(gpus_per_node)
    ints = [per_node] if per_node > 1 and mesh.is_reshard_size(per_node) else []
    return (True, False, *ints)


def build_space(trace: ModelTrace, *, shard_group: int, gpus_per_node: int,
                max_group_size: int = DEFAULT_MAX_GROUP_SIZE, allow_checkpointing: bool = True,
                allow_nested: bool = True, sharded: bool = True) -> SearchSpace:
    """Every candidate segment x option for ``trace`` on a shard group of ``shard_group`` ranks
    (checkpointing only where ``allow_checkpointing`` and :func:`checkpointing_allowed`). ``sharded`` False:
    the single-device step (plan/engine.py), where a unit is only a region checkpointed or not, so one
    reshard option (False) and no nested units."""
    allow_checkpointing = allow_checkpointing and checkpointing_allowed(trace)
    allow_nested = allow_nested and sharded
    items = find_items(trace)
    if len(items) > LONG_SEQUENCE_ITEMS:
        max_group_size = min(max_group_size, LONG_SEQUENCE_MAX_GROUP_SIZE)
    reshards = reshard_choices(shard_group, gpus_per_node) if sharded else (False,)
    acs = (False, True) if allow_checkpointing else (False,)
    # selective checkpointing for repeated blocks (torchtitan checkpoints blocks only), when the trace
    # records what forward ops allocate (cost/selective.py)
    block_acs = acs + (SELECTIVE,) if allow_checkpointing and supports_selective(trace) else acs
    # per item, once (not per segment): whether its forward stores some matmul or attention output
    stores = [keeps_something(trace, it.fqn, DEFAULT_SAVE_OPS) if block_acs != acs else False for it in items]
    candidates: list[Candidate] = []

    sibling_lists: dict[str, list[str]] = {}

    def siblings(parent: str) -> list[str]:  # the parent's children that hold parameters, in registration order
        if parent not in sibling_lists:
            sibling_lists[parent] = [c for c in trace.module(parent).children if trace.subtree_param_count(c) > 0]
        return sibling_lists[parent]

    for start, first in enumerate(items):
        for stop in range(start + 1, min(start + max_group_size, len(items)) + 1):
            if items[stop - 1].parent != first.parent:
                break
            if stop - start > 1 and not contiguous_among(siblings(first.parent), (it.fqn for it in items[start:stop])):
                continue  # apply_plan groups only an unbroken run of siblings (ownership.contiguous_among)
            # selective where it differs from full checkpointing: the run stores some matmul or attention output
            sac = not any(it.may_join_root for it in items[start:stop]) and any(stores[start:stop])
            for r in reshards:
                for ac in (block_acs if sac else acs):
                    candidates.append(Candidate(start, stop, Option(r, ac)))
                    if stop == start + 1 and allow_nested and first.nested_children:
                        candidates.append(Candidate(start, stop, Option(r, ac, nested=True)))
            if stop == start + 1 and first.may_join_root:
                candidates.append(Candidate(start, stop, Option(False, False, in_root=True)))
    owned = sum(it.param_count for it in items)
    space = SearchSpace(items=items, candidates=tuple(candidates), root_only_params=trace.param_count - owned)
    logger.debug("search space: %d items, %d candidates", space.n, len(candidates))
    return space
