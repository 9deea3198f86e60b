"""The step's event log: tensor storages by identity, and the tensors saved for backward.

:class:`StorageLog` gives every storage it sees a small id (sid), logs ``ALLOC`` when first seen,
``FREE`` when the storage dies (a weak reference's callback) and ``RESIZE`` on a size change, including
through ``UntypedStorage.resize_``, which does not go through dispatch and which it patches for the step
(as torch's MemTracker does). Capture also logs span entries and exits into the same list.
:class:`SavedTensors` records every save for backward, deduplicated by storage.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from contextlib import contextmanager
from functools import partial

import torch
from torch.utils.weak import WeakIdKeyDictionary

from shard_planner.trace.records import ALLOC, FREE, RESIZE, Call, SaveAttempt


class StorageLog:
    """Storages by identity and the log of their allocations, frees and resizes."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.nbytes: dict[int, int] = {}  # sid -> current size of a live storage
        self.static: set[int] = set()  # parameters, buffers, parameter gradients: not activations
        self.closed = False  # after the step: frees are no longer logged
        self._sids = WeakIdKeyDictionary()  # storage -> sid
        self._refs: dict[int, weakref.ref] = {}
        self._next_sid = 0

    def sid(self, t: torch.Tensor) -> int:
        """The tensor's storage id, logging an ALLOC the first time its storage is seen."""
        st = t.untyped_storage()
        sid = self._sids.get(st)
        if sid is None:
            sid = self._next_sid
            self._next_sid += 1
            self._sids[st] = sid
            self.nbytes[sid] = st.nbytes()
            self._refs[sid] = weakref.ref(st, partial(self._freed, sid))
            self.events.append((ALLOC, sid, self.nbytes[sid]))
        return sid

    def known_sid(self, st) -> int | None:
        """The id of an untyped storage already seen, else None."""
        return self._sids.get(st)

    def track(self, t: torch.Tensor) -> None:
        """An op's output: a new storage, or a known one whose size may have changed."""
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
        if nbytes != self.nbytes[sid]:
            self.events.append((RESIZE, sid, nbytes - self.nbytes[sid]))
            self.nbytes[sid] = nbytes

    def _freed(self, sid: int, _ref) -> None:
        if self.closed:
            return
        self._refs.pop(sid, None)
        self.events.append((FREE, sid, -self.nbytes.pop(sid, 0)))

    def storage_bytes(self, tensors) -> int:
        """Bytes of the distinct non-static storages of ``tensors``."""
        seen, total = set(), 0
        for t in tensors:
            sid = self.sid(t)
            if sid not in seen and sid not in self.static:
                seen.add(sid)
                total += self.nbytes[sid]
        return total

    def register_static(self, t: torch.Tensor) -> None:
        self.static.add(self.sid(t))

    @contextmanager
    def resize_tracking(self):
        """``UntypedStorage.resize_`` does not go through dispatch; patch it for the step (as MemTracker)."""
        orig = torch.UntypedStorage.resize_
        log = self

        def resize_(st, size):
            out = orig(st, size)
            sid = log._sids.get(st)
            if sid is not None:
                log._maybe_resized(sid, st)
            return out

        torch.UntypedStorage.resize_ = resize_
        try:
            yield
        finally:
            torch.UntypedStorage.resize_ = orig


class SavedTensors:
    """Every save for backward, by storage; a storage's bytes count at its first save only."""

    def __init__(self) -> None:
        self.counted: set[int] = set()  # sids saved at least once
        self.attempts: dict[int, list[SaveAttempt]] = defaultdict(list)

    def note(self, pos: int, sid: int, nbytes: int, call: Call, rel: str = "") -> bool:
        """Record a save at log position ``pos``; True when it is the storage's first (counted)."""
        counted = sid not in self.counted
        self.counted.add(sid)
        self.attempts[sid].append(SaveAttempt(pos, call, rel, counted, nbytes))
        return counted

    def counted_by(self, sid: int | None) -> Call | None:
        """The call whose own save counted storage ``sid`` (its first save); None when it was never saved, or
        first saved by a twin (trace/twins.py ``run_twin``)."""
        attempts = self.attempts.get(sid) if sid is not None else None
        return attempts[0].call if attempts and attempts[0].call.template is None else None

    def first_within(self, sid: int, start: int, end: int) -> SaveAttempt | None:
        """The first save of storage ``sid`` strictly between log positions ``start`` and ``end``."""
        for attempt in self.attempts.get(sid, ()):
            if start < attempt.pos < end:
                return attempt
        return None
