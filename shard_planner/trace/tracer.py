"""``trace_model``: one forward + loss + backward per batch size, under FakeTensorMode, recorded per module.

How it works (one traced step, :class:`_Step`):

- The model is built under :class:`FakeTensorMode` (no real memory), its floating parameters are cast
  to the compute dtype as FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` does (parameter bytes are
  recorded as built, before the cast), and floating inputs are cast at the root's entry
  (``cast_forward_inputs``).
- Every module's ``forward`` is wrapped for the step. Each call of a module is a :class:`_Call` with a
  forward span and, once a gradient for one of its outputs arrives
  (``register_multi_grad_hook(outputs, mode="any")``), a backward span that ends when the gradients of
  its inputs are ready (``register_multi_grad_hook(inputs)``) or when the backward of a module outside it
  begins (a module whose inputs need no gradient, e.g. an embedding, never gets the second hook).
- A :class:`TorchDispatchMode` (:class:`_Recorder`) sees every aten op: it counts FLOPs with
  FlopCounterMode's formulas (``trace/flops.py``) for the innermost module, and tracks tensor storages
  by identity with weak references (alloc when first seen, free when the storage dies, and size changes
  through ``UntypedStorage.resize_``, which it patches for the step as torch's MemTracker does). Every
  event goes into one log, together with the spans' entry and exit marks.
- ``saved_tensors_hooks`` see every tensor saved for backward: deduplicated by storage, attributed to
  the innermost module active when first saved; parameters, buffers and views of them are not activations.
- After the backward the parameter gradients are known; they and the parameters are excluded and every
  span's peak rise (``max(live) - live at entry``) and net change are recomputed from the log
  (:meth:`_Step.span_stats`).

Repeated identical blocks ([Note: twins]): a module with children whose structural hash, plain
attributes (flags such as ``is_causal``) and input signature (shapes, strides, dtypes, requires_grad,
non-tensor arguments) equal those of a module already traced in this step is not run; :class:`_TwinFn`
returns fresh tensors of the recorded output layout (storages of the same sizes) and, in backward,
gradients of its inputs. Its numbers are the template's, with fqns remapped; in the log replay its spans
count as the template's rise and net change, so the enclosing modules' peaks are those of the real run.
Tensors saved across the boundary are handled explicitly: inputs and outputs the template saved are kept
alive until the twin's backward, and re-deduplicated against the twin's actual inputs (rotary cos/sin,
saved by the first layer only). Not reused, because the real numbers would differ: leaves (one or two
ops; their backward peak depends on how a shared input's gradient accumulates), a module sharing an
input that needs a gradient or a parameter with its template, and any module whose subtree runs more
than once in the step (parameter gradients accumulate across calls; detected after the step, which is
then traced again without those templates). ``trace_model(..., reuse=False)`` traces everything.

A module called several times in a step (a shared module) sums its calls' bytes and FLOPs and keeps
the largest peak. The loss (``loss_*``) is its own span: saved tensors of ``loss_fn``, and its peak rise
from the loss's forward until the model's backward begins (the fp32 logits and their gradient).
``forward_order`` is by first entry into the wrapped ``forward`` (where a forward-pre-hook would fire),
``backward_order`` by the first gradient of an output. Two traced batch sizes give every per-micro-batch
quantity as an :class:`Affine` in the batch size (exact where the bytes are linear in it; a batch maker
whose batch-1 tensors are views of a larger storage, e.g. ``tokens[:, :-1].contiguous()``, bends the
line by those few bytes).
"""

from __future__ import annotations

import json
import logging
import time
import weakref
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import register_multi_grad_hook, saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from shard_planner.errors import ModelFileError, UserError
from shard_planner.modelfile import ModelFile, load_model_file
from shard_planner.trace.flops import FlopCounter
from shard_planner.trace.structure import model_fingerprint, structural_hashes
from shard_planner.trace.types import Affine, ModelTrace, ModuleTrace
from shard_planner.units import DTYPE_NAMES

logger = logging.getLogger(__name__)

_ALLOC, _FREE, _RESIZE, _ENTER, _EXIT = range(5)


def compute_dtype_name(dtype: str) -> str:
    """``"bf16"`` -> ``"bfloat16"``; UserError for a dtype the tracer does not support."""
    name = DTYPE_NAMES.get(str(dtype).lower())
    if name is None:
        raise UserError(f"unknown compute dtype {dtype!r}: use bf16 or fp32")
    return name


# ---------------------------------------------------------------------------------------------------
# Per-step bookkeeping


class _Span:
    """A forward or backward stretch of one call, as positions in the step's event log."""

    __slots__ = ("call", "kind", "start", "end")

    def __init__(self, call: "_Call", kind: str, start: int):
        self.call, self.kind, self.start, self.end = call, kind, start, -1


class _Call:
    """One forward call of a module (``fqn``), or of the loss function (``fqn is None``)."""

    __slots__ = (
        "fqn", "parent", "children", "fwd", "bwd", "bwd_open", "template", "twin_info",
        "saved_bytes", "fwd_flops", "bwd_flops", "input_bytes", "input_shared_bytes", "output_bytes", "save_adjust",
        "input_sids", "in_sids",
        "param_ids", "fwd_ops", "bwd_ops",
    )

    def __init__(self, fqn: str | None, parent: "_Call | None"):
        self.fqn, self.parent = fqn, parent
        self.children: list[_Call] = []
        self.fwd: _Span | None = None
        self.bwd: _Span | None = None
        self.bwd_open = False
        self.template: _Call | None = None  # set for a twin: the call whose numbers it reuses
        self.twin_info: _TwinInfo | None = None  # set for a call that can serve as a template
        self.saved_bytes = self.fwd_flops = self.bwd_flops = self.input_bytes = self.output_bytes = 0
        self.input_shared_bytes = 0  # of input_bytes, storages already held (ModuleTrace.input_shared_bytes)
        self.in_sids: frozenset = frozenset()  # the storages of its inputs
        self.fwd_ops = self.bwd_ops = 0  # aten ops dispatched by its own code (per-op overhead)
        self.save_adjust: list[tuple[str, int]] = []  # (path relative to the twin, bytes) corrections
        self.input_sids: frozenset = frozenset()  # for a template: the storages of its inputs
        self.param_ids: frozenset = frozenset()  # for a template: ids of its subtree's parameters


