"""Reuse of repeated identical blocks: a twin is not run, it stands in for its template.

[Note: twins] A module with children whose structural hash, plain attributes (flags such as
``is_causal``) and input signature (shapes, strides, dtypes, requires_grad, non-tensor arguments) equal
those of a module already traced in this step is not run; :class:`TwinFn` returns fresh tensors of the
recorded output layout (storages of the same sizes) and, in backward, gradients of its inputs. Its
numbers are the template's, with fqns remapped; in the log replay its spans count as the template's
rise and net change, so the enclosing modules' peaks are those of the real run. Tensors saved across
the boundary are handled explicitly: inputs and outputs the template saved are kept alive until the
twin's backward, and re-deduplicated against the twin's actual inputs (rotary cos/sin, saved by the
first layer only). Not reused, because the real numbers would differ: leaves (one or two ops; their
backward peak depends on how a shared input's gradient accumulates), a module sharing an input that
needs a gradient or a parameter with its template, and any module whose subtree runs more than once in
the step (parameter gradients accumulate across calls; detected after the step by
:meth:`Twins.tainted`, and the step is traced again without those templates).

[Note: unsafe reuse] A caller may modify a block's output in place (transformers' Falcon:
``mlp_output += attention_output``). For a twin that output is a stand-in: the real block's autograd
graph (what it saved, whose version counter the write bumps) is not there, and an output that shares
a storage with another cannot be written in place at all through a custom Function. Twin outputs are
therefore made without autograd views (``set_`` on the shared storage), every in-place op of the
forward is checked against them (:meth:`Twins.note_write`), and a step in which one was written is
traced again with every module of that structure traced for real (:meth:`Twins.unsafe_modules`); the
log says which.

[Note: shared input gradients] A twin may take an input that needs a gradient which its template took
too (T5's ``position_bias``, made by block 0 and passed to every later block; the decoder's encoder
output). Its gradient is the sum over its consumers: the consumer first in backward leaves a new
gradient alive (autograd's buffer for the sum), each later one adds into it. Twin and template agree
when neither is that first consumer; the one that is (T5's last block) is traced for real on a second
try (:meth:`Twins.first_gradients`). An output that is an input itself (T5's blocks return the
``position_bias`` they got) is returned as that input (:class:`PassThrough`), not as a new tensor.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any
import weakref

import torch
import torch.nn as nn
from torch.utils._pytree import tree_unflatten

from shard_planner.trace.records import Call, is_under, join_fqn, rel_fqn
from shard_planner.trace.storages import SavedTensors, StorageLog


@dataclass(frozen=True, slots=True)
class OutLeaf:
    """Layout of one tensor output of a template call, to recreate it for a twin."""

    shape: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    group: int  # outputs sharing a storage share a group
    group_nbytes: int
    made_by: str | None = None  # kernel class of the template's op that allocated it ([Note: kernel records])


@dataclass(frozen=True, slots=True)
class PassThrough:
    """An output of the template that is its tensor input ``index`` itself (T5's blocks return the
    ``position_bias`` they were given): a twin returns its own input, as the real module would."""

    index: int


@dataclass(frozen=True, slots=True)
class InputSave:
    """An input of the template that its subtree saved for backward (first at module path ``rel``)."""

    index: int  # among the call's tensor inputs
    rel: str
    counted: bool  # whether the template's save was the storage's first
    nbytes: int


@dataclass(frozen=True, slots=True)
class OutputSave:
    """An output of the template (tensor output ``index``) that its subtree saved, at path ``rel``."""

    index: int
    rel: str


@dataclass(frozen=True)
class TwinInfo:
    """What a twin of a template call needs: the output layout and the saves across the boundary."""

    out_spec: Any
    out_values: tuple  # output leaves: an OutLeaf or PassThrough for a tensor, the value itself otherwise
    input_saves: tuple[InputSave, ...]
    output_saves: tuple[OutputSave, ...]


class TwinFn(torch.autograd.Function):
    """Stands in for a twin's forward: outputs laid out as the template's; input gradients in backward.

    See [Note: twins]. One parameter is passed as an input only so that outputs require grad exactly
    when the template's did; it gets no gradient (gradients are excluded anyway).
    """

    @staticmethod
    def forward(ctx, info: TwinInfo, n_inputs: int, *tensors):
        ctx.input_meta = [(t.shape, t.dtype, t.device) for t in tensors[:n_inputs]]
        kept = [tensors[s.index] for s in info.input_saves]  # alive until backward, as the template's saves
        ctx.n_params = len(tensors) - n_inputs
        leaves = [v for v in info.out_values if isinstance(v, OutLeaf)]
        group_sizes = Counter(leaf.group for leaf in leaves)
        bases: dict[int, torch.Tensor] = {}
        outs = []
        for leaf in leaves:
            if group_sizes[leaf.group] == 1 and _fills_storage(leaf):  # one op instead of three
                outs.append(torch.empty_strided(leaf.shape, leaf.stride, dtype=leaf.dtype, device=leaf.device))
                continue
            if leaf.group not in bases:
                bases[leaf.group] = torch.empty(leaf.group_nbytes, dtype=torch.uint8, device=leaf.device)
            # set_ rather than as_strided: the output shares the storage but is no autograd view, so a
            # caller's in-place op reaches the recorder (see [Note: unsafe reuse]) instead of failing here
            out = torch.empty(0, dtype=leaf.dtype, device=leaf.device)
            outs.append(out.set_(bases[leaf.group].untyped_storage(), leaf.offset, leaf.shape, leaf.stride))
        no_grad = [o for o, leaf in zip(outs, leaves) if not leaf.requires_grad]
        if no_grad:
            ctx.mark_non_differentiable(*no_grad)
        ctx.save_for_backward(*kept, *(outs[s.index] for s in info.output_saves))
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        grads_in = tuple(
            torch.zeros(shape, dtype=dtype, device=device) if need else None
            for (shape, dtype, device), need in zip(ctx.input_meta, ctx.needs_input_grad[2:])
        )
        return (None, None) + grads_in + (None,) * ctx.n_params


def _fills_storage(leaf: OutLeaf) -> bool:
    """Whether a tensor of the leaf's layout at offset 0 spans exactly its storage, so that
    ``torch.empty_strided`` makes a storage of the template's size."""
    if leaf.offset != 0 or 0 in leaf.shape:
        return False
    extent = 1 + sum((n - 1) * s for n, s in zip(leaf.shape, leaf.stride))
    return extent * leaf.dtype.itemsize == leaf.group_nbytes


