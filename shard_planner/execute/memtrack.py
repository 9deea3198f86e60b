"""Exact peak memory on CPU: a TorchDispatchMode that counts live tensor storages.

The CPU allocator cannot be asked for a peak, and process RSS is 0.5-0.8 GiB off and too noisy to show
a reshard difference (DESIGN.md, "FSDP2 facts"). :class:`StorageTracker` instead sees every tensor an
operator returns, keys its *storage* by a weak reference (views share a storage and are counted once),
and subtracts the storage's bytes when it is freed. It counts:

- storages returned by any operator run while it is active (activations, gradients, temporaries,
  all-gather and reduce-scatter buffers, lazily created optimizer states);
- storages of the objects given as ``track=`` (a module's parameters, buffers and gradients, an
  optimizer's states), counted once at entry, because they were allocated before it;
- size changes made through ``torch.UntypedStorage.resize_``, which is not a dispatched operator and
  which FSDP2 uses to free (``resize_(0)``) and refill unsharded parameters
  (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, ``free_storage`` / ``alloc_storage``). The method
  is patched while a tracker is active, as torch/distributed/_tools/mem_tracker.py does.

A synchronous collective's own temporaries (gloo's ``reduce_scatter_single`` allocates a buffer of the
input's size while ``work.wait()`` runs) are counted while the collective runs and released when it
returns: gloo drops its last reference to them later, from its worker thread, at a time that varies from
run to run (measured on a tiny BERT plan: the same step peaked at 1,180,972 or 1,201,836 B depending on
whether that free came before the next operator), and NCCL has no such buffer. This is the lifetime the
cost model gives the backend's temporary (shard_planner/cost/memory.py, "Reduce-scatter buffers").
``torch.distributed``'s collective functions are wrapped while a tracker is active, for that scope.

[Note: Frees gloo delays]
  FSDP2 frees a buffer by dropping its last reference, but gloo's work object holds the tensors of a
  collective too, and the worker thread that ran it drops them after ``wait()`` has returned, at a time
  that depends on the machine's load. On a loaded 2-core machine (load 12) the free of an all-gather output
  came after the next unit's prefetch had allocated its own (backward), or after the loss (the root's
  post-forward drops the last one), once in a few runs (tests/execute/test_alloc_sequence.py); a fine-tune's
  measured peak rose 4% over its quiet value (tests/hf/test_finetune.py, under a full suite). So while a
  tracker is active each synchronous collective returns only once gloo has dropped its references to the
  tensors it was given (their ``Tensor._use_count()`` is back to what it was before the call; at most
  ``_SETTLE_S``, measured waits at most 0.4 ms): buffers are freed in the order, and at the time, FSDP2
  drops them, which is what the cost model's walk models. (NCCL has a delay of its own: the work stashes
  its tensors until it completes.)

DTensor wrappers are not counted: the mode declines DTensor operators, so DTensor desugars them into
operators on its local tensors, which the mode then sees; the storages of a given DTensor are its local
tensor's. Bytes are exact storage sizes (no allocator rounding).

Usage::

    tracker = StorageTracker(track=(model, optimizer))
    with tracker:
        tracker.phase = "forward"; loss = model(x).sum()
        tracker.phase = "backward"; loss.backward()
        tracker.phase = "optimizer"; optimizer.step()
    tracker.peak_bytes, tracker.peak_phase
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

logger = logging.getLogger(__name__)

PHASES = ("setup", "forward", "backward", "optimizer")

# Trackers that are active now (entered and not exited); the patched resize_ notifies each.
_ACTIVE: list["StorageTracker"] = []
_ORIG_RESIZE = None
_PATCH_LOCK = threading.Lock()
# The torch.distributed functions FSDP2 calls for its collectives (torch/distributed/fsdp/_fully_shard/
# _fsdp_collectives.py): storages they allocate and do not return are the backend's temporaries.
_COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                "reduce_scatter_tensor", "all_reduce")
_ORIG_COLLECTIVES: dict[str, Any] = {}
_SETTLE_S = 2.0  # the longest wait for gloo to drop a collective's tensors ([Note: Frees gloo delays])
_IN_COLLECTIVE = threading.local()  # .infos: storages first seen inside the current collective call


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The untyped storages behind ``t``: its own, or its inner tensors' for a wrapper subclass."""
    out, todo = [], [t]
    while todo:
        x = todo.pop()
        if is_traceable_wrapper_subclass(x):
            attrs, _ = x.__tensor_flatten__()
            todo.extend(v for v in (getattr(x, a) for a in attrs) if isinstance(v, torch.Tensor))
        elif x.layout == torch.strided:  # sparse and other layouts have no single storage
            out.append(x.untyped_storage())
    return out


