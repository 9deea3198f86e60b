"""Capture: one forward + loss + backward, recorded per module call into the step's event log.

- Every module's ``forward`` is wrapped for the step (:meth:`Step.wrap`). Each call of a module is a
  :class:`~shard_planner.trace.records.Call` with a forward span and, once a gradient for one of its
  outputs arrives (``register_multi_grad_hook(outputs, mode="any")``), a backward span that ends when
  the gradients of its inputs are ready (``register_multi_grad_hook(inputs)``) or when the backward of
  a module outside it begins (a module whose inputs need no gradient, e.g. an embedding, never gets
  the second hook).
- A :class:`TorchDispatchMode` (:class:`Recorder`) sees every aten op; :meth:`Step.record_op` is the
  one place that records an op: it counts it and its FLOPs (FlopCounterMode's formulas,
  ``trace/flops.py``) for the innermost open call and logs the storages of its outputs
  (``trace/storages.py``). Span entries and exits go into the same log.
- ``saved_tensors_hooks`` see every tensor saved for backward: deduplicated by storage, attributed to
  the innermost module active when first saved; parameters, buffers and views of them are not
  activations.
- Repeated blocks are not run but stand in for a template (``trace/twins.py``, [Note: twins]).
- After the backward, parameter gradients become static (not activations); ``trace/replay.py`` turns
  the log into per-module numbers.

The loss (``loss_*``) is its own call (``fqn is None``): saved tensors of ``loss_fn``, and its span from
the loss's forward until the model's backward ends.

[Note: Early stop of the recomputation] Non-reentrant activation checkpointing (torch/utils/checkpoint.py,
``use_reentrant=False``, what the executor applies: execute/apply.py) stops recomputing a region as soon as
every tensor its forward saved for backward has been saved again (``_StopRecomputationError``; on by
default, ``set_checkpoint_early_stop``). Autograd saves an op's inputs before the op runs and its
outputs after (the generated VariableType kernels build ``SavedVariable`` for inputs before the
redispatch), so the recomputation never runs the ops after the last save: in a pre-norm transformer block
the MLP's down projection (its saves are its input and weight) and the residual add. Measured (torch
2.13, CPU): a checkpointed LayerNorm -> Linear -> GELU -> Linear + residual recomputes layer_norm, addmm,
gelu and not the second addmm or the add; on one H200 (torch 2.11) full checkpointing added 3.9 ms per
block of MPT-1B at micro-batch 14 x 2048 where its whole forward is priced 5.6 ms and the forward less
its down projection 4.1 ms (benchmarks/data/h200_2026-12-04). So every call's ``fwd_tail`` holds its
subtree's forward kernels since the last ``saved_tensors_hooks`` pack inside it (every pack counts,
parameters too); cost/selective.py prices a fully checkpointed unit's recomputation without them.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from functools import partial

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook, saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from shard_planner.errors import ModelFileError, first_line
from shard_planner.model.modelfile import ModelFile, input_tensors
from shard_planner.trace.cache import output_cache
from shard_planner.trace.flops import FlopCounter
from shard_planner.trace.kernel_ops import classify
from shard_planner.trace.grad_hooks import register_all_grads_hook
from shard_planner.trace.records import ENTER, EXIT, Call, Span, is_ancestor
from shard_planner.trace.routing import KnownValues
from shard_planner.trace.storages import SavedTensors, StorageLog
from shard_planner.trace.tp_local import RankEmulation
from shard_planner.trace.twins import OutLeaf, ReuseFacts, Twins, run_twin, twin_info

logger = logging.getLogger(__name__)


class Recorder(TorchDispatchMode):
    """Sees every aten op of the step and hands it to :meth:`Step.record_op`."""

    def __init__(self, step: Step):
        super().__init__()
        self.step = step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self.step.known.dispatch(func, args, kwargs)  # func, with [Note: balanced routing]
        self.step.note_write(func, args)
        self.step.record_op(func, args, kwargs, out)
        return out


class Step:
    """One traced forward + loss + backward at one batch size."""

    def __init__(self, model: nn.Module, model_file: ModelFile, compute_dtype: torch.dtype,
                 reuse: ReuseFacts, flops: FlopCounter, banned: set[str] = frozenset(),
                 tp: RankEmulation | None = None):
        self.model, self.mf, self.compute_dtype = model, model_file, compute_dtype
        self.tp = tp  # one tensor-parallel rank: trace/tp_local.py [Note: A tensor-parallel rank traced locally]
        self.flops = flops
        self.log = StorageLog()
        self.saves = SavedTensors()
        self.twins = Twins(reuse, banned)
        self.known = KnownValues()  # MoE routing under fake tensors: [Note: balanced routing]
        self.calls_by_fqn: dict[str, int] = defaultdict(int)
        # sid -> the first call that took the storage as an input (None: a batch tensor)
        self.input_owner: dict[int, Call | None] = {}
        self.fwd_stack: list[Call] = []
        self.bwd_stack: list[Call] = []
        self.phase: str | None = None
        self.in_twin = False  # inside TwinFn.apply: its own saves are the template's, counted apart
        self.unattributed_flops = 0
        self.error_module: str | None = None
        self.root_call: Call | None = None
        self.loss_call = Call(None, None)
        self.batch_input_bytes = 0
        self.forward_cache: str | None = None  # [Note: A forward that builds a cache]
        self.output_sids: frozenset[int] = frozenset()  # the output's tensors' storages (trace/held.py)
        self.producer: dict[int, tuple[str, int]] = {}  # sid -> (kernel class, log position) of a forward op's new output

    # ---- ops: the one place an aten op is recorded ----
    def record_op(self, func, args, kwargs, out) -> None:
        """Count the op, its FLOPs and its kernel ([Note: kernel records]) for the innermost open call;
        log the storages of its outputs."""
        if func.namespace != "prim":  # prim.device etc.: metadata queries, no kernel runs
            self._add_op()
        n = self.flops.count(func, args, kwargs, out) if func._overloadpacket in self.flops else 0
        if n:
            self._add_flops(n)
        outs = (out,) if isinstance(out, torch.Tensor) else [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        new_bytes = self._new_storage_bytes(outs) if self.phase == "fwd" else 0
        sample = classify(func, args, kwargs, out, n, new_bytes)
        if sample is not None:
            self._add_kernel(sample)
        for t in outs:
            self.log.track(t)
        if self.tp is not None and self._in_loss():  # loss parallelism's collectives and transients
            self.tp.loss_op(func, args, out, self.phase, self.loss_call.tp_collectives, self.log)
        if new_bytes and sample is not None:
            pos = len(self.log.events)
            for t in outs:
                self.producer.setdefault(self.log.sid(t), (sample.op_class, pos))

    def _in_loss(self) -> bool:
        stack = self.fwd_stack if self.phase == "fwd" else self.bwd_stack
        return bool(stack) and stack[-1] is self.loss_call

    def _new_storage_bytes(self, outs) -> int:
        """Bytes of the distinct storages among ``outs`` the log has not seen yet (an op's new outputs)."""
        seen, total = set(), 0
        for t in outs:
            try:
                st = t.untyped_storage()
            except (NotImplementedError, RuntimeError):
                continue
            if self.log.known_sid(st) is None and id(st) not in seen:
                seen.add(id(st))
                total += st.nbytes()
        return total

    def note_write(self, func, args) -> None:
        """An in-place op of the forward that writes a twin's output makes that twin unsafe ([Note: unsafe reuse])."""
        if self.twins.out_sids and self.phase == "fwd" and _writes_first_argument(func):
            t = args[0]
            if isinstance(t, torch.Tensor):
                self.twins.note_write(self.log.known_sid(t.untyped_storage()))

    def _add_op(self) -> None:
        if self.phase == "fwd" and self.fwd_stack:
            self.fwd_stack[-1].fwd_ops += 1
        elif self.phase == "bwd" and self.bwd_stack:
            self.bwd_stack[-1].bwd_ops += 1

    def _add_kernel(self, sample) -> None:
        if self.phase == "fwd" and self.fwd_stack:
            self.fwd_stack[-1].fwd_kernels.append(sample)
            for call in self.fwd_stack:  # [Note: Early stop of the recomputation]
                call.fwd_tail.append(sample)
        elif self.phase == "bwd" and self.bwd_stack:
            self.bwd_stack[-1].bwd_kernels.append(sample)

    def _add_flops(self, n: int) -> None:
        if self.phase == "fwd" and self.fwd_stack:
            self.fwd_stack[-1].fwd_flops += n
        elif self.phase == "bwd" and self.bwd_stack:
            self.bwd_stack[-1].bwd_flops += n
        else:
            self.unattributed_flops += n

    # ---- spans ----
    def _open(self, call: Call, kind: str) -> Span:
        events = self.log.events
        span = Span(call, kind, len(events))
        events.append((ENTER, span))
        if kind == "fwd":
            call.fwd = span
            self.fwd_stack.append(call)
        else:
            call.bwd, call.bwd_open = span, True
            self.bwd_stack.append(call)
        return span

    def _close_fwd(self, call: Call) -> None:
        call.fwd.end = len(self.log.events)
        self.log.events.append((EXIT, call.fwd))
        self.fwd_stack.pop()

    def _close_bwd_top(self) -> None:
        call = self.bwd_stack.pop()
        call.bwd.end = len(self.log.events)
        call.bwd_open = False
        self.log.events.append((EXIT, call.bwd))

    # ---- saved tensors ----
    def _pack(self, t: torch.Tensor):
        if self.phase == "fwd":  # any saved tensor, parameters too: the recomputation runs to here
            for call in self.fwd_stack:
                call.fwd_tail.clear()
        if self.phase == "fwd" and self.fwd_stack and not self.in_twin:
            try:
                st = t.untyped_storage()
            except (NotImplementedError, RuntimeError):
                return t
            sid = self.log.known_sid(st)
            if sid is None:  # made outside every op we saw (e.g. a plain tensor attribute): not an activation
                self.log.register_static(t)
            elif sid not in self.log.static:
                call = self.fwd_stack[-1]
                nbytes = self.log.nbytes[sid]
                if self.saves.note(len(self.log.events), sid, nbytes, call):
                    call.saved_bytes += nbytes
        return t

    # ---- module calls ----
    def wrap(self, module: nn.Module, fqn: str) -> None:
        orig = module.forward

        def forward(*args, **kwargs):
            return self._call_module(module, fqn, orig, args, kwargs)

        module.forward = forward

    def _call_module(self, module, fqn, orig, args, kwargs):
        parent = self.fwd_stack[-1] if self.fwd_stack else None
        call = Call(fqn, parent)
        self.calls_by_fqn[fqn] += 1
        if parent is not None:
            parent.children.append(call)
        else:
            self.root_call = call
        if self.tp is not None:  # where torch's style hooks run: outside the module's forward
            args, kwargs = self.tp.before(call, module, args, kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        in_tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        call.input_bytes = self.log.storage_bytes(in_tensors)
        call.input_shared_bytes = self._shared_input_bytes(call, in_tensors)
        key = self.twins.key(fqn, leaves, spec)
        template = self.twins.template_for(
            key, fqn, lambda: {self.log.sid(t) for t in in_tensors if t.requires_grad}
        )
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
        if self.tp is not None:
            out = self.tp.after(call, out)
        out_leaves, out_spec = tree_flatten(out)
        out_tensors = [x for x in out_leaves if isinstance(x, torch.Tensor)]
        call.output_bytes = self.log.storage_bytes(out_tensors)
        call.output_by_class = self._output_by_class(call, out_tensors)
        self._hook_backward(call, in_tensors, out_tensors)
        if template is None and self.twins.may_remember(key, fqn):
            info = twin_info(self.log, self.saves, call, in_tensors, out_leaves, out_spec,
                             lambda sid: self._made_in(call, sid))
            if info is not None:
                self.twins.remember(key, call, info, frozenset(self.log.sid(t) for t in in_tensors))
        return out

    def _output_by_class(self, call: Call, out_tensors) -> dict[str, int]:
        """Bytes of the call's distinct output storages an op inside its forward allocated, by class."""
        out: dict[str, int] = {}
        for sid in {self.log.sid(t) for t in out_tensors}:
            made = self._made_in(call, sid)
            if made is not None:
                out[made] = out.get(made, 0) + self.log.nbytes[sid]
        return out

    def _made_in(self, call: Call, sid: int) -> str | None:
        """The kernel class of the op inside ``call``'s forward that allocated storage ``sid``, or None."""
        made = self.producer.get(sid)
        if made is not None and made[1] >= call.fwd.start and sid not in self.log.static:
            return made[0]
        return None

    def _run_twin(self, call: Call, template: Call, module: nn.Module, in_tensors):
        call.template = template
        self.twins.calls.append(call)
        params = [p for p in module.parameters() if p.requires_grad][:1]  # one is enough to require grad
        self.in_twin = True
        try:
            out = run_twin(self.log, self.saves, call, template.twin_info, params, in_tensors)
        finally:
            self.in_twin = False
        for c in self.fwd_stack:  # its saves cleared their tails (if the template saved): the template's tail runs after
            c.fwd_tail.extend(template.fwd_tail)
        pos = len(self.log.events)
        for leaf, t in zip(template.twin_info.out_values, tree_leaves(out)):
            if isinstance(leaf, OutLeaf) and leaf.made_by is not None:  # as if the template's op made it here
                self.producer.setdefault(self.log.sid(t), (leaf.made_by, pos))
        in_sids = {self.log.sid(t) for t in in_tensors}  # a PassThrough output is the caller's, not the twin's
        self.twins.note_outputs(call.fqn, (sid for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                                           if (sid := self.log.sid(t)) not in in_sids))
        return out

    def _shared_input_bytes(self, call: Call, in_tensors) -> int:
        """Bytes of the call's input storages already held elsewhere (ModuleTrace.input_shared_bytes):
        batch tensors, and inputs of an earlier call that no ancestor of this one took as an input too
        (a storage an ancestor took is counted at the outermost call taking it; this keeps a twin's
        submodules, which copy their template's numbers, equal to a full trace's)."""
        sids = {self.log.sid(t): t for t in in_tensors}
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
        return self.log.storage_bytes(shared)

    # ---- backward spans ----
    def _hook_backward(self, call: Call, in_tensors, out_tensors) -> None:
        outs = [t for t in out_tensors if t.requires_grad]
        if outs:
            register_multi_grad_hook(outs, partial(self._pre_backward, call), mode="any")
        ins = [t for t in in_tensors if t.requires_grad]
        call.input_grad = bool(ins)
        if ins:
            register_all_grads_hook(ins, partial(self._post_backward, call))

    def _pre_backward(self, call: Call, _grads) -> None:
        if call.bwd is not None:
            return
        stack, events = self.bwd_stack, self.log.events
        k = len(stack)
        while k > 0 and is_ancestor(call, stack[k - 1]):
            k -= 1
        inner = stack[k:]
        if inner and all(ev[0] == ENTER for ev in events[inner[0].bwd.start :]):
            # A parent and its child share this output tensor; the child's hook, registered first, ran
            # first. Open the parent where the child opened, so that spans nest in the log.
            pos = inner[0].bwd.start
            del stack[k:]
            span = Span(call, "bwd", pos)
            events.insert(pos, (ENTER, span))
            for c in inner:
                c.bwd.start += 1
            call.bwd, call.bwd_open = span, True
            stack.append(call)
            stack.extend(inner)
            return
        while stack and not is_ancestor(stack[-1], call):
            self._close_bwd_top()
        self._open(call, "bwd")

    def _post_backward(self, call: Call) -> None:
        if not call.bwd_open:
            return
        while self.bwd_stack:
            top = self.bwd_stack[-1]
            self._close_bwd_top()
            if top is call:
                break

    # ---- the step ----
    def run(self, inputs: tuple | dict, targets) -> None:
        """Forward, loss and backward of the wrapped model, under the recorder."""
        for module in self.model.modules():
            for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                self.log.register_static(t)
        batch_tensors = input_tensors(inputs) + ([targets] if targets is not None else [])
        self.batch_input_bytes = self.log.storage_bytes(batch_tensors)
        for t in batch_tensors:
            if isinstance(t, torch.Tensor):
                self.input_owner[self.log.sid(t)] = None
        with self.log.resize_tracking(), Recorder(self), saved_tensors_hooks(self._pack, lambda t: t):
            self.phase = "fwd"
            out = self._forward(inputs, targets)
            self.forward_cache = output_cache(out)
            self.output_sids = frozenset(self.log.sid(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
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
                raise ModelFileError(
                    f"{self.mf.path}: the backward raised {type(exc).__name__}: {first_line(exc)}"
                ) from exc
            while self.bwd_stack:
                self._close_bwd_top()
            del loss
            self.phase = None
        for p in self.model.parameters():
            if p.grad is None:
                continue
            sid = self.log.known_sid(p.grad.untyped_storage())
            call = self.saves.counted_by(sid)
            if call is not None:  # computed in forward and saved: an activation until then (model/loss.py)
                call.forward_grad_bytes += self.log.nbytes[sid]
            else:
                self.log.register_static(p.grad)  # parameter gradients: not activations
        self.log.closed = True
        if self.unattributed_flops:
            logger.debug("%d FLOPs ran outside every module and the loss", self.unattributed_flops)

    def _forward(self, inputs: tuple | dict, targets):
        try:
            return self.mf.forward(self.model, inputs, targets)
        except ModelFileError:
            raise
        except Exception as exc:
            where = f" in module {self.error_module!r}" if self.error_module else ""
            raise ModelFileError(
                f"{self.mf.path}: the model's forward raised {type(exc).__name__}{where}: {first_line(exc)}"
            ) from exc

    def tainted_templates(self) -> set[str]:
        """Templates and twins whose subtree ran more than once (see :meth:`Twins.tainted`), or that were
        first in backward to reach an input they shared (see :meth:`Twins.first_gradients`)."""
        return self.twins.tainted(self.calls_by_fqn) | self.twins.first_gradients(self.root_call)

    def unsafe_reuse(self) -> set[str]:
        """Modules of the structure of a twin whose output was modified in place (see [Note: unsafe reuse])."""
        return self.twins.unsafe_modules()


def run_step(step: Step, modules: list[tuple[str, nn.Module]], inputs: tuple | dict, targets) -> None:
    """Wrap every module's forward, run the step, and unwrap them again (also on an error)."""
    own = {fqn: module.__dict__.get("forward") for fqn, module in modules}  # e.g. a chunked loss's output layer
    for fqn, module in modules:
        step.wrap(module, fqn)
    try:
        step.run(inputs, targets)
    finally:
        unwrap(modules, own)


def unwrap(modules, own: dict) -> None:
    """Remove the step's forward wrappers (instance attributes) again, restoring a module's ``own`` instance
    forward where it had one (model/loss.py installs one on the output layer)."""
    for fqn, module in modules:
        module.__dict__.pop("forward", None)
        if own.get(fqn) is not None:
            module.forward = own[fqn]


_WRITES_FIRST: dict = {}  # op -> whether it writes its first argument (an in-place op), cached


def _writes_first_argument(func) -> bool:
    known = _WRITES_FIRST.get(func)
    if known is None:
        args = func._schema.arguments
        alias = args[0].alias_info if args else None
        known = _WRITES_FIRST[func] = bool(alias is not None and alias.is_write)
    return known


def _cast(x, dtype: torch.dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x