@dataclass(frozen=True)
class _OutLeaf:
    """Layout of one tensor output of a template call, to recreate it for a twin."""

    shape: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    group: int  # outputs sharing a storage share a group
    group_nbytes: int


@dataclass(frozen=True)
class _TwinInfo:
    """What a twin of a template call needs: the output layout and the saves across the boundary."""

    out_spec: Any
    out_values: tuple  # output leaves: an _OutLeaf for a tensor, the value itself otherwise
    input_saves: tuple  # (input leaf index, saver path relative to the template, counted, nbytes)
    output_saves: tuple  # (output tensor index, saver path relative to the template)


@dataclass
class _Rec:
    """One call's numbers for one module (a twin's are copied from its template, remapped)."""

    fqn: str
    calls: int = 0
    saved: int = 0
    fwd_flops: int = 0
    bwd_flops: int = 0
    input_bytes: int = 0
    output_bytes: int = 0
    fwd_rise: int = 0
    bwd_rise: int = 0
    fwd_key: tuple | None = None
    bwd_key: tuple | None = None
    fwd_ops: int = 0
    bwd_ops: int = 0
    input_shared_bytes: int = 0


@dataclass(frozen=True)
class _StepResult:
    """What one traced batch size yields, before fitting."""

    per_module: dict  # fqn -> aggregated _Rec
    forward_order: tuple
    backward_order: tuple
    batch_input_bytes: int
    loss_saved_bytes: int
    loss_peak_rise_bytes: int
    loss_flops: int
    reused_modules: int
    loss_ops: int = 0


def _rel(fqn: str, base: str) -> str:
    return "" if fqn == base else (fqn if base == "" else fqn[len(base) + 1 :])


def _join(base: str, rel: str) -> str:
    return base if not rel else (rel if not base else f"{base}.{rel}")


def _under(fqn: str, base: str) -> bool:
    return fqn == base or base == "" or fqn.startswith(base + ".")


class _TwinFn(torch.autograd.Function):
    """Stands in for a twin's forward: outputs laid out as the template's; input gradients in backward.

    See [Note: twins] in the module docstring. One parameter is passed as an input only so that outputs
    require grad exactly when the template's did; it gets no gradient (gradients are excluded anyway).
    """

    @staticmethod
    def forward(ctx, info: _TwinInfo, n_inputs: int, *tensors):
        ctx.input_meta = [(t.shape, t.dtype, t.device) for t in tensors[:n_inputs]]
        kept = [tensors[i] for i, *_ in info.input_saves]  # alive until backward, as the template's saves
        ctx.n_params = len(tensors) - n_inputs
        leaves = [v for v in info.out_values if isinstance(v, _OutLeaf)]
        bases: dict[int, torch.Tensor] = {}
        outs = []
        for leaf in leaves:
            if leaf.group not in bases:
                bases[leaf.group] = torch.empty(leaf.group_nbytes, dtype=torch.uint8, device=leaf.device)
            base = bases[leaf.group].view(leaf.dtype)
            outs.append(base.as_strided(leaf.shape, leaf.stride, leaf.offset))
        no_grad = [o for o, leaf in zip(outs, leaves) if not leaf.requires_grad]
        if no_grad:
            ctx.mark_non_differentiable(*no_grad)
        ctx.save_for_backward(*kept, *(outs[k] for k, _ in info.output_saves))
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        grads_in = tuple(
            torch.zeros(shape, dtype=dtype, device=device) if need else None
            for (shape, dtype, device), need in zip(ctx.input_meta, ctx.needs_input_grad[2:])
        )
        return (None, None) + grads_in + (None,) * ctx.n_params


class _Recorder(TorchDispatchMode):
    """Sees every aten op of the step: FLOPs for the innermost module, storages for the log."""

    def __init__(self, step: "_Step"):
        super().__init__()
        self.step = step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        step = self.step
        if func.namespace != "prim":  # prim.device etc.: metadata queries, no kernel runs
            step.add_op()
        if func._overloadpacket in step.flops:
            step.add_flops(step.flops.count(func, args, kwargs, out))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                step.track(t)
        return out


