"""The recipes: the named FSDP2 policies people already run, as values. One list (:data:`RECIPES`) that the
planner starts from and must never answer worse than (solve/never_worse.py), that ``shard-planner estimate
--recipe NAME`` prices, and that the report and the summary place beside the answer. It lives beside
plan/checkpointing.py, outside the solver's package, so that the command line lists the names without importing
the planner; the units are built on the solver's search space (solve/space.py), which a recipe only reads.

A recipe fixes some knobs and leaves the rest to the planner, as the stack it comes from does. The knobs a
recipe may fix (:data:`RECIPE_KNOBS`): the wrap (which modules are units), reshard after forward, activation
checkpointing, CPU offload and the prefetch depths. The planner always keeps the micro-batch, the gradient
accumulation and the tensor-parallel degree (a recipe is priced at each of the search's global choices), and
the prefetch depths where the recipe's stack does not expose them (the generic recipes: FSDP2 per block,
ZeRO-2-like, full AC).

- torchtitan (torchtitan/models/llama3/infra/parallelize.py, ``apply_fsdp`` with
  ``reshard_after_forward_policy = "default"``): ``fully_shard`` on ``tok_embeddings`` and on every
  transformer block with ``reshard_after_forward=True``, on ``[norm, output]`` with ``False`` ("do not
  reshard_after_forward the last layers by default since FSDP would prefetch them immediately after the
  forward pass"), then on the root; no explicit prefetch (FSDP2's default); CPU offload off. Its AC modes
  (``activation_checkpoint.mode`` none / full / selective; ``_apply_ac_to_transformer_block`` in the same
  file): ``"full"`` wraps every block in ``checkpoint_wrapper``; selective ``"op"`` keeps the outputs of
  every other ``mm`` and of SDPA (shard_planner/plan/checkpointing.py [Note: torchtitan's op-level policy]);
  selective ``"2"`` (an int: every k-th layer) checkpoints a block when its 1-based count is a multiple of
  2. Here: the leading one-off items (embeddings) are units of their own, resharded; the trailing ones
  (final norm, head) one unit per run of siblings, not resharded (HF models hold ``norm`` and ``lm_head``
  under different parents); the root is not resharded (FSDP2's default for the root).
- torchtune (torchtune/training/_distributed.py, ``shard_model``; the recipes' ``get_shard_conditions``
  shards every ``layers.i``): every block a unit and the root, all with ``reshard_after_forward=True`` (the
  recipes' ``fsdp_reshard_after_forward`` default); ``enable_activation_checkpointing: True`` in its
  distributed configs (full AC on every block); ``fsdp_cpu_offload`` = ``CPUOffloadPolicy()``: parameters,
  gradients and the optimizer step on the CPU.
- Accelerate ``TRANSFORMER_BASED_WRAP``: every module of the transformer-layer class is a unit, the root
  too, all ``FULL_SHARD`` (reshard True, the root included). ``SIZE_BASED_WRAP`` (``min_num_params`` 1e8,
  Accelerate's default): units of at least that many parameters, grouped greedily along the sequence of
  sibling modules; what is left stays in the root. Accelerate's ``fsdp2_prepare_model``
  (src/accelerate/utils/fsdp_utils.py) calls ``fully_shard`` with the plugin's ``reshard_after_forward`` on
  every module its wrap policy matches and then on the root, and sets no explicit prefetch.
- FSDP2 per block (PyTorch's "Getting Started with FSDP2" tutorial, and ``fully_shard``'s docs: apply it
  bottom-up, every transformer block, then the root): every block a unit with ``reshard_after_forward=True``
  (``fully_shard``'s default), the root not resharded (its docs: the root's value is set to False, since its
  parameters would be all-gathered again at once for backward); no AC, no offload; prefetch left to the
  planner (the tutorial shows explicit prefetching as an option).
- ZeRO-2-like: one unit per block with ``reshard_after_forward=False`` everywhere (parameters stay gathered
  from forward to backward), FSDP2's SHARD_GRAD_OP; prefetch left to the planner.
- full AC: one unit per block, resharded, every block checkpointed; prefetch left to the planner.

"Blocks" are the repeated items of the search space (modules with a structurally identical sibling); a
model without repeated blocks uses every item. Every recipe wraps only the search space's items, so like
the solver's plans it never wraps a module whose forward never runs (a ``ModuleList``) nor one that holds
only part of a group of tied weights: those stay in the root unit (see :mod:`shard_planner.solve.space`).
A recipe that checkpoints is not offered for a model that may not be checkpointed
(shard_planner/plan/checkpointing.py [Note: No checkpointing of a forward that builds a cache]).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from typing import TYPE_CHECKING

from shard_planner.plan.checkpointing import SELECTIVE, TORCHTITAN_OP_SAVE_OPS, checkpointing_refusal
from shard_planner.plan import ROOT, Unit

if TYPE_CHECKING:  # a recipe reads the solver's space; the solver imports this module
    from shard_planner.solve.space import Item, SearchSpace
    from shard_planner.trace.types import ModelTrace

SIZE_BASED_MIN_NUM_PARAMS = 100_000_000  # accelerate FullyShardedDataParallelPlugin default (min_num_params=1e8)
TORCHTITAN_LAYER_AC_EVERY = 2  # torchtitan's selective_ac_option "2" (its llama3 configs' selective layer option)

WRAP, RESHARD, AC, OFFLOAD, PREFETCH = "wrap", "reshard", "activation checkpointing", "CPU offload", "prefetch"
RECIPE_KNOBS = (WRAP, RESHARD, AC, OFFLOAD, PREFETCH)  # what a recipe may fix
PLANNER_KNOBS = ("micro-batch", "gradient accumulation", "tensor-parallel degree")  # never fixed by a recipe


@dataclass(frozen=True)
class Recipe:
    """A named policy: ``units(space)`` are its FSDP units on a model's search space; ``cpu_offload`` its
    offload; ``fixes`` the knobs it decides (the others are the planner's, :meth:`planner_knobs`)."""

    name: str  # the CLI's name: ``estimate --recipe NAME``
    title: str  # what the report and the summary call it
    source: str  # where the policy is written down
    make_units: Callable[[SearchSpace], tuple[Unit, ...]]
    fixes: tuple[str, ...] = (WRAP, RESHARD, AC, OFFLOAD, PREFETCH)
    cpu_offload: bool = False

    def __post_init__(self):
        unknown = [k for k in self.fixes if k not in RECIPE_KNOBS]
        if unknown or WRAP not in self.fixes:
            raise ValueError(f"recipe {self.name}: fixes {self.fixes}: every recipe fixes {WRAP}, among {RECIPE_KNOBS}")

    @property
    def fixes_prefetch(self) -> bool:
        return PREFETCH in self.fixes

    def planner_knobs(self) -> tuple[str, ...]:
        return PLANNER_KNOBS + tuple(k for k in RECIPE_KNOBS if k not in self.fixes)

    def units(self, space: SearchSpace) -> tuple[Unit, ...]:
        return self.make_units(space)

    def checkpoints(self, space: SearchSpace) -> bool:
        return any(u.activation_checkpoint for u in self.units(space))

    def describe(self) -> str:
        """One line: what it fixes and what it leaves to the planner."""
        return (f"{self.title}: fixes {', '.join(self.fixes)}; the planner's: {', '.join(self.planner_knobs())} "
                f"({self.source})")


def _blocks(space: SearchSpace) -> list[str]:
    parents = Counter(it.parent for it in space.items if not it.may_join_root)
    blocks = [it.fqn for it in space.items if not it.may_join_root and parents[it.parent] >= 2]
    return blocks or [it.fqn for it in space.items]


def _one_offs(space: SearchSpace) -> tuple[list[Item], list[list[Item]]]:
    """The one-off items before the first block (each alone) and after the last (runs of siblings)."""
    blocks = set(_blocks(space))
    order = [it.fqn for it in space.items]
    first = min((order.index(b) for b in blocks), default=len(order))
    last = max((order.index(b) for b in blocks), default=-1)
    lead = [it for it in space.items[:first] if it.fqn not in blocks]
    runs: list[list[Item]] = []
    for it in space.items[last + 1:]:
        if runs and runs[-1][-1].parent == it.parent:
            runs[-1].append(it)
        else:
            runs.append([it])
    return lead, runs


def _torchtitan(ac: Callable[[int], dict]) -> Callable[[SearchSpace], tuple[Unit, ...]]:
    """torchtitan's units, ``ac(i)`` the checkpointing fields of the i-th block (0-based)."""
    def make(space: SearchSpace) -> tuple[Unit, ...]:
        lead, tail = _one_offs(space)
        return (Unit((ROOT,), False), *(Unit((it.fqn,), True) for it in lead),
                *(Unit((b,), True, **ac(i)) for i, b in enumerate(_blocks(space))),
                *(Unit(tuple(it.fqn for it in run), False) for run in tail))
    return make


def _per_block(root_reshard: bool, reshard: bool, checkpoint: bool) -> Callable[[SearchSpace], tuple[Unit, ...]]:
    def make(space: SearchSpace) -> tuple[Unit, ...]:
        return (Unit((ROOT,), root_reshard), *(Unit((b,), reshard, activation_checkpoint=checkpoint)
                                               for b in _blocks(space)))
    return make


def accelerate_size_wrap(space: SearchSpace, min_num_params: int = SIZE_BASED_MIN_NUM_PARAMS) -> tuple[Unit, ...]:
    units = [Unit((ROOT,), True)]
    group: list = []
    for it in space.items:
        if group and group[-1].parent != it.parent:
            group = []  # only siblings share a unit; a short run stays in the root
        group.append(it)
        if sum(g.param_count for g in group) >= min_num_params:
            units.append(Unit(tuple(g.fqn for g in group), True))
            group = []
    return tuple(units)


TITAN = "torchtitan/models/llama3/infra/parallelize.py apply_fsdp, _apply_ac_to_transformer_block"
TUNE = "torchtune/training/_distributed.py shard_model, get_shard_conditions"
ACCELERATE = "accelerate src/accelerate/utils/fsdp_utils.py fsdp2_prepare_model"
# PyTorch's "Getting Started with FSDP2" tutorial: fully_shard(layer) for every block, then fully_shard(model); the
# root's reshard_after_forward is False (fully_shard's docs: the root's parameters are all-gathered again at once)
FSDP2_DOCS = "pytorch.org/tutorials/intermediate/FSDP_tutorial.html; torch.distributed.fsdp.fully_shard docs"
_STACK_FIXED = (WRAP, RESHARD, AC, OFFLOAD, PREFETCH)
_GENERIC_FIXED = (WRAP, RESHARD, AC, OFFLOAD)

RECIPES: tuple[Recipe, ...] = (
    Recipe("torchtitan", "torchtitan (per block, reshard, no AC)", TITAN, _torchtitan(lambda i: {})),
    Recipe("torchtitan-full-ac", "torchtitan (full AC)", TITAN,
           _torchtitan(lambda i: dict(activation_checkpoint=True))),
    Recipe("torchtitan-op-sac", "torchtitan (selective AC per op)", TITAN,
           _torchtitan(lambda i: dict(activation_checkpoint=SELECTIVE, ac_save_ops=TORCHTITAN_OP_SAVE_OPS))),
    Recipe("torchtitan-layer-sac", f"torchtitan (selective AC every {TORCHTITAN_LAYER_AC_EVERY} layers)", TITAN,
           _torchtitan(lambda i: dict(activation_checkpoint=(i + 1) % TORCHTITAN_LAYER_AC_EVERY == 0))),
    Recipe("torchtune", "torchtune (per block, full AC)", TUNE, _per_block(True, True, True)),
    Recipe("torchtune-cpu-offload", "torchtune (per block, full AC, CPU offload)", TUNE,
           _per_block(True, True, True), cpu_offload=True),
    Recipe("accelerate-transformer-wrap", "Accelerate TRANSFORMER_BASED_WRAP", ACCELERATE,
           _per_block(True, True, False)),
    Recipe("accelerate-size-wrap", "Accelerate SIZE_BASED_WRAP (1e8)", ACCELERATE, accelerate_size_wrap),
    Recipe("fsdp2-per-block", "FSDP2 per block, then the root", FSDP2_DOCS, _per_block(False, True, False),
           fixes=_GENERIC_FIXED),
    Recipe("zero2-like", "ZeRO-2-like (no reshard)", "FSDP2 reshard_after_forward=False (SHARD_GRAD_OP)",
           _per_block(False, False, False), fixes=_GENERIC_FIXED),
    Recipe("full-ac", "full activation checkpointing", "torch.utils.checkpoint on every block",
           _per_block(False, True, True), fixes=_GENERIC_FIXED),
)
RECIPE_NAMES = tuple(r.name for r in RECIPES)


def recipe_named(name: str) -> Recipe:
    """The recipe called ``name`` (ValueError naming the known ones)."""
    for r in RECIPES:
        if r.name == name:
            return r
    raise ValueError(f"unknown recipe {name!r}; known: {', '.join(RECIPE_NAMES)}")


def recipes_for(space: SearchSpace, trace: ModelTrace) -> list[tuple[Recipe, tuple[Unit, ...]]]:
    """(recipe, units) of each recipe for ``space``, without those that checkpoint a model that may not be
    checkpointed, and without a recipe whose units, offload and prefetch rule repeat an earlier one's (a model
    without embeddings or head as items makes torchtitan's units those of a simpler recipe)."""
    allowed = checkpointing_refusal(trace.model_path, trace.forward_cache) is None
    out, seen = [], set()
    for r in RECIPES:
        units = r.units(space)
        key = (frozenset(units), r.cpu_offload, r.fixes_prefetch)
        if key in seen or (not allowed and any(u.activation_checkpoint for u in units)):
            continue
        seen.add(key)
        out.append((r, units))
    return out
