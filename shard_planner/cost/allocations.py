"""The memory walk's allocation events and the accountants that add them up.

cost/memory.py walks one training step and emits, in host order, every allocation and free it models
(``on_alloc`` / ``on_free``: size in bytes, :class:`Kind`, owner — the unit or module it belongs to —
and the CUDA :class:`Stream` FSDP2 allocates it on) and a mark at each moment of the step (``on_mark``:
the schedule event's label parts and the moment's scratch, below). An accountant is any object with
those three methods (:class:`Accountant`). Two are built in: :class:`CategoryTotals`, the live bytes by
plan category and their peak (``memory_at_peak``), and :class:`Timeline`, the totals after every mark (the
report's memory timeline). The allocator simulation (issue 29) is meant to be a third.

A moment's scratch — temporaries (a kernel's, the flat cast copy of an all-gather input: ``temp_bytes``)
and a comm buffer (the reduce-scatter output while the collective runs: ``comm_bytes``), both on the
mark's ``stream`` — is allocated just before the moment and freed just after it. The mark carries it
(one call instead of five, on the walk's hottest path); an accountant that wants allocations makes an
alloc before and a free after (tests/cost/test_allocations.py does). So an accountant sees every
allocation matched by a free except the state alive at the end of the step (sharded parameters and
buffers, optimizer states, the batch, the overhead).

[Note: Which stream allocates what]
  FSDP2 (torch 2.13, torch/distributed/fsdp/_fully_shard/) allocates on four streams, and a block
  freed on one stream is reused only by that stream (issue 29), so each event names its stream:
  - COPY_IN: ``foreach_all_gather`` (_fsdp_collectives.py) allocates the all-gather output and the
    flat cast copy of the input (``_get_param_all_gather_inputs``; the host-to-device copy of an
    offloaded shard too) inside ``with device_handle.stream(all_gather_copy_in_stream)``. Those are the
    streams ``FSDPCommContext.get_all_gather_streams`` (_fsdp_param_group.py) returns for a
    synchronous unshard in forward and pre-backward — the default ``unshard_async_op=False``, and
    explicit prefetches run under ``use_training_state(FORWARD / PRE_BACKWARD)``.
  - ALL_GATHER: the collective runs there; it allocates nothing the walk models (kept for the
    allocator's stream set).
  - REDUCE_SCATTER: ``foreach_reduce`` allocates the 1/N reduce-scatter output inside
    ``with device_handle.stream(reduce_scatter_stream)``, and the cast of it to the sharded gradient's
    dtype runs on ``post_reduce_stream`` (the reduce-scatter stream without HSDP).
  - DEFAULT (the compute stream): the unsharded parameters (``foreach_all_gather_copy_out`` runs on
    the current stream after waiting for the all-gather), the reduce-scatter input (allocated and
    copied into before ``reduce_scatter_stream.wait_stream(current_stream)``), the post-forward clone
    of ``reshard_after_forward=r``, gradients, activations, kernels' temporaries, the optimizer.

[Note: Activations as a level]
  The walk knows activations as a level — the batch, plus what the blocks so far saved, plus the tensor
  flowing between blocks (cost/memory.py [Note: Activations]) —, not as storages. Before a mark at which
  the level has changed it emits a free of the old level and an allocation of the new one (owner "": the
  step's), so the totals hold the level exactly, and the hot path pays for a change only once per mark.
  An allocator simulation that needs the saved tensors one by one needs the tracer to record them.
"""

from __future__ import annotations

import enum
from typing import Protocol

from shard_planner.cost.schedule import Phase
from shard_planner.plan import MEMORY_CATEGORIES


class Kind(enum.IntEnum):
    """What an allocation holds. :data:`REPORTED_AS` maps each kind onto a plan category."""

    SHARDED_PARAMS = 0  # the 1/N parameter shards and the (unsharded) module buffers
    UNSHARDED_PARAMS = 1  # copied out of the all-gather output, in the param dtype; the 1/r post-forward clone
    ALL_GATHER_OUTPUT = 2  # the flat output of one all-gather: its own kind (float8 / NF4 gather in another dtype)
    GRADS = 3
    OPTIMIZER_STATES = 4
    ACTIVATIONS = 5
    TEMPORARIES = 6
    COMM_BUFFERS = 7  # reduce-scatter input and output
    OVERHEAD = 8  # the profile's reserved bytes and per-process-group memory