class _Step:
    """One traced forward + loss + backward at one batch size."""

    def __init__(self, model: nn.Module, model_file: ModelFile, compute_dtype: torch.dtype,
                 hashes: dict[str, str], reuse: bool, flops: FlopCounter, banned: set[str] = frozenset()):
        self.model, self.mf, self.compute_dtype = model, model_file, compute_dtype
        self.hashes = hashes
        counts: dict[str, int] = defaultdict(int)
        for h in hashes.values():
            counts[h] += 1
        # Only modules with children are reused: a leaf runs one or two ops (nothing to save), and its
        # backward peak depends on how its input's gradient accumulates with its siblings'.
        self.twin_hashes = {h for h, n in counts.items() if n > 1} if reuse else set()
        self.banned = banned
        self.calls_by_fqn: dict[str, int] = defaultdict(int)
        self.leaves = {fqn for fqn, m in model.named_modules() if next(m.children(), None) is None}
        self.param_ids = {
            fqn: frozenset(id(p) for p in m.parameters()) for fqn, m in model.named_modules() if fqn not in self.leaves
        }
        self.attr_sigs = _attribute_signatures(model)
        self.flops = flops
        self.log: list[tuple] = []
        self._sids = WeakIdKeyDictionary()  # storage -> sid
        self._nbytes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._next_sid = 0
        self.static: set[int] = set()  # parameters and buffers
        self.saved: set[int] = set()
        # sid -> the first call that took the storage as an input (None: a batch tensor)
        self.input_owner: dict[int, _Call | None] = {}
        self.save_attempts: dict[int, list] = defaultdict(list)  # sid -> [(log pos, call, rel, counted, nbytes)]
        self.fwd_stack: list[_Call] = []
        self.bwd_stack: list[_Call] = []
        self.phase: str | None = None
        self.templates: dict[tuple, _Call] = {}
        self._twin_calls: list[_Call] = []
        self.closed = False
        self.in_twin = False  # inside _TwinFn.apply: its own saves are the template's, counted apart
        self.unattributed_flops = 0
        self.error_module: str | None = None
        self._stats: dict[int, tuple[int, int]] = {}

    # ---- storages ----
    def sid(self, t: torch.Tensor) -> int:
        st = t.untyped_storage()
        sid = self._sids.get(st)
        if sid is None:
            sid = self._next_sid
            self._next_sid += 1
            self._sids[st] = sid
            self._nbytes[sid] = st.nbytes()
            self._refs[sid] = weakref.ref(st, partial(self._freed, sid))
            self.log.append((_ALLOC, sid, self._nbytes[sid]))
        return sid

    def track(self, t: torch.Tensor) -> None:
        try:
            st = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse or other storage-less layouts
            return
        sid = self._sids.get(st)
        if sid is None:
            self.sid(t)
        else:
            self._maybe_resized(sid, st)

    def _maybe_resized(self, sid: int, st) -> None:
        nbytes = st.nbytes()
        if nbytes != self._nbytes[sid]:
            self.log.append((_RESIZE, sid, nbytes - self._nbytes[sid]))
            self._nbytes[sid] = nbytes

    def _freed(self, sid: int, _ref) -> None:
        if self.closed:
            return
        self._refs.pop(sid, None)
        self.log.append((_FREE, sid, -self._nbytes.pop(sid, 0)))

    def storage_bytes(self, tensors) -> int:
        seen, total = set(), 0
        for t in tensors:
            sid = self.sid(t)
            if sid not in seen and sid not in self.static:
                seen.add(sid)
                total += self._nbytes[sid]
        return total

    def register_static(self, t: torch.Tensor) -> None:
        self.static.add(self.sid(t))

    @contextmanager
    def _resize_tracking(self):
        """``UntypedStorage.resize_`` does not go through dispatch; patch it for the step (as MemTracker)."""
        orig = torch.UntypedStorage.resize_
        step = self

        def resize_(st, size):
            out = orig(st, size)
            sid = step._sids.get(st)
            if sid is not None:
                step._maybe_resized(sid, st)
            return out

        torch.UntypedStorage.resize_ = resize_
        try:
            yield
        finally:
            torch.UntypedStorage.resize_ = orig

    # ---- spans ----
    def _open(self, call: _Call, kind: str) -> _Span:
        span = _Span(call, kind, len(self.log))
        self.log.append((_ENTER, span))
        if kind == "fwd":
            call.fwd = span
            self.fwd_stack.append(call)
        else:
            call.bwd, call.bwd_open = span, True
            self.bwd_stack.append(call)
        return span

    def _close_fwd(self, call: _Call) -> None:
        call.fwd.end = len(self.log)
        self.log.append((_EXIT, call.fwd))
        self.fwd_stack.pop()

    def _close_bwd_top(self) -> None:
        call = self.bwd_stack.pop()
        call.bwd.end = len(self.log)
        call.bwd_open = False
        self.log.append((_EXIT, call.bwd))

    def add_op(self) -> None:
        """One aten op dispatched, for the innermost open call (like FLOPs; per-op overhead)."""
        if self.phase == "fwd" and self.fwd_stack:
            self.fwd_stack[-1].fwd_ops += 1
        elif self.phase == "bwd" and self.bwd_stack:
            self.bwd_stack[-1].bwd_ops += 1

    def add_flops(self, n: int) -> None:
        if self.phase == "fwd" and self.fwd_stack:
            self.fwd_stack[-1].fwd_flops += n
        elif self.phase == "bwd" and self.bwd_stack:
            self.bwd_stack[-1].bwd_flops += n
        else:
            self.unattributed_flops += n

    # ---- saved tensors ----
    def _pack(self, t: torch.Tensor):
        if self.phase == "fwd" and self.fwd_stack and not self.in_twin:
            try:
                st = t.untyped_storage()
            except (NotImplementedError, RuntimeError):
                return t
            sid = self._sids.get(st)
            if sid is None:  # made outside every op we saw (e.g. a plain tensor attribute): not an activation
                self.static.add(self.sid(t))
            elif sid not in self.static:
                self._note_save(sid, self._nbytes[sid], self.fwd_stack[-1])
        return t

    def _note_save(self, sid: int, nbytes: int, call: _Call) -> None:
        counted = sid not in self.saved
        self.save_attempts[sid].append((len(self.log), call, "", counted, nbytes))
        if counted:
            self.saved.add(sid)
            call.saved_bytes += nbytes

    # ---- module calls ----
    def wrap(self, module: nn.Module, fqn: str):
        orig = module.forward

        def forward(*args, **kwargs):
            return self._call_module(module, fqn, orig, args, kwargs)

        module.forward = forward

    def _call_module(self, module, fqn, orig, args, kwargs):
        parent = self.fwd_stack[-1] if self.fwd_stack else None
        call = _Call(fqn, parent)
        self.calls_by_fqn[fqn] += 1
        if parent is not None:
            parent.children.append(call)
        else:
            self.root_call = call
        leaves, spec = tree_flatten((args, kwargs))
        in_tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        call.input_bytes = self.storage_bytes(in_tensors)
        call.input_shared_bytes = self._shared_input_bytes(call, in_tensors)
        key = None
        if self.hashes.get(fqn) in self.twin_hashes and fqn != "" and fqn not in self.leaves:
            key = (self.hashes[fqn], self.attr_sigs[fqn], _signature(leaves, spec))
        template = self.templates.get(key) if key is not None and fqn not in self.banned else None
        if template is not None and (
            template.input_sids & {self.sid(t) for t in in_tensors if t.requires_grad}
            or template.param_ids & self.param_ids[fqn]
        ):
            # It shares an input that needs a gradient, or parameters (a module called twice, tied
            # weights), with its template: gradients accumulate across both, so their backward peaks
            # differ. Trace it for real.
            template = None
        self._open(call, "fwd")
        try:
            if template is not None:
                out = self._run_twin(call, template, module, in_tensors)
            else:
                if parent is None and self.compute_dtype is not None:  # FSDP2 cast_forward_inputs
                    leaves = [_cast(x, self.compute_dtype) for x in leaves]
                    args, kwargs = tree_unflatten(leaves, spec)
                out = orig(*args, **kwargs)
        except BaseException:
            if self.error_module is None:
                self.error_module = fqn
            raise
        finally:
            self._close_fwd(call)
        out_leaves, out_spec = tree_flatten(out)
        out_tensors = [x for x in out_leaves if isinstance(x, torch.Tensor)]
        call.output_bytes = self.storage_bytes(out_tensors)
        self._hook_backward(call, in_tensors, out_tensors)
        if key is not None and template is None and key not in self.templates and fqn not in self.banned:
            info = self._twin_info(call, in_tensors, out_leaves, out_spec)
            if info is not None:
                call.twin_info = info
                call.input_sids = frozenset(self.sid(t) for t in in_tensors)
                call.param_ids = self.param_ids[fqn]
                self.templates[key] = call
        return out

    def _shared_input_bytes(self, call: _Call, in_tensors) -> int:
        """Bytes of the call's input storages already held elsewhere (ModuleTrace.input_shared_bytes):
        batch tensors, and inputs of an earlier call that no ancestor of this one took as an input too
        (a storage an ancestor took is counted at the outermost call taking it; this keeps a twin's
        submodules, which copy their template's numbers, equal to a full trace's)."""
        sids = {self.sid(t): t for t in in_tensors}
        call.in_sids = frozenset(sids)
        shared = []
        for sid, t in sids.items():
            if sid not in self.input_owner:
                self.input_owner[sid] = call
            elif self.input_owner[sid] is None:
                shared.append(t)
            else:
                a = call.parent
                while a is not None and sid not in a.in_sids:
                    a = a.parent
                if a is None:
                    shared.append(t)
        return self.storage_bytes(shared)

    def _hook_backward(self, call: _Call, in_tensors, out_tensors) -> None:
        outs = [t for t in out_tensors if t.requires_grad]
        if outs:
            register_multi_grad_hook(outs, partial(self._pre_backward, call), mode="any")
        ins = [t for t in in_tensors if t.requires_grad]
        if ins:
            register_multi_grad_hook(ins, partial(self._post_backward, call))

    def _pre_backward(self, call: _Call, _grads) -> None:
        if call.bwd is not None:
            return
        stack = self.bwd_stack
        k = len(stack)
        while k > 0 and _is_ancestor(call, stack[k - 1]):
            k -= 1
        inner = stack[k:]
        if inner and all(ev[0] == _ENTER for ev in self.log[inner[0].bwd.start :]):
            # A parent and its child share this output tensor; the child's hook, registered first, ran
            # first. Open the parent where the child opened, so that spans nest in the log.
            pos = inner[0].bwd.start
            del stack[k:]
            span = _Span(call, "bwd", pos)
            self.log.insert(pos, (_ENTER, span))
            for c in inner:
                c.bwd.start += 1
            call.bwd, call.bwd_open = span, True
            stack.append(call)
            stack.extend(inner)
            return
        while stack and not _is_ancestor(stack[-1], call):
            self._close_bwd_top()
        self._open(call, "bwd")

    def _post_backward(self, call: _Call, _grads) -> None:
        if not call.bwd_open:
            return
        while self.bwd_stack:
            top = self.bwd_stack[-1]
            self._close_bwd_top()
            if top is call:
                break

    # ---- twins (see [Note: twins]) ----
    def _twin_info(self, call: _Call, in_tensors, out_leaves, out_spec) -> _TwinInfo | None:
        if not _calls_under(call, call.fqn):  # a shared module from elsewhere ran inside: fqns do not remap
            return None
        start, end = call.fwd.start, call.fwd.end
        input_saves = []
        for i, t in enumerate(in_tensors):
            first = self._first_save_within(self.sid(t), start, end)
            if first is not None:
                _pos, saver, rel, counted, nbytes = first
                input_saves.append((i, _join(_rel(saver.fqn, call.fqn), rel), counted, nbytes))
        groups: dict[int, int] = {}
        values, output_saves, k = [], [], 0
        in_sids = {self.sid(t) for t in in_tensors}
        for v in out_leaves:
            if not isinstance(v, torch.Tensor):
                values.append(v)
                continue
            sid = self.sid(v)
            group = groups.setdefault(sid, len(groups))
            values.append(_OutLeaf(tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype, v.device,
                                   v.requires_grad, group, self._nbytes[sid]))
            first = self._first_save_within(sid, start, end)
            if first is not None and sid not in in_sids and first[3]:
                output_saves.append((k, _join(_rel(first[1].fqn, call.fqn), first[2])))
            k += 1
        return _TwinInfo(out_spec, tuple(values), tuple(input_saves), tuple(output_saves))

    def _first_save_within(self, sid: int, start: int, end: int):
        for attempt in self.save_attempts.get(sid, ()):
            if start < attempt[0] < end:
                return attempt
        return None

    def _run_twin(self, call: _Call, template: _Call, module: nn.Module, in_tensors):
        call.template = template
        self._twin_calls.append(call)
        info = template.twin_info
        params = [p for p in module.parameters() if p.requires_grad][:1]  # one is enough to require grad
        self.in_twin = True
        try:
            outs = _TwinFn.apply(info, len(in_tensors), *in_tensors, *params)
        finally:
            self.in_twin = False
        outs = list(outs) if isinstance(outs, tuple) else [outs]
        for i, rel, counted_in_template, nbytes in info.input_saves:
            sid = self.sid(in_tensors[i])
            counted = sid not in self.saved
            self.saved.add(sid)
            self.save_attempts[sid].append((len(self.log), call, rel, counted, self._nbytes[sid]))
            if counted_in_template and not counted:  # the template counted it; here it was saved already
                call.save_adjust.append((rel, -nbytes))
            elif counted and not counted_in_template:  # the template found it saved already; here it is new
                call.save_adjust.append((rel, self._nbytes[sid]))
        for k, rel in info.output_saves:
            sid = self.sid(outs[k])
            self.saved.add(sid)
            self.save_attempts[sid].append((len(self.log), call, rel, True, self._nbytes[sid]))
        it = iter(outs)
        leaves = [next(it) if isinstance(v, _OutLeaf) else v for v in info.out_values]
        return tree_unflatten(leaves, info.out_spec)

    # ---- the step ----
    def run(self, inputs: tuple, targets) -> None:
        for module in self.model.modules():
            for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                self.register_static(t)
        batch_tensors = list(inputs) + [targets]
        self.batch_input_bytes = self.storage_bytes(batch_tensors)
        for t in batch_tensors:
            if isinstance(t, torch.Tensor):
                self.input_owner[self.sid(t)] = None
        self.loss_call = _Call(None, None)
        path = self.mf.path
        with self._resize_tracking(), _Recorder(self), saved_tensors_hooks(self._pack, lambda t: t):
            self.phase = "fwd"
            try:
                out = self.model(*inputs)
            except ModelFileError:
                raise
            except Exception as exc:
                where = f" in module {self.error_module!r}" if self.error_module else ""
                raise ModelFileError(
                    f"{path}: the model's forward raised {type(exc).__name__}{where}: {_first_line(exc)}"
                ) from exc
            self._open(self.loss_call, "fwd")
            try:
                loss = self.mf.loss(out, targets)
            finally:
                self._close_fwd(self.loss_call)
            del out
            self.phase = "bwd"
            self._open(self.loss_call, "bwd")
            try:
                loss.backward()
            except Exception as exc:
                raise ModelFileError(f"{path}: the backward raised {type(exc).__name__}: {_first_line(exc)}") from exc
            while self.bwd_stack:
                self._close_bwd_top()
            del loss
            self.phase = None
        for p in self.model.parameters():
            if p.grad is not None:
                self.static.add(self.sid(p.grad))  # parameter gradients: not activations
        self.closed = True
        if self.unattributed_flops:
            logger.debug("%d FLOPs ran outside every module and the loss", self.unattributed_flops)

    def tainted_templates(self) -> set[str]:
        """Templates and twins whose subtree ran more than once (a shared module): its parameter
        gradients accumulate across calls, so a twin would not match the real run. They are traced for
        real on a second try."""
        shared = {fqn for fqn, n in self.calls_by_fqn.items() if n > 1}

        def runs_shared(fqn: str) -> bool:
            return any(_under(s, fqn) for s in shared)

        out = {c.fqn for c in self._twin_calls if runs_shared(c.fqn)}
        out |= {c.template.fqn for c in self._twin_calls if runs_shared(c.template.fqn)}
        return out

    # ---- post-processing ----
    def span_stats(self, span: _Span | None) -> tuple[int, int]:
        """(peak rise above the level at entry, net change) of live non-parameter bytes over a span."""
        if span is None:
            return 0, 0
        if span.call.template is not None:  # a twin counts as its template
            t = span.call.template
            return self.span_stats(t.fwd if span.kind == "fwd" else t.bwd)
        return self._replay(span.start + 1, span.end)

    def _replay(self, start: int, end: int) -> tuple[int, int]:
        key = (start, end)
        if key in self._stats:
            return self._stats[key]
        log, static = self.log, self.static
        level = peak = 0
        i = start
        while i < end:
            ev = log[i]
            kind = ev[0]
            if kind == _ENTER:
                inner = ev[1]
                if inner.call.template is not None and inner.end > 0:
                    rise, net = self.span_stats(inner)
                    peak = max(peak, level + rise)
                    level += net
                    i = inner.end + 1
                    continue
            elif kind != _EXIT and ev[1] not in static:
                level += ev[2]
                if level > peak:
                    peak = level
            i += 1
        self._stats[key] = (peak, level)
        return peak, level

    def records(self, call: _Call, memo: dict) -> list[_Rec]:
        """The call's numbers and its subtree's, per module (twins expanded from their templates)."""
        cached = memo.get(id(call))
        if cached is not None:
            return cached
        if call.template is None:
            own = _Rec(
                call.fqn, calls=1, saved=call.saved_bytes, fwd_flops=call.fwd_flops, bwd_flops=call.bwd_flops,
                input_bytes=call.input_bytes, output_bytes=call.output_bytes,
                fwd_rise=self.span_stats(call.fwd)[0], bwd_rise=self.span_stats(call.bwd)[0],
                fwd_key=(call.fwd.start,), bwd_key=(call.bwd.start,) if call.bwd is not None else None,
                fwd_ops=call.fwd_ops, bwd_ops=call.bwd_ops, input_shared_bytes=call.input_shared_bytes,
            )
            out = [own]
            for child in call.children:
                out.extend(self.records(child, memo))
        else:
            t = call.template
            out = []
            for r in self.records(t, memo):
                out.append(_Rec(
                    _join(call.fqn, _rel(r.fqn, t.fqn)), r.calls, r.saved, r.fwd_flops, r.bwd_flops,
                    call.input_bytes if r.fqn == t.fqn else r.input_bytes, r.output_bytes,
                    r.fwd_rise, r.bwd_rise,
                    (call.fwd.start,) + r.fwd_key if r.fwd_key is not None else None,
                    (call.bwd.start,) + r.bwd_key if call.bwd is not None and r.bwd_key is not None else None,
                    r.fwd_ops, r.bwd_ops,
                    call.input_shared_bytes if r.fqn == t.fqn else r.input_shared_bytes,
                ))
        for rel, nbytes in call.save_adjust:
            out.append(_Rec(_join(call.fqn, rel), saved=nbytes))
        memo[id(call)] = out
        return out

    def result(self) -> _StepResult:
        memo: dict = {}
        per_module: dict[str, _Rec] = {}
        for r in self.records(self.root_call, memo):
            agg = per_module.setdefault(r.fqn, _Rec(r.fqn))
            agg.calls += r.calls
            agg.saved += r.saved
            agg.fwd_flops += r.fwd_flops
            agg.bwd_flops += r.bwd_flops
            agg.fwd_ops += r.fwd_ops
            agg.bwd_ops += r.bwd_ops
            agg.input_bytes += r.input_bytes
            agg.input_shared_bytes += r.input_shared_bytes
            agg.output_bytes += r.output_bytes
            agg.fwd_rise = max(agg.fwd_rise, r.fwd_rise)
            agg.bwd_rise = max(agg.bwd_rise, r.bwd_rise)
            if r.fwd_key is not None and (agg.fwd_key is None or r.fwd_key < agg.fwd_key):
                agg.fwd_key = r.fwd_key
            if r.bwd_key is not None and (agg.bwd_key is None or r.bwd_key < agg.bwd_key):
                agg.bwd_key = r.bwd_key
        forward_order = tuple(r.fqn for r in sorted((r for r in per_module.values() if r.fwd_key), key=lambda r: r.fwd_key))
        backward_order = tuple(r.fqn for r in sorted((r for r in per_module.values() if r.bwd_key), key=lambda r: r.bwd_key))
        reused = sum(1 for r in per_module.values() if r.fwd_key is not None and len(r.fwd_key) > 1)
        loss = self.loss_call
        loss_rise = self._replay(loss.fwd.start + 1, loss.bwd.end)[0] if loss.bwd is not None else self.span_stats(loss.fwd)[0]
        return _StepResult(
            per_module=per_module,
            forward_order=forward_order,
            backward_order=backward_order,
            batch_input_bytes=self.batch_input_bytes,
            loss_saved_bytes=loss.saved_bytes,
            loss_peak_rise_bytes=loss_rise,
            loss_flops=loss.fwd_flops + loss.bwd_flops,
            reused_modules=reused,
            loss_ops=loss.fwd_ops + loss.bwd_ops,
        )