@dataclass(frozen=True)
class ReuseFacts:
    """What decides which modules may be twins: fixed for a model, computed once per trace."""

    hashes: dict[str, str]  # fqn -> structural hash
    twin_hashes: frozenset[str]  # hashes of more than one module (none when reuse is off)
    leaves: frozenset[str]  # modules without children: never reused (see [Note: twins])
    param_ids: dict[str, frozenset[int]]  # fqn (not a leaf) -> ids of its subtree's parameters
    attr_sigs: dict[str, tuple]  # fqn -> attribute_signatures
    stateless: frozenset[str] = frozenset()  # modules without parameters in their subtree (a Dropout)


def reuse_facts(model: nn.Module, hashes: dict[str, str], reuse: bool) -> ReuseFacts:
    """The :class:`ReuseFacts` of ``model``; ``reuse=False`` makes no module a twin."""
    counts = Counter(hashes.values())
    modules = list(model.named_modules())
    leaves = frozenset(fqn for fqn, m in modules if next(m.children(), None) is None)
    return ReuseFacts(
        hashes=hashes,
        twin_hashes=frozenset(h for h, n in counts.items() if n > 1) if reuse else frozenset(),
        leaves=leaves,
        param_ids={fqn: frozenset(id(p) for p in m.parameters()) for fqn, m in modules if fqn not in leaves},
        attr_sigs=attribute_signatures(model),
        stateless=frozenset(fqn for fqn, m in modules if next(m.parameters(), None) is None),
    )


