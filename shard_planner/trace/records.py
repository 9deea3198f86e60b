"""The tracer's per-step records: calls and their spans in the event log, saves, per-module numbers.

Plain data, shared by capture (which fills them in), twins (which copy a template's) and replay (which
turns them into per-module numbers). Fully qualified names are relative to a base module with
:func:`rel_fqn` / :func:`join_fqn`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Kinds of events in the step's log (StorageLog.events): (ALLOC | FREE | RESIZE, sid, bytes delta) and
# (ENTER | EXIT, span). Tuples, not objects: a step logs hundreds of thousands of them.
ALLOC, FREE, RESIZE, ENTER, EXIT = range(5)


@dataclass(slots=True, eq=False)
class Span:
    """A forward (``kind == "fwd"``) or backward stretch of one call, as positions in the event log.

    ``end`` is -1 while open; ``start`` moves when a parent's backward span is inserted before it.
    """

    call: Call
    kind: str
    start: int
    end: int = -1


@dataclass(slots=True, eq=False)
class Call:
    """One forward call of a module (``fqn``), or of the loss function (``fqn is None``)."""

    fqn: str | None
    parent: Call | None
    children: list[Call] = field(default_factory=list)
    fwd: Span | None = None
    bwd: Span | None = None
    bwd_open: bool = False
    template: Call | None = None  # set for a twin: the call whose numbers it reuses
    twin_info: object | None = None  # set for a call that can serve as a template (twins.TwinInfo)
    saved_bytes: int = 0
    forward_grad_bytes: int = 0  # of saved_bytes, parameter gradients made in forward (ModuleTrace.forward_grad_bytes)
    fwd_flops: int = 0
    bwd_flops: int = 0
    input_bytes: int = 0
    input_shared_bytes: int = 0  # of input_bytes, storages already held (ModuleTrace.input_shared_bytes)
    input_grad: bool = False  # whether a tensor input requires grad (ModuleTrace.input_requires_grad)
    output_bytes: int = 0
    fwd_ops: int = 0  # aten ops dispatched by its own code (per-op overhead)
    bwd_ops: int = 0
    # its own code's kernels in dispatch order (kernel_ops.OpSample; [Note: kernel records])
    fwd_kernels: list = field(default_factory=list)
    bwd_kernels: list = field(default_factory=list)
    # its subtree's forward kernels dispatched after the last tensor its subtree saved for backward: what a
    # checkpointed recomputation of it does not run ([Note: Early stop of the recomputation] in capture.py)
    fwd_tail: list = field(default_factory=list)
    in_sids: frozenset = frozenset()  # the storages of its inputs
    # of output_bytes, the storages an op of its own forward (children included) allocated, by kernel
    # class (what selective checkpointing stores and the next block holds too: cost/selective.py)
    output_by_class: dict = field(default_factory=dict)
    save_adjust: list[tuple[str, int]] = field(default_factory=list)  # (path relative to the twin, bytes)
    input_sids: frozenset = frozenset()  # for a template: the storages of its inputs
    param_ids: frozenset = frozenset()  # for a template: ids of its subtree's parameters
    tp_collectives: list = field(default_factory=list)  # tp_local.Collective its tensor-parallel style issued


@dataclass(frozen=True, slots=True)
class SaveAttempt:
    """A tensor saved for backward: at log position ``pos``, by ``call`` (or, in a twin, by the module
    at path ``rel`` below it); ``counted`` when this was the storage's first save, of ``nbytes``."""

    pos: int
    call: Call
    rel: str
    counted: bool
    nbytes: int


@dataclass(slots=True)
class ModuleRecord:
    """One call's numbers for one module (a twin's are copied from its template, remapped), or their
    sum over a module's calls. ``fwd_key``/``bwd_key`` order modules by first entry (see replay)."""

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
    fwd_kernels: list = field(default_factory=list)  # kernel_ops.OpSample, in dispatch order over its calls
    bwd_kernels: list = field(default_factory=list)
    output_by_class: dict = field(default_factory=dict)  # Call.output_by_class, summed over its calls
    fwd_tail_kernels: list = field(default_factory=list)  # Call.fwd_tail, over its calls
    input_grad: bool = False  # Call.input_grad, of any of its calls
    tp_collectives: list = field(default_factory=list)  # Call.tp_collectives, over its calls
    held: int = 0  # bytes the forward's output held until dropped (trace/held.py), over its calls
    fwd_tail_rise: int = 0  # ModuleTrace.fwd_tail_rise_bytes: the largest over its calls
    bwd_head_rise: int = 0  # ModuleTrace.bwd_head_rise_bytes: the largest over its calls
    forward_grad: int = 0  # Call.forward_grad_bytes, over its calls


@dataclass(frozen=True)
class StepResult:
    """What one traced batch size yields, before fitting."""

    per_module: dict[str, ModuleRecord]
    forward_order: tuple[str, ...]
    backward_order: tuple[str, ...]
    batch_input_bytes: int
    loss_saved_bytes: int
    loss_peak_rise_bytes: int
    loss_flops: int
    reused_modules: int
    loss_ops: int = 0
    loss_kernels: tuple = ()  # kernel_ops.OpSample of loss_fn, forward then backward
    forward_cache: str | None = None  # trace/cache.py output_cache of the forward's output
    loss_tp_collectives: tuple = ()  # tp_local.Collective of the loss (loss parallelism)


def rel_fqn(fqn: str, base: str) -> str:
    """``fqn`` relative to ``base`` (``""`` for ``base`` itself)."""
    return "" if fqn == base else (fqn if base == "" else fqn[len(base) + 1 :])


def join_fqn(base: str, rel: str) -> str:
    """The fqn of the module at path ``rel`` below ``base``."""
    return base if not rel else (rel if not base else f"{base}.{rel}")


def is_under(fqn: str, base: str) -> bool:
    """Whether ``fqn`` is ``base`` or in its subtree."""
    return fqn == base or base == "" or fqn.startswith(base + ".")


def is_ancestor(a: Call, call: Call) -> bool:
    """Whether call ``a`` encloses ``call`` (strictly)."""
    c = call.parent
    while c is not None:
        if c is a:
            return True
        c = c.parent
    return False
