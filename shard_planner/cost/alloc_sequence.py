"""The memory walk's FSDP2 buffers as an ordered sequence, and its comparison with a real step's (issue 29).

The memory walk (cost/memory.py) emits every allocation it models to accountants (cost/allocations.py).
Some of them are FSDP2's own buffers, one allocation each as FSDP2 makes them; those can be checked one
for one against the allocations a real step makes (execute/alloc_record.py records them on CPU/gloo).
:class:`WalkSequence` is an accountant that keeps them as :class:`SeqEvent`\\ s; :func:`compare_sequences`
compares two such sequences and names the first event that differs.

The comparison is made on the walk's events, the input of the allocator simulation
(cost/allocator_accountant.py), rather than on its allocator calls (``CostModel.reserved_events``): the
accountant turns each of these events into one malloc or free on the event's stream
([Note: From walk events to allocator calls]), and the events still carry the kind and the unit, which
tell the first difference in words.

[Note: What the walk models one for one]
  Per unit, in the order FSDP2 (torch 2.13, torch/distributed/fsdp/_fully_shard/) makes them:
  - the all-gather output (``foreach_all_gather``: one flat buffer of the unit's unsharded size) and its
    free, with the flat param-dtype cast copy of the input as the allocation's ``scratch_bytes`` (the walk
    gives it as the "all-gather" mark's temporary, FSDP2 allocates it just before the output and frees it
    when ``foreach_all_gather`` returns: the bytes are compared, not that order);
  - the unsharded parameters: FSDP2 refills one storage per parameter (``alloc_storage``, a ``resize_``
    in ``foreach_all_gather_copy_out``) and frees them one by one in ``reshard``; the walk has one
    allocation of their sum per unit, so the real side sums the resizes of one call;
  - the reduce-scatter input (``foreach_reduce``) and its free (at the next post-backward, or at the end
    of backward);
  - the reduce-scatter output that becomes the sharded gradient (views into it) and its free by
    ``zero_grad(set_to_none=True)``. The walk gives the output as the "reduce-scatter" mark's comm buffer
    and then allocates the sharded gradient; without a gradient cast they are one buffer, so the mark's
    comm buffer is the allocation and the gradient's allocation that follows (same unit, same bytes) is
    not a second one. The frees of ``zero_grad`` follow nothing in between: the walk frees them in unit
    order, ``zero_grad`` in the order the last parameter of each unit is reached, so a run of them is
    compared as a set (sorted by unit).
  Sizes and order of these must be equal.

[Note: What the walk models as an aggregate]
  - Unsharded gradients: autograd allocates one per parameter, the walk one per block (cost/memory.py
    ``backward``). Compared as live bytes at each one-for-one event (``grad_bytes``), exactly: at every
    FSDP2 hook a block's backward has produced all of its gradients or none. (Not equal today: see
    [Note: What the sequence check found].)
  - Activations: autograd saves tensor by tensor, the walk keeps a level (cost/allocations.py
    [Note: Activations as a level]) that changes just before the mark it applies to; so an event's
    ``activation_bytes`` is the level at the walk's next mark, the real one the live bytes of every
    storage that is none of FSDP2's buffers, gradients or the step's state, at the event. The level is
    traced (shard_planner/trace), not counted, so it matches within ``ACTIVATION_TOLERANCE``.

[Note: What the sequence check found]
  Run on the example models (tests/execute/test_alloc_sequence.py, benchmarks/bench_alloc_sequence.py;
  torch 2.13, gloo, world size 2), every one-for-one event matches in bytes and order. Three differences
  of the walk from FSDP2 and autograd remain, all in backward:
  - The gradient held through the reduce-scatter is the unit's LAST parameter's, not its first module's.
    ``foreach_reduce`` (_fsdp_collectives.py) loops ``for i, (fsdp_param, unsharded_grad) in
    enumerate(zip(fsdp_params, unsharded_grads))`` when the world size is above 1; after the loop the
    variable ``unsharded_grad`` still names the last gradient, so ``unsharded_grads.clear()`` frees all
    but that one, until ``foreach_reduce`` returns (after the output is allocated). The walk holds
    ``UnitBytes.last_grad``, the trainable elements of the unit's first module in forward order
    (cost/unit_params.py): for a Llama block it holds ``attention_norm`` (64 elements) where FSDP2 holds
    ``feed_forward.w3.weight`` (dim x ffn, 12288 elements tiny; 58.7M elements at 8B: 117 MB in bf16,
    under-predicted while each block's reduce-scatter runs); for a block whose last module has a bias it
    holds the whole first module where FSDP2 holds the bias. The trace keeps parameter bytes per module,
    not per parameter, so the fix is in the tracer and cost/unit_params.py.
  - A weight used twice (GPT-2's head tied to ``wte``) gets its first gradient when the head's backward
    runs, at the start of backward; autograd keeps it in the accumulation node's input buffer until the
    embedding's backward adds the second, at the end. The walk counts the root's gradient only from the
    embedding's backward: 65536 B (the tied matrix in bf16) live through the whole backward is missing
    (GPT-2 small: 50257 x 768 x 2 B = 77 MB). It shows in the activations (it is no ``.grad`` the
    recorder can label).
  - A U-Net's skip connections in backward: the gradient of a skip tensor, produced by the up block that
    concatenates it, is held until the matching down block's backward; the walk's backward carries one
    flowing gradient (cost/memory.py ``enter_backward_block``). The real activations rise to 458760 B
    where the walk's level is 229376 B (U-Net tiny, every block checkpointed, micro-batch 4).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shard_planner.cost.allocations import (
    ACTIVATIONS, ALL_GATHER_OUTPUT, COMM_BUFFERS, GRADS, ON_DEFAULT, ON_REDUCE_SCATTER, UNSHARDED_PARAMS, Kind,
    Stream,
)
from shard_planner.cost.schedule import Phase

ALLOC, FREE = "alloc", "free"
# The one-for-one kinds ([Note: What the walk models one for one]).
AG_OUTPUT = "all-gather output"
UNSHARDED = "unsharded params"
RS_INPUT = "reduce-scatter input"
RS_OUTPUT = "reduce-scatter output"  # only where it is not the sharded gradient (a gradient cast)
SHARDED_GRAD = "sharded grad"
ONE_FOR_ONE = (AG_OUTPUT, UNSHARDED, RS_INPUT, RS_OUTPUT, SHARDED_GRAD)

# [Note: Activation tolerance]
#   The walk's activation level is the tracer's (FakeTensorMode) saved bytes per block plus the tensor
#   flowing between blocks; the real one is every storage autograd and the model hold that is none of
#   FSDP2's buffers or gradients, including a few small ones the walk does not model (the loss and its
#   scalar gradient, the batch's exact bytes). What matters for the peak is the level's error against
#   the level's own peak, so each event's error is taken relative to the walk's largest level in the
#   step (at least ``ACTIVATION_FLOOR_BYTES``), and must stay within 5%: the memory model's 3% allowance
#   at the peak against real runs (tests/cost/test_cost_realrun.py) plus the ~2% the level of a tiny
#   model moves from block to block by such small tensors (measured: examples/llama.py tiny, largest
#   difference 33824 B of a 1990624 B level, 1.7%; benchmarks/bench_alloc_sequence.py).
ACTIVATION_TOLERANCE = 0.05
ACTIVATION_FLOOR_BYTES = 65536


@dataclass(frozen=True)
class SeqEvent:
    """One allocation or free of an FSDP2 buffer, and the aggregates at that moment."""

    op: str  # ALLOC or FREE
    kind: str  # one of ONE_FOR_ONE
    unit: str  # the unit's name (plan.unit_name: "<root>", "layers.0", "a..b")
    size_bytes: int
    phase: str  # "forward", "backward", "optimizer"
    grad_bytes: int = 0  # unsharded gradients live (exact)
    activation_bytes: int = 0  # activations live (within the tolerance)
    scratch_bytes: int = 0  # an all-gather output's allocation: the cast copy of its input

    def describe(self) -> str:
        extra = f", input copy {self.scratch_bytes} B" if self.scratch_bytes else ""
        return (f"{self.phase}: {self.op} {self.kind} {self.unit} {self.size_bytes} B{extra} "
                f"(grads {self.grad_bytes} B, activations {self.activation_bytes} B)")

    def key(self) -> tuple:
        """What must be equal one for one (the aggregates are compared apart)."""
        return (self.op, self.kind, self.unit, self.size_bytes, self.phase, self.scratch_bytes)


class WalkSequence:
    """An accountant (cost/allocations.py) that keeps the walk's one-for-one events as :class:`SeqEvent`\\ s
    (``events``), with the aggregates at each ([Note: What the walk models as an aggregate])."""

    def __init__(self):
        self.events: list[SeqEvent] = []
        self._pending: list[int] = []  # events waiting for the next mark's phase and activation level
        self._activations = 0.0
        self._grads = 0.0
        self._rs_output: dict[str, int] = {}  # unit -> its reduce-scatter output, allocated at the mark

    def _emit(self, op: str, kind: str, owner: str, size_bytes: float) -> None:
        size = int(round(size_bytes))
        if size:
            self._pending.append(len(self.events))
            self.events.append(SeqEvent(op, kind, owner, size, "", int(round(self._grads))))

    def on_alloc(self, kind: Kind, size_bytes: float, owner: str, stream: Stream) -> None:
        if kind is ACTIVATIONS:
            self._activations += size_bytes
        elif kind is GRADS and stream is ON_DEFAULT:
            self._grads += size_bytes
        elif kind is GRADS and stream is ON_REDUCE_SCATTER:
            if self._rs_output.pop(owner, None) == int(round(size_bytes)):
                self._rename_last(owner)  # the output becomes the sharded gradient: one buffer
            else:
                self._free_rs_output(owner)
                self._emit(ALLOC, SHARDED_GRAD, owner, size_bytes)
        elif kind in _KINDS and (kind is not COMM_BUFFERS or stream is ON_DEFAULT):
            self._emit(ALLOC, _KINDS[kind], owner, size_bytes)

    def on_free(self, kind: Kind, size_bytes: float, owner: str, stream: Stream) -> None:
        if kind is ACTIVATIONS:
            self._activations -= size_bytes
        elif kind is GRADS and stream is ON_DEFAULT:
            self._grads -= size_bytes
        elif kind is GRADS and stream is ON_REDUCE_SCATTER:
            self._emit(FREE, SHARDED_GRAD, owner, size_bytes)
        elif kind in _KINDS and (kind is not COMM_BUFFERS or stream is ON_DEFAULT):
            self._emit(FREE, _KINDS[kind], owner, size_bytes)

    def on_mark(self, what: str, who: str, phase: Phase, temp_bytes: float, comm_bytes: float,
                stream: Stream) -> None:
        if what == "all-gather" and self._pending:  # the cast copy ([Note: What the walk models ...])
            i = self._pending[-1]
            self.events[i] = replace(self.events[i], scratch_bytes=int(round(temp_bytes)))
        level = int(round(self._activations))
        for i in self._pending:
            self.events[i] = replace(self.events[i], phase=str(phase), activation_bytes=level)
        self._pending = []
        if what == "reduce-scatter" and comm_bytes:
            self._emit(ALLOC, RS_OUTPUT, who, comm_bytes)
            self._rs_output[who] = int(round(comm_bytes))
            self._pending[-1:] = []
            self.events[-1] = replace(self.events[-1], phase=str(phase), activation_bytes=level)

    def _rename_last(self, owner: str) -> None:
        for i in range(len(self.events) - 1, -1, -1):
            e = self.events[i]
            if e.kind == RS_OUTPUT and e.unit == owner:
                self.events[i] = replace(e, kind=SHARDED_GRAD)
                return

    def _free_rs_output(self, owner: str) -> None:
        """A reduce-scatter output that is not the sharded gradient (cast to another dtype) is freed."""
        for e in reversed(self.events):
            if e.kind == RS_OUTPUT and e.unit == owner and e.op == ALLOC:
                self._emit(FREE, RS_OUTPUT, owner, e.size_bytes)
                return


_KINDS = {ALL_GATHER_OUTPUT: AG_OUTPUT, UNSHARDED_PARAMS: UNSHARDED, COMM_BUFFERS: RS_INPUT}


def walk_sequence(cost_model, plan) -> list[SeqEvent]:
    """The one-for-one events of ``plan``'s memory walk (``CostModel.walk_memory``), in canonical order."""
    seq = WalkSequence()
    cost_model.walk_memory(plan, (seq,))
    return canonical(seq.events)