class Twins:
    """The templates of one step, and the twins that reused them."""

    def __init__(self, facts: ReuseFacts, banned: set[str]):
        self.facts = facts
        self.banned = banned  # modules that turned out not to be faithful templates
        self.templates: dict[tuple, Call] = {}
        self.calls: list[Call] = []  # the twins
        self.out_sids: dict[int, str] = {}  # storage of a twin's output -> the twin's fqn
        self.unsafe: set[str] = set()  # twins whose output their caller modified in place
        # (twin fqn, template, input storages needing a gradient that both took): [Note: shared input gradients]
        self.shared_grads: list[tuple[str, Call, frozenset]] = []

    def note_outputs(self, fqn: str, sids) -> None:
        for sid in sids:
            self.out_sids[sid] = fqn

    def note_write(self, sid: int | None) -> None:
        """An in-place op in forward wrote storage ``sid``: if a twin's output, that twin is unsafe."""
        fqn = self.out_sids.get(sid)
        if fqn is not None:
            self.unsafe.add(fqn)

    def unsafe_modules(self) -> set[str]:
        """Every module of the same structure as an unsafe twin: traced for real on a second try
        (see [Note: unsafe reuse])."""
        hashes = {self.facts.hashes[fqn] for fqn in self.unsafe}
        return {fqn for fqn, h in self.facts.hashes.items() if h in hashes}

    def key(self, fqn: str, leaves, spec) -> tuple | None:
        """What a twin must share with its template; None for a module that is never reused."""
        f = self.facts
        if f.hashes.get(fqn) in f.twin_hashes and fqn != "" and fqn not in f.leaves:
            return (f.hashes[fqn], f.attr_sigs[fqn], input_signature(leaves, spec))
        return None

    def template_for(self, key: tuple | None, fqn: str, grad_input_sids) -> Call | None:
        """The template a call of ``fqn`` may stand in for, or None to trace it for real.

        ``grad_input_sids()`` gives the storages of its inputs that need a gradient. Sharing parameters
        with the template (a module called twice, tied weights) makes parameter gradients accumulate
        across both: never a twin. Sharing an input that needs a gradient (T5's ``position_bias``, made
        by block 0 and taken by every block) is allowed, but checked after the step (see
        [Note: shared input gradients]).
        """
        template = self.templates.get(key) if key is not None and fqn not in self.banned else None
        if template is None or template.param_ids & self.facts.param_ids[fqn]:
            return None
        shared = template.input_sids & grad_input_sids()
        if shared:
            self.shared_grads.append((fqn, template, frozenset(shared)))
        return template

    def may_remember(self, key: tuple | None, fqn: str) -> bool:
        return key is not None and key not in self.templates and fqn not in self.banned

    def remember(self, key: tuple, call: Call, info: TwinInfo, input_sids: frozenset) -> None:
        call.twin_info = info
        call.input_sids = input_sids
        call.param_ids = self.facts.param_ids[call.fqn]
        self.templates[key] = call

    def tainted(self, calls_by_fqn: dict[str, int]) -> set[str]:
        """Templates and twins whose subtree ran more than once (a shared module): its parameter
        gradients accumulate across calls, so a twin would not match the real run. They are traced for
        real on a second try. A module without parameters called twice (transformers' ViTLayer calls its
        one Dropout twice) accumulates nothing: it does not taint (else a 48-layer ViT is traced 49 times)."""
        shared = {fqn for fqn, n in calls_by_fqn.items() if n > 1 and fqn not in self.facts.stateless}

        def runs_shared(fqn: str) -> bool:
            return any(is_under(s, fqn) for s in shared)

        out = {c.fqn for c in self.calls if runs_shared(c.fqn)}
        out |= {c.template.fqn for c in self.calls if runs_shared(c.template.fqn)}
        return out

    def first_gradients(self, root: Call) -> set[str]:
        """Twins and templates that, sharing an input needing a gradient, were (or contain) the first of
        that input's consumers in backward, with their subtrees: traced for real on a second try (see
        [Note: shared input gradients])."""
        if not self.shared_grads:
            return set()
        out = set()
        for fqn, template, shared in self.shared_grads:
            for sid in shared:
                consumer = _first_consumer(root, sid)
                for member in (fqn, template.fqn):
                    if consumer is not None and is_under(consumer, member):
                        out |= {m for m in self.facts.hashes if is_under(m, member)}
        return out