def _tensors_of(obj: Any) -> Iterable[torch.Tensor]:
    """Tensors held by ``obj``: a tensor, a module (parameters, their grads, buffers), an optimizer
    (its states), or a list/tuple/dict of those."""
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
    elif isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            yield from _tensors_of(p)
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            yield from _tensors_of(list(state.values()))
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_of(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_of(v)


@functools.cache
def _dtensor_type() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def _patched_resize(storage: torch.UntypedStorage, size: int):
    result = _ORIG_RESIZE(storage, size)
    for tracker in list(_ACTIVE):
        tracker._on_resize(storage)
    return result


def _scoped_collective(fn):
    """``fn`` (a torch.distributed collective) run so that the storages it allocates on this thread are
    released in every active tracker when it returns (see the module docstring), and, when synchronous,
    returning only once the backend has dropped the tensors it was given ([Note: Frees gloo delays])."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if kwargs.get("async_op") or getattr(_IN_COLLECTIVE, "infos", None) is not None:
            return fn(*args, **kwargs)  # async: the caller waits later; nested: the outer call releases
        _IN_COLLECTIVE.infos = []
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        before = [t._use_count() for t in tensors]
        try:
            result = fn(*args, **kwargs)
            deadline = time.monotonic() + _SETTLE_S
            while any(t._use_count() > n for t, n in zip(tensors, before)) and time.monotonic() < deadline:
                time.sleep(0.0002)
            return result
        finally:
            infos, _IN_COLLECTIVE.infos = _IN_COLLECTIVE.infos, None
            for tracker, info in infos:
                tracker._release(info)

    return run


def _patch(active: bool) -> None:
    """Install (``active``) or restore the patched ``resize_`` and collectives; under _PATCH_LOCK."""
    global _ORIG_RESIZE
    import torch.distributed as dist

    if active:
        _ORIG_RESIZE = torch.UntypedStorage.resize_
        torch.UntypedStorage.resize_ = _patched_resize
        for name in _COLLECTIVES:
            if hasattr(dist, name):
                _ORIG_COLLECTIVES[name] = getattr(dist, name)
                setattr(dist, name, _scoped_collective(_ORIG_COLLECTIVES[name]))
    else:
        torch.UntypedStorage.resize_ = _ORIG_RESIZE
        for name, fn in _ORIG_COLLECTIVES.items():
            setattr(dist, name, fn)
        _ORIG_COLLECTIVES.clear()


@dataclass
class _Info:
    nbytes: int
    device_type: str


class StorageTracker(TorchDispatchMode):
    """Counts live tensor storages; see the module docstring.

    ``device_type`` (e.g. "cpu", "cuda"): count only storages on devices of that type (None: all).
    ``phase`` is a label the caller sets ("forward", "backward", "optimizer"); the peak records it.
    """

    def __init__(self, track: Iterable[Any] = (), device_type: str | None = None):
        super().__init__()
        self.device_type = device_type
        self.phase = "setup"
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_phase = "setup"
        self._track_on_entry = tuple(track)
        self._infos: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: dict[int, weakref.ref] = {}  # keeps the finalising weakrefs alive
        self._lock = threading.RLock()
        self._depth = 0

    # ---- public ----
    def track(self, *objs: Any) -> None:
        """Count the storages of tensors that exist already (modules, optimizers, tensors)."""
        for t in _tensors_of(list(objs)):
            self._add_tensor(t)

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now (e.g. after warm-up steps)."""
        with self._lock:
            self.peak_bytes = self.live_bytes
            self.peak_phase = self.phase

    # ---- the mode ----
    def __enter__(self):
        if self._depth == 0:
            with _PATCH_LOCK:
                if not _ACTIVE:
                    _patch(True)
                _ACTIVE.append(self)
            if self._track_on_entry:
                self.track(*self._track_on_entry)
                self._track_on_entry = ()
            self._update_peak()
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            with _PATCH_LOCK:
                _ACTIVE.remove(self)
                if not _ACTIVE:
                    _patch(False)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, _dtensor_type()) for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here
        res = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._add_tensor, res)
        return res

    # ---- bookkeeping ----
    def _add_tensor(self, t: torch.Tensor) -> None:
        if self.device_type is not None and t.device.type != self.device_type:
            return
        for st in _storages(t):
            self._add_storage(st, t.device.type)

    def _add_storage(self, st: torch.UntypedStorage, device_type: str) -> None:
        with self._lock:
            info = self._infos.get(st)
            if info is not None:
                self._resize_known(info, st)
                return
            info = _Info(st.nbytes(), device_type)
            self._infos[st] = info
            key = id(info)
            self._refs[key] = weakref.ref(st, lambda _ref, info=info, key=key: self._on_free(info, key))
            self.live_bytes += info.nbytes
            self._update_peak()
            self._changed(info, info.nbytes, "alloc")
            scope = getattr(_IN_COLLECTIVE, "infos", None)
            if scope is not None:
                scope.append((self, info))

    def _resize_known(self, info: _Info, st: torch.UntypedStorage) -> None:
        nbytes = st.nbytes()
        if nbytes != info.nbytes:
            delta, info.nbytes = nbytes - info.nbytes, nbytes
            self.live_bytes += delta
            self._update_peak()
            self._changed(info, delta, "resize")

    def _on_resize(self, st: torch.UntypedStorage) -> None:
        with self._lock:
            info = self._infos.get(st)
            if info is not None:
                self._resize_known(info, st)
            elif st.nbytes() > 0 and (self.device_type is None or st.device.type == self.device_type):
                # A storage from before the tracker (FSDP2's all-gather buffers, freed with resize_(0)
                # at the end of the previous step) is refilled: it is live memory from now on.
                self._add_storage(st, st.device.type)

    def _release(self, info: _Info) -> None:
        """A collective's temporary is no longer counted (its storage may be freed later, elsewhere)."""
        with self._lock:
            self.live_bytes -= info.nbytes
            self._changed(info, -info.nbytes, "release")
            info.nbytes = 0

    def _on_free(self, info: _Info, key: int) -> None:
        with self._lock:
            self.live_bytes -= info.nbytes
            if info.nbytes:
                self._changed(info, -info.nbytes, "free")
            info.nbytes = 0
            self._refs.pop(key, None)

    def _changed(self, info: _Info, delta_bytes: int, how: str) -> None:
        """Called under the lock after each change a storage makes to ``live_bytes``: ``how`` is "alloc" (a new
        storage), "resize", "release" (a collective's temporary, see the module docstring) or "free". A
        subclass that records the sequence overrides it (execute/alloc_record.py)."""

    def _update_peak(self) -> None:
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_phase = self.phase