# The plan category each kind is reported in: the all-gather output stays in "comm_buffers", where the
# plan file has always counted it.
REPORTED_AS: dict[Kind, str] = {
    Kind.SHARDED_PARAMS: "sharded_params", Kind.UNSHARDED_PARAMS: "unsharded_params",
    Kind.ALL_GATHER_OUTPUT: "comm_buffers", Kind.GRADS: "grads", Kind.OPTIMIZER_STATES: "optimizer_states",
    Kind.ACTIVATIONS: "activations", Kind.TEMPORARIES: "temporaries", Kind.COMM_BUFFERS: "comm_buffers",
    Kind.OVERHEAD: "overhead",
}
assert set(REPORTED_AS) == set(Kind) and set(REPORTED_AS.values()) == set(MEMORY_CATEGORIES)
# per kind, the index of its category in MEMORY_CATEGORIES (a tuple indexed by the kind: this is hot)
_CATEGORY_INDEX: tuple[int, ...] = tuple(MEMORY_CATEGORIES.index(REPORTED_AS[k]) for k in Kind)
_TEMPORARIES, _COMM_BUFFERS = _CATEGORY_INDEX[Kind.TEMPORARIES], _CATEGORY_INDEX[Kind.COMM_BUFFERS]


class Stream(enum.IntEnum):
    """The CUDA stream an allocation is made on: [Note: Which stream allocates what]."""

    DEFAULT = 0
    COPY_IN = 1
    ALL_GATHER = 2
    REDUCE_SCATTER = 3


# Each kind and stream as a module constant too: looking up an Enum member as a class attribute costs ~60 ns
# (Python 3.11), ten times a global's, and the memory walk emits ~40 events per unit.
(SHARDED_PARAMS, UNSHARDED_PARAMS, ALL_GATHER_OUTPUT, GRADS, OPTIMIZER_STATES, ACTIVATIONS, TEMPORARIES, COMM_BUFFERS,
 OVERHEAD) = Kind
ON_DEFAULT, ON_COPY_IN, ON_ALL_GATHER, ON_REDUCE_SCATTER = Stream


class Accountant(Protocol):
    """What the memory walk emits to. ``owner``: the unit's or module's name ("" for the root, the step)."""

    def on_alloc(self, kind: Kind, size_bytes: float, owner: str, stream: Stream) -> None: ...

    def on_free(self, kind: Kind, size_bytes: float, owner: str, stream: Stream) -> None: ...

    def on_mark(self, what: str, who: str, phase: Phase, temp_bytes: float, comm_bytes: float,
                stream: Stream) -> None: ...


class CategoryTotals:
    """Live bytes by plan category (``totals``, in MEMORY_CATEGORIES order) and the peak over the marks.
    ``peak_event``: (what, who, phase, totals) at the first mark with the largest total."""

    __slots__ = ("totals", "peak_total", "peak_event")

    def __init__(self):
        self.totals = [0.0] * len(MEMORY_CATEGORIES)
        self.peak_total = -1.0
        self.peak_event: tuple | None = None

    def on_alloc(self, kind: Kind, size_bytes: float, owner: str, stream: Stream) -> None:
        self.totals[_CATEGORY_INDEX[kind]] += size_bytes

    def on_free(self, kind: Kind, size_bytes: float, owner: str, stream: Stream) -> None:
        self.totals[_CATEGORY_INDEX[kind]] -= size_bytes

    def on_mark(self, what: str, who: str, phase: Phase, temp_bytes: float, comm_bytes: float,
                stream: Stream) -> None:
        c = self.totals
        total = c[0] + c[1] + c[2] + c[3] + c[4] + c[5] + c[6] + c[7] + temp_bytes + comm_bytes  # (unrolled: hot)
        if total > self.peak_total:
            self.peak_total = total
            self.peak_event = (what, who, phase, at_mark(c, temp_bytes, comm_bytes))