def canonical(events: list[SeqEvent]) -> list[SeqEvent]:
    """``events`` with each run of consecutive sharded-gradient frees sorted by unit ([Note: What the walk
    models one for one]: ``zero_grad`` frees them in an order that holds no memory)."""
    out: list[SeqEvent] = []
    run: list[SeqEvent] = []
    for e in [*events, None]:
        if e is not None and e.op == FREE and e.kind == SHARDED_GRAD:
            run.append(e)
            continue
        out.extend(sorted(run, key=lambda x: x.unit))
        run = []
        if e is not None:
            out.append(e)
    return out


@dataclass(frozen=True)
class SequenceCheck:
    """A real sequence against a simulated one (:func:`compare_sequences`).

    ``events_matched``: the leading events equal one for one (op, kind, unit, bytes, phase, input copy);
    ``first_mismatch`` the first that is not (None: all are). Over the matched events: ``grad_mismatches``
    counts those whose live gradient bytes differ (``first_grad_mismatch`` the first); the activations'
    worst error is relative to the walk's largest level in the step ([Note: Activation tolerance])."""

    events_compared: int
    events_matched: int
    first_mismatch: str | None
    grad_mismatches: int
    first_grad_mismatch: str | None
    activation_worst_error: float
    activation_worst_at: str

    def failures(self) -> frozenset[str]:
        """Which of "buffers", "grads", "activations" do not match."""
        return frozenset(name for name, bad in (
            ("buffers", self.first_mismatch is not None), ("grads", self.grad_mismatches > 0),
            ("activations", self.activation_worst_error > ACTIVATION_TOLERANCE)) if bad)