def _signature(leaves, spec) -> tuple:
    sig = [str(spec), torch.is_grad_enabled()]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            sig.append((tuple(x.shape), tuple(x.stride()), x.dtype, x.requires_grad, x.device.type))
        else:
            try:
                hash(x)
                sig.append(("v", type(x).__name__, x))
            except TypeError:
                sig.append(("r", repr(x)))
    return tuple(sig)


def _attribute_signatures(model: nn.Module) -> dict[str, tuple]:
    """fqn -> the plain attributes (numbers, strings, flags) of every module in its subtree.

    Structural hashes see classes, parameters and buffers only; two attention modules that differ in
    ``is_causal`` or a dropout rate have the same hash but are not twins.
    """
    sigs: dict[str, tuple] = {}

    def visit(fqn: str, module: nn.Module) -> tuple:
        own = tuple(sorted(
            (k, v) for k, v in vars(module).items()
            if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None)))
        ))
        kids = tuple((name, visit(_join(fqn, name), child)) for name, child in module.named_children())
        sigs[fqn] = (own, kids)
        return sigs[fqn]

    visit("", model)
    return sigs


def _cast(x, dtype: torch.dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x


def _is_ancestor(a: _Call, call: _Call) -> bool:
    c = call.parent
    while c is not None:
        if c is a:
            return True
        c = c.parent
    return False


def _calls_under(call: _Call, base: str) -> bool:
    return all(c.fqn is not None and _under(c.fqn, base) and _calls_under(c, base) for c in call.children)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


@contextmanager
def _quiet_fake_tensor_logger():
    """FakeTensorMode logs a whole traceback on a shape error; the error reaches the user as one line."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    old = log.level
    if not logging.getLogger("shard_planner").isEnabledFor(logging.DEBUG):
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(old)


# ---------------------------------------------------------------------------------------------------
# The stage


def trace_model(
    model_file: ModelFile | str,
    *,
    batch_sizes: tuple[int, int] = (1, 2),
    dtype: str = "bfloat16",
    reuse: bool = True,
) -> ModelTrace:
    """Trace ``model_file`` (a ModelFile or its path) at two micro-batch sizes, without real memory.

    ``dtype`` is the compute dtype (``"bfloat16"``/``"bf16"`` or ``"float32"``/``"fp32"``): floating
    parameters are cast to it as FSDP2's mixed precision does. ``reuse=False`` traces every repeated
    block for real (for checking the reuse; see [Note: twins]).
    """
    started = time.perf_counter()
    mf = load_model_file(model_file) if isinstance(model_file, (str, Path)) else model_file
    dtype_name = compute_dtype_name(dtype)
    compute = getattr(torch, dtype_name)
    b1, b2 = (int(b) for b in batch_sizes)
    if b1 < 1 or b2 < 1 or b1 == b2:
        raise UserError(f"batch_sizes must be two different positive sizes, got {tuple(batch_sizes)}")
    with _quiet_fake_tensor_logger():
        # Tensors a model file made at import time, outside the mode, are converted when first used.
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with fake_mode:
            model = mf.build()
        modules = list(model.named_modules())
        static = _static_facts(model, modules)
        hashes = structural_hashes(model)
        fingerprint = model_fingerprint(model)
        with fake_mode:
            for p in model.parameters():
                if p.is_floating_point() and p.dtype != compute:
                    p.data = p.data.to(compute)
        flops = FlopCounter()
        results = []
        try:
            banned: set[str] = set()  # modules that turned out not to be faithful templates
            for b in (b1, b2):
                while True:
                    with fake_mode:
                        inputs, targets = mf.batch(b)
                    step = _Step(model, mf, compute, hashes, reuse, flops, banned)
                    for fqn, module in modules:
                        step.wrap(module, fqn)
                    with fake_mode:
                        step.run(inputs, targets)
                    del inputs, targets
                    for p in model.parameters():
                        p.grad = None
                    _unwrap(modules)
                    tainted = step.tainted_templates()
                    if not tainted:
                        break
                    logger.debug("re-tracing batch %d without templates %s (shared modules)", b, sorted(tainted))
                    banned |= tainted
                results.append(step.result())
        finally:
            _unwrap(modules)
    r1, r2 = results
    if r1.forward_order != r2.forward_order:
        logger.warning("forward order differs between batch sizes %d and %d; using %d's", b1, b2, b1)

    def fit(get) -> Affine:
        return Affine.fit(b1, float(get(r1)), b2, float(get(r2)))

    module_traces = []
    for fqn, module in modules:
        rec1, rec2 = r1.per_module.get(fqn), r2.per_module.get(fqn)

        def field(name, rec1=rec1, rec2=rec2):
            return Affine.fit(b1, float(getattr(rec1, name) if rec1 else 0), b2, float(getattr(rec2, name) if rec2 else 0))

        children = tuple(_join(fqn, name) for name, _ in module.named_children())
        module_traces.append(ModuleTrace(
            fqn=fqn,
            type_name=type(module).__name__,
            parent=None if fqn == "" else fqn.rpartition(".")[0],
            children=tuple(c for c in children if c in static["fqns"]),
            structural_hash=hashes[fqn],
            param_count=static["param_count"][fqn],
            param_bytes_by_dtype=static["param_bytes"][fqn],
            buffer_bytes=static["buffer_bytes"][fqn],
            calls=rec1.calls if rec1 else 0,
            input_bytes=field("input_bytes"),
            input_shared_bytes=field("input_shared_bytes"),
            output_bytes=field("output_bytes"),
            saved_bytes_self=field("saved"),
            fwd_flops_self=field("fwd_flops"),
            bwd_flops_self=field("bwd_flops"),
            fwd_peak_rise_bytes=field("fwd_rise"),
            bwd_peak_rise_bytes=field("bwd_rise"),
            param_tensors=static["param_tensors"][fqn],
            tied_with=static["tied_with"][fqn],
            fwd_ops_self=rec1.fwd_ops if rec1 else 0,  # op counts do not depend on the batch size
            bwd_ops_self=rec1.bwd_ops if rec1 else 0,
        ))
    seq_len = mf.training.get("seq_len")
    return ModelTrace(
        model_path=str(mf.path),
        model_class=type(model).__name__,
        compute_dtype=dtype_name,
        batch_sizes=(b1, b2),
        tokens_per_sample=int(seq_len) if seq_len is not None else None,
        modules=tuple(module_traces),
        forward_order=r1.forward_order,
        backward_order=r1.backward_order,
        batch_input_bytes=fit(lambda r: r.batch_input_bytes),
        loss_saved_bytes=fit(lambda r: r.loss_saved_bytes),
        loss_peak_rise_bytes=fit(lambda r: r.loss_peak_rise_bytes),
        loss_flops=fit(lambda r: r.loss_flops),
        fingerprint=fingerprint,
        trace_seconds=time.perf_counter() - started,
        reused_modules=r1.reused_modules,
        loss_ops=r1.loss_ops,
    )


def _unwrap(modules) -> None:
    for _fqn, module in modules:
        module.__dict__.pop("forward", None)


def _static_facts(model: nn.Module, modules) -> dict:
    """Parameter counts and bytes (a shared parameter at its first module), buffer bytes, as built."""
    seen: set[int] = set()
    param_count, param_bytes, buffer_bytes, param_tensors = {}, {}, {}, {}
    owners: dict[int, list[str]] = {}  # id of a Parameter -> modules registering it directly
    for fqn, module in modules:
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(fqn)
    tied_with = {fqn: tuple(sorted({o for p in module.parameters(recurse=False) for o in owners[id(p)]} - {fqn}))
                 for fqn, module in modules}
    for fqn, module in modules:
        count, by_dtype, tensors = 0, {}, 0
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            count += p.numel()
            tensors += 1
            name = str(p.dtype).removeprefix("torch.")
            by_dtype[name] = by_dtype.get(name, 0) + p.numel() * p.element_size()
        param_count[fqn], param_bytes[fqn], param_tensors[fqn] = count, by_dtype, tensors
        buffer_bytes[fqn] = sum(b.numel() * b.element_size() for b in module.buffers(recurse=False))
    return {"fqns": {fqn for fqn, _ in modules}, "param_count": param_count, "param_bytes": param_bytes,
            "buffer_bytes": buffer_bytes, "param_tensors": param_tensors, "tied_with": tied_with}


# ---------------------------------------------------------------------------------------------------
# Checking a trace against a real run


@dataclass(frozen=True)
class Difference:
    """A traced quantity that a real CPU step does not reproduce (module ``fqn``; ``"<loss>"``: the loss)."""

    fqn: str
    quantity: str  # a ModuleTrace field ("saved_bytes_self", ...) or a ModelTrace loss_* field
    traced: float
    real: float


# ModuleTrace field -> the per-call record attribute it is fitted from
_CHECKED = (
    ("saved_bytes_self", "saved"), ("output_bytes", "output_bytes"), ("fwd_flops_self", "fwd_flops"),
    ("bwd_flops_self", "bwd_flops"), ("fwd_peak_rise_bytes", "fwd_rise"), ("bwd_peak_rise_bytes", "bwd_rise"),
)


def compare_with_real_run(
    model_file: ModelFile | str, trace: ModelTrace, *, batch_size: int = 1, rel_tol: float = 0.02
) -> tuple[Difference, ...]:
    """Run one real step on the CPU with the same instruments and list where the fake trace differs.

    This builds the model for real (small configurations only). Code that branches on being traced
    (DESIGN.md, "FSDP2 facts": transformers' Llama materialises a causal mask under fake tensors), or a
    kernel that fake mode picks differently, shows up here as a difference.
    """
    mf = load_model_file(model_file) if isinstance(model_file, (str, Path)) else model_file
    compute = getattr(torch, trace.compute_dtype)
    torch.manual_seed(0)
    model = mf.build()
    if model_fingerprint(model) != trace.fingerprint:
        raise UserError(f"{mf.path}: the model it builds is not the one traced in the trace (fingerprints differ)")
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != compute:
            p.data = p.data.to(compute)
    inputs, targets = mf.batch(batch_size)
    modules = list(model.named_modules())
    step = _Step(model, mf, compute, structural_hashes(model), False, FlopCounter())
    for fqn, module in modules:
        step.wrap(module, fqn)
    try:
        step.run(inputs, targets)
    finally:
        _unwrap(modules)
    real = step.result()
    diffs = []

    def check(fqn: str, quantity: str, traced: float, measured: float) -> None:
        if abs(traced - measured) > rel_tol * abs(measured) + 0.5:
            diffs.append(Difference(fqn, quantity, traced, float(measured)))

    for m in trace.modules:
        rec = real.per_module.get(m.fqn)
        for name, attr in _CHECKED:
            check(m.fqn, name, getattr(m, name).at(batch_size), getattr(rec, attr) if rec else 0)
    check("<loss>", "loss_saved_bytes", trace.loss_saved_bytes.at(batch_size), real.loss_saved_bytes)
    check("<loss>", "loss_flops", trace.loss_flops.at(batch_size), real.loss_flops)
    check("<loss>", "loss_peak_rise_bytes", trace.loss_peak_rise_bytes.at(batch_size), real.loss_peak_rise_bytes)
    return tuple(diffs)


# ---------------------------------------------------------------------------------------------------
# Trace files


def load_trace(path: str | Path) -> ModelTrace:
    """Read a trace.json written by ``shard-planner trace``; UserError in one line if it is not one."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise UserError(f"{path}: cannot read trace file ({exc.strerror or exc})") from exc
    try:
        return ModelTrace.from_json(text)
    except UserError as exc:
        raise UserError(f"{path}: {exc}") from exc
    except (json.JSONDecodeError, TypeError, KeyError, ValueError, AttributeError) as exc:
        raise UserError(f"{path}: not a shard-planner trace file ({type(exc).__name__}: {_first_line(exc)})") from exc


def trace_or_load(
    path: str | Path, *, batch_sizes: tuple[int, int] = (1, 2), dtype: str = "bfloat16"
) -> ModelTrace:
    """A trace.json is loaded (its dtype must match ``dtype``); anything else is a model file to trace."""
    if str(path).endswith(".json"):
        trace = load_trace(path)
        want = compute_dtype_name(dtype)
        if trace.compute_dtype != want:
            raise UserError(
                f"{path}: traced in {trace.compute_dtype}, but {want} was asked for: re-run shard-planner trace --dtype"
            )
        return trace
    return trace_model(str(path), batch_sizes=batch_sizes, dtype=dtype)