class Timeline:
    """The category totals after every mark: (what, who, phase, totals) per mark, in order. It reads
    ``totals`` (which must see each mark first) and ignores allocations (``marks_only``)."""

    marks_only = True

    def __init__(self, totals: CategoryTotals):
        self._totals = totals.totals
        self.marks: list[tuple] = []

    def on_alloc(self, kind: Kind, size_bytes: float, owner: str, stream: Stream) -> None:
        pass

    def on_free(self, kind: Kind, size_bytes: float, owner: str, stream: Stream) -> None:
        pass

    def on_mark(self, what: str, who: str, phase: Phase, temp_bytes: float, comm_bytes: float,
                stream: Stream) -> None:
        self.marks.append((what, who, phase, at_mark(self._totals, temp_bytes, comm_bytes)))


class FanOut:
    """Several accountants as one, each seeing each event in their order; allocations go only to those
    that are not ``marks_only`` (bound directly when that is one: no loop on the hot path)."""

    def __init__(self, accountants):
        self.accountants = tuple(accountants)
        self.alloc_accountants = tuple(a for a in self.accountants if not getattr(a, "marks_only", False))
        if len(self.alloc_accountants) == 1:
            self.on_alloc = self.alloc_accountants[0].on_alloc
            self.on_free = self.alloc_accountants[0].on_free
        if len(self.accountants) == 2:  # the totals and the timeline: no loop
            first, second = self.accountants[0].on_mark, self.accountants[1].on_mark

            def on_mark(what, who, phase, temp_bytes, comm_bytes, stream):
                first(what, who, phase, temp_bytes, comm_bytes, stream)
                second(what, who, phase, temp_bytes, comm_bytes, stream)
            self.on_mark = on_mark

    def on_alloc(self, kind: Kind, size_bytes: float, owner: str, stream: Stream) -> None:
        for a in self.alloc_accountants:
            a.on_alloc(kind, size_bytes, owner, stream)

    def on_free(self, kind: Kind, size_bytes: float, owner: str, stream: Stream) -> None:
        for a in self.alloc_accountants:
            a.on_free(kind, size_bytes, owner, stream)

    def on_mark(self, what: str, who: str, phase: Phase, temp_bytes: float, comm_bytes: float,
                stream: Stream) -> None:
        for a in self.accountants:
            a.on_mark(what, who, phase, temp_bytes, comm_bytes, stream)


def one_accountant(accountants) -> Accountant:
    """``accountants`` as one: itself when there is one (no fan-out on the hot path)."""
    accountants = tuple(accountants)
    return accountants[0] if len(accountants) == 1 else FanOut(accountants)


_C0, _C1, _C2, _C3, _C4, _C5, _C6, _C7 = MEMORY_CATEGORIES  # (unpacked for to_dict, which is hot with a timeline)


def at_mark(totals: list, temp_bytes: float, comm_bytes: float) -> list:
    """The category totals at a mark (a copy): ``totals`` with the mark's scratch added to its two categories."""
    c = totals.copy()
    if temp_bytes:
        c[_TEMPORARIES] += temp_bytes
    if comm_bytes:
        c[_COMM_BUFFERS] += comm_bytes
    return c


def to_dict(totals: list) -> dict[str, int]:
    """Category totals (MEMORY_CATEGORIES order) as whole bytes by category."""
    v0, v1, v2, v3, v4, v5, v6, v7 = totals
    return {_C0: int(v0 + 0.5), _C1: int(v1 + 0.5), _C2: int(v2 + 0.5), _C3: int(v3 + 0.5), _C4: int(v4 + 0.5),
            _C5: int(v5 + 0.5), _C6: int(v6 + 0.5), _C7: int(v7 + 0.5)}


def label(what: str, who: str, phase: Phase) -> str:
    """A mark's text: "<phase>: <what> <who>" (built only for the marks kept)."""
    if phase is Phase.OPTIMIZER:
        return "optimizer step" if what == "step" else what
    if what.startswith("loss"):
        return what
    if not what:
        return f"{phase}: {who or '<root>'}"
    return f"{phase}: {what} {who}" if who else f"{phase}: {what}"