def _first_consumer(root: Call, sid: int) -> str | None:
    """The innermost call that took storage ``sid`` as an input and whose backward began first: where
    the input's first gradient was made."""
    def takers(calls):
        return [c for c in calls if c.bwd is not None and c.fqn is not None and sid in c.in_sids]

    everywhere, stack = [], [root]
    while stack:
        call = stack.pop()
        stack.extend(call.children)
        everywhere.append(call)
    found = takers(everywhere)
    if not found:
        return None
    call = min(found, key=lambda c: c.bwd.start)
    while inner := takers(call.children):
        call = min(inner, key=lambda c: c.bwd.start)
    return call.fqn


def twin_info(log: StorageLog, saves: SavedTensors, call: Call, in_tensors, out_leaves, out_spec,
              made_by) -> TwinInfo | None:
    """What a later twin of ``call`` (just run for real) needs; None if it cannot be a template.
    ``made_by(sid)``: the kernel class of the op inside the call that allocated storage ``sid``, or None."""
    if not _calls_under(call, call.fqn):  # a shared module from elsewhere ran inside: fqns do not remap
        return None
    start, end = call.fwd.start, call.fwd.end
    input_saves = []
    for i, t in enumerate(in_tensors):
        first = saves.first_within(log.sid(t), start, end)
        if first is not None:
            input_saves.append(InputSave(i, join_fqn(rel_fqn(first.call.fqn, call.fqn), first.rel), first.counted,
                                         first.nbytes))
    groups: dict[int, int] = {}
    values, output_saves, k = [], [], 0
    in_sids = {log.sid(t) for t in in_tensors}
    for v in out_leaves:
        if not isinstance(v, torch.Tensor):
            values.append(v)
            continue
        same = [i for i, t in enumerate(in_tensors) if t is v]
        if same:
            values.append(PassThrough(same[0]))
            continue
        sid = log.sid(v)
        group = groups.setdefault(sid, len(groups))
        values.append(OutLeaf(tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype, v.device,
                              v.requires_grad, group, log.nbytes[sid], made_by(sid)))
        first = saves.first_within(sid, start, end)
        if first is not None and sid not in in_sids and first.counted:
            output_saves.append(OutputSave(k, join_fqn(rel_fqn(first.call.fqn, call.fqn), first.rel)))
        k += 1
    return TwinInfo(out_spec, tuple(values), tuple(input_saves), tuple(output_saves))


def run_twin(log: StorageLog, saves: SavedTensors, call: Call, info: TwinInfo, params: list, in_tensors):
    """Run :class:`TwinFn` for ``call`` and record the saves across its boundary (``call.save_adjust``
    corrects its template's saved bytes where the dedup against this call's inputs differs)."""
    outs = TwinFn.apply(info, len(in_tensors), *in_tensors, *params)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    for s in info.input_saves:
        sid = log.sid(in_tensors[s.index])
        counted = saves.note(len(log.events), sid, log.nbytes[sid], call, s.rel)
        if s.counted and not counted:  # the template counted it; here it was saved already
            call.save_adjust.append((s.rel, -s.nbytes))
        elif counted and not s.counted:  # the template found it saved already; here it is new
            call.save_adjust.append((s.rel, log.nbytes[sid]))
    for s in info.output_saves:
        sid = log.sid(outs[s.index])
        saves.note(len(log.events), sid, log.nbytes[sid], call, s.rel)
    it = iter(outs)
    leaves = [next(it) if isinstance(v, OutLeaf) else in_tensors[v.index] if isinstance(v, PassThrough) else v
              for v in info.out_values]
    return tree_unflatten(leaves, info.out_spec)


