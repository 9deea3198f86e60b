"""The allocation sequence of a real FSDP2 step on CPU, its buffers labelled (issue 29).

:class:`SequenceRecorder` is the :class:`~shard_planner.execute.memtrack.StorageTracker` keeping every change
it counts, in order (a storage's allocation, resize, free, or a collective's temporary released), with the
FSDP2 call running at the time; :func:`real_sequence` turns that into the sequence of FSDP2 buffers that
cost/alloc_sequence.py compares with the memory walk's.

[Note: Labelling FSDP2's buffers by identity]
  Call stacks and sizes are both fragile ways to tell an all-gather output from an activation (two units
  can be the same size; a stack changes with every torch release). Instead, while the recorder is active,
  four methods of ``FSDPParamGroup`` (torch 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py)
  and the ``foreach_reduce`` it calls are wrapped, and when each returns (or starts) the recorder labels
  the storages FSDP2 itself holds for the buffer, by storage identity:
  - ``unshard``: ``self._all_gather_result.all_gather_output`` is the all-gather output; any other storage
    allocated during the call and not a collective's temporary is the flat cast copy of the input;
  - ``wait_for_unshard``: every ``fsdp_param.all_gather_outputs`` storage is an unsharded parameter (the
    resizes of ``foreach_all_gather_copy_out``; ``unsharded_param`` is a view of it);
  - ``post_backward``, at entry: every ``fsdp_param.unsharded_param.grad`` is an unsharded gradient
    (autograd made it earlier, outside any FSDP2 call); at return: every ``sharded_param.grad``'s local
    tensor is a sharded gradient;
  - ``foreach_reduce``: the first tensor it returns is the reduce-scatter input; another storage it
    allocates that is not a collective's temporary nor the sharded gradient is the reduce-scatter output
    (cast to the gradient dtype).
  ``reshard`` is wrapped only so that its frees are grouped per call. The group's unit is its modules'
  names (``plan.unit_name``). The labels are applied after the step to every change of the storage, so a
  gradient is a gradient from its allocation on. Storages alive at entry (``track=``: parameters,
  optimizer states) are the step's state; everything else is an activation or a temporary.

Frees are recorded in the order FSDP2 drops its buffers, not when gloo's worker thread lets go of them: the
tracker's collectives wait for that (shard_planner/execute/memtrack.py [Note: Frees gloo delays]).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any

import torch

from shard_planner.cost.alloc_sequence import (
    AG_OUTPUT, ALLOC, FREE, RS_INPUT, RS_OUTPUT, SHARDED_GRAD, UNSHARDED, SeqEvent, canonical,
)
from shard_planner.execute.memtrack import StorageTracker

# roles that are not one-for-one buffers
GRAD, STATE, INPUT_COPY, COLLECTIVE_TEMP = "unsharded grad", "state", "input copy", "collective temp"
_WRAPPED = ("unshard", "wait_for_unshard", "reshard", "post_backward")


@dataclass(frozen=True)
class Change:
    """One change to the live bytes: storage ``serial``, ``delta_bytes``, ``how`` (StorageTracker._changed),
    the FSDP2 call running (``call``: a number per call, 0 outside; ``method``; its ``unit``) and the phase."""

    serial: int
    delta_bytes: int
    how: str
    call: int
    method: str
    unit: str
    phase: str


class SequenceRecorder(StorageTracker):
    """A StorageTracker that records its changes and labels FSDP2's buffers (module docstring).
    ``unit_of``: an FSDPParamGroup -> its unit's name."""

    def __init__(self, unit_of, track=(), device_type: str | None = "cpu"):
        super().__init__(track=track, device_type=device_type)
        self.unit_of = unit_of
        self.changes: list[Change] = []
        self.roles: dict[int, tuple[str, str]] = {}  # serial -> (role, unit)
        self._serials = itertools.count(1)
        self._calls = itertools.count(1)
        self._stack = threading.local()
        self._originals: dict[str, Any] = {}
        self._allocs_of_call: dict[int, list[int]] = {}  # call -> serials allocated during it
        self._groups: dict[int, tuple] = {}  # id -> (FSDPParamGroup, unit) of the groups seen
        self._entering = False  # counting the storages of ``track=`` (the step's state)

    # ---- recording ----
    def _changed(self, info, delta_bytes: int, how: str) -> None:
        if how == "alloc":
            info.serial = next(self._serials)
            if self._entering:
                self.roles[info.serial] = (STATE, "")
        elif how == "release":
            self.roles[info.serial] = (COLLECTIVE_TEMP, "")
        call, method, unit = (self._stack.frames[-1] if getattr(self._stack, "frames", None) else (0, "", ""))
        if how == "alloc" and call:
            self._allocs_of_call.setdefault(call, []).append(info.serial)
        self.changes.append(Change(info.serial, delta_bytes, how, call, method, unit, self.phase))

    def label(self, tensor: torch.Tensor | None, role: str, unit: str) -> None:
        """Label the storage behind ``tensor`` (its local tensor for a DTensor) as ``role`` of ``unit``."""
        if tensor is None:
            return
        tensor = getattr(tensor, "_local_tensor", tensor)
        info = self._infos.get(tensor.untyped_storage())
        if info is not None and hasattr(info, "serial") and self.roles.get(info.serial, ("",))[0] != COLLECTIVE_TEMP:
            self.roles[info.serial] = (role, unit)

    # ---- the FSDP2 wrappers ----
    def __enter__(self):
        if self._depth == 0:
            self._wrap_fsdp2()
        self._entering = True
        try:
            return super().__enter__()
        finally:
            self._entering = False

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        if self._depth == 0:
            self._unwrap_fsdp2()
        return result

    def _wrap_fsdp2(self) -> None:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

        cls = pg.FSDPParamGroup
        for name in _WRAPPED:
            self._originals[name] = getattr(cls, name)
            setattr(cls, name, self._wrapped_method(name, getattr(cls, name)))
        self._originals["foreach_reduce"] = pg.foreach_reduce
        pg.foreach_reduce = self._wrapped_reduce(pg.foreach_reduce)

    def _unwrap_fsdp2(self) -> None:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

        for name in _WRAPPED:
            setattr(pg.FSDPParamGroup, name, self._originals.pop(name))
        pg.foreach_reduce = self._originals.pop("foreach_reduce")

    def _frames(self) -> list:
        if not hasattr(self._stack, "frames"):
            self._stack.frames = []
        return self._stack.frames

    def _wrapped_method(self, name: str, fn):
        recorder = self

        def run(group, *args, **kwargs):
            unit = recorder.unit_of(group)
            frames = recorder._frames()
            frames.append((next(recorder._calls), name, unit))
            try:
                recorder._groups.setdefault(id(group), (group, unit))
                if name == "post_backward":
                    recorder._label_gradients()
                result = fn(group, *args, **kwargs)
                recorder._label_after(name, group, unit, frames[-1][0])
                return result
            finally:
                frames.pop()

        return run

    def _label_gradients(self) -> None:
        """Every group's unsharded gradients now (a tied weight's first gradient is replaced by the sum when
        its other use's backward runs, so a group's own post-backward may no longer see it)."""
        for group, unit in self._groups.values():
            for p in group.fsdp_params:
                if hasattr(p, "_unsharded_param") and p.unsharded_param.grad is not None:
                    self.label(p.unsharded_param.grad, GRAD, unit)

    def _label_after(self, name: str, group, unit: str, call: int) -> None:
        if name == "unshard" and group._all_gather_result is not None:
            for serial in self._allocs_of_call.pop(call, ()):
                self.roles.setdefault(serial, (INPUT_COPY, unit))
            self.label(group._all_gather_result.all_gather_output, AG_OUTPUT, unit)
        elif name == "wait_for_unshard":
            for p in group.fsdp_params:
                for t in getattr(p, "all_gather_outputs", ()):
                    self.label(t, UNSHARDED, unit)
        elif name == "post_backward":
            for p in group.fsdp_params:
                self.label(p.sharded_param.grad, SHARDED_GRAD, unit)

    def _wrapped_reduce(self, fn):
        recorder = self

        def run(*args, **kwargs):
            frames = recorder._frames()
            unit = frames[-1][2] if frames else ""
            frames.append((next(recorder._calls), "foreach_reduce", unit))
            call = frames[-1][0]
            try:
                result = fn(*args, **kwargs)
                for serial in recorder._allocs_of_call.pop(call, ()):
                    recorder.roles.setdefault(serial, (RS_OUTPUT, unit))
                recorder.label(result[0], RS_INPUT, unit)
                return result
            finally:
                frames.pop()

        return run