def compare_sequences(real: list[SeqEvent], simulated: list[SeqEvent]) -> SequenceCheck:
    """Compare two canonical sequences (:func:`canonical`) event by event; see the module docstring."""
    n = max(len(real), len(simulated))
    mismatch, matched = None, 0
    grad_mismatches, first_grad = 0, None
    scale = max([e.activation_bytes for e in simulated] + [ACTIVATION_FLOOR_BYTES])
    worst, worst_at = 0.0, ""
    for i in range(n):
        r = real[i] if i < len(real) else None
        s = simulated[i] if i < len(simulated) else None
        if r is None or s is None or r.key() != s.key():
            mismatch = (f"event {i}: real {r.describe() if r else '(none: the real step ends)'}; "
                        f"simulated {s.describe() if s else '(none: the walk ends)'}")
            break
        matched += 1
        if r.grad_bytes != s.grad_bytes:
            grad_mismatches += 1
            first_grad = first_grad or f"event {i}: real {r.describe()}; simulated {s.describe()}"
        err = abs(r.activation_bytes - s.activation_bytes) / scale
        if err > worst:
            worst, worst_at = err, f"event {i}: {s.describe()}; real activations {r.activation_bytes} B"
    return SequenceCheck(n, matched, mismatch, grad_mismatches, first_grad, worst, worst_at)