def input_signature(leaves, spec) -> tuple:
    """What a call's inputs (``leaves, spec = tree_flatten((args, kwargs))``) must share with its template's: their
    structure, the grad mode, each tensor's shape, stride, dtype, requires_grad and device type, each other value
    (or its repr when it has no hash)."""
    sig = [str(spec), torch.is_grad_enabled()]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            sig.append((tuple(x.shape), tuple(x.stride()), x.dtype, x.requires_grad, x.device.type))
        elif type(x).__hash__ is object.__hash__ and hasattr(type(x), "__weakref__"):
            # compared by identity: a weak reference compares as its object does while it lives, and does
            # not keep it alive (a KV cache passed to every attention layer: trace/held.py)
            sig.append(("v", type(x).__name__, weakref.ref(x)))
        else:
            try:
                hash(x)
                sig.append(("v", type(x).__name__, x))
            except TypeError:
                sig.append(("r", repr(x)))
    return tuple(sig)


# Attributes that number a block within its stack (transformers: layer_idx, to index a KV cache that a
# training step does not use; torchtitan: layer_id, for its depth-scaled init), and what stands for
# one equal to the index of an enclosing stack entry (see attribute_signatures).
_POSITION_NAMES = frozenset({"layer_idx", "layer_id", "layer_index", "block_idx", "block_id"})
_POSITION = "<position in the stack>"


def attribute_signatures(model: nn.Module) -> dict[str, tuple]:
    """fqn -> the plain attributes (numbers, strings, flags) of every module in its subtree.

    Structural hashes see classes, parameters and buffers only; two attention modules that differ in
    ``is_causal`` or a dropout rate have the same hash but are not twins. A block number
    (``_POSITION_NAMES``) equal to the index of an enclosing stack entry
    (``layers.7.self_attn.layer_idx == 7``) is the block's position, not its configuration, and is
    recorded as such, with how many numbered entries up that stack is (the outermost that matches):
    T5's ``block.7.layer.0.SelfAttention.layer_idx == 7`` numbers the ``block`` stack, one up from the
    block's own ``layer`` list, so the blocks of a stack stay twins. A block whose forward branches on
    that number (rather than on other attributes or its inputs) would be reused wrongly:
    ``trace_model(..., reuse=False)`` traces everything.
    """
    sigs: dict[str, tuple] = {}

    def visit(fqn: str, module: nn.Module, positions: tuple[int, ...]) -> tuple:
        own = tuple(sorted(
            (k, _position_marker(v, positions) if k in _POSITION_NAMES else v)
            for k, v in vars(module).items()
            if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None)))
        ))
        kids = tuple((name, visit(join_fqn(fqn, name), child, positions + (int(name),) if name.isdigit() else positions))
                     for name, child in module.named_children())
        sigs[fqn] = (own, kids)
        return sigs[fqn]

    visit("", model, ())
    return sigs


def _position_marker(value, positions: tuple[int, ...]):
    """``value`` itself, or (_POSITION, k) when it equals the index of the k-th enclosing numbered
    entry counting up from the module (0: the nearest), for the largest such k."""
    if type(value) is not int:
        return value
    ups = [k for k, index in enumerate(reversed(positions)) if index == value]
    return (_POSITION, ups[-1]) if ups else value


def _calls_under(call: Call, base: str) -> bool:
    return all(c.fqn is not None and is_under(c.fqn, base) and _calls_under(c, base) for c in call.children)