def real_sequence(recorder: SequenceRecorder) -> list[SeqEvent]:
    """The recorded step's FSDP2 buffers as the walk's one-for-one events (cost/alloc_sequence.py), in
    canonical order: the changes of one buffer kind of one unit in one FSDP2 call (a unit's parameters
    resized one by one) are one event; an all-gather output's allocation carries its call's input copy;
    each event carries the gradients' and the activations' live bytes just before it."""
    events: list[SeqEvent] = []
    grads = activations = 0
    last_key = None
    input_copy: dict[int, int] = {}  # unshard call -> its cast copy's bytes
    for c in recorder.changes:
        role, unit = recorder.roles.get(c.serial, ("", ""))
        if role == INPUT_COPY and c.delta_bytes > 0:
            input_copy[c.call] = input_copy.get(c.call, 0) + c.delta_bytes
        if role in (AG_OUTPUT, UNSHARDED, RS_INPUT, RS_OUTPUT, SHARDED_GRAD):
            op = ALLOC if c.delta_bytes > 0 else FREE
            key = (role, unit, op, c.call if c.call else c.serial)
            if key == last_key:
                e = events[-1]
                events[-1] = SeqEvent(e.op, e.kind, e.unit, e.size_bytes + abs(c.delta_bytes), e.phase,
                                      e.grad_bytes, e.activation_bytes, e.scratch_bytes)
            else:
                scratch = input_copy.get(c.call, 0) if (role, op) == (AG_OUTPUT, ALLOC) else 0
                events.append(SeqEvent(op, role, unit, abs(c.delta_bytes), c.phase, grads, activations, scratch))
            last_key = key
        elif role == GRAD:
            grads += c.delta_bytes
        elif role == "":
            activations += c.delta_bytes
    return canonical(events)
