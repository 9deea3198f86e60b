"""ModelTrace: what the planner knows about a model, measured once without GPUs or real memory.

Quantities that depend on the micro-batch are :class:`Affine` in the batch size, fitted from two
traced batch sizes, so later stages vary the micro-batch without re-tracing. Per-module quantities
named ``*_self`` belong to the module's own operations (not its children's): a subtree total is the sum
over the subtree (:func:`ModelTrace.subtree`). Peaks (``*_peak_rise_bytes``) include the children,
since a peak does not add up.

All byte counts are per rank, for one micro-batch, in the trace's compute dtype, for the *unsharded*
model: the cost model applies sharding, mixed precision and checkpointing on top. A trace at a
tensor-parallel degree (``tp_size`` > 1) is one rank's: parameters as split, activations and FLOPs of the
rank's local tensors, and the tensor-parallel collectives each module issues (``tp_collectives``;
trace/tp_local.py, [Note: A tensor-parallel rank traced locally]).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import cached_property

from shard_planner.parallel.tensor_parallel import TensorParallel

TRACE_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Affine:
    """A quantity linear in the micro-batch: ``value(b) = fixed + per_sample * b``."""

    fixed: float = 0.0
    per_sample: float = 0.0

    def at(self, batch_size: int) -> float:
        return self.fixed + self.per_sample * batch_size

    @staticmethod
    def fit(b1: int, v1: float, b2: int, v2: float) -> "Affine":
        """The line through (b1, v1) and (b2, v2); b1 != b2."""
        per_sample = (v2 - v1) / (b2 - b1)
        return Affine(fixed=v1 - per_sample * b1, per_sample=per_sample)

    def __add__(self, other: "Affine") -> "Affine":
        return Affine(self.fixed + other.fixed, self.per_sample + other.per_sample)

    def scaled(self, factor: float) -> "Affine":
        return Affine(self.fixed * factor, self.per_sample * factor)


ZERO = Affine()


@dataclass(frozen=True)
class KernelRecord:
    """Identical kernels of one module's forward or backward, per micro-batch (trace/kernel_ops.py,
    [Note: kernel records]): ``count`` launches of class ``op_class`` (cost/kernels.py OP_CLASSES),
    their total FLOPs and bytes read + written, and the dimensions that decide their speed — matmul
    (batch, M, N, K, layout: cost/kernels.py [Note: matmul layouts]; traces written before it have 4), attention (batch x heads, seq_q, seq_k, head_dim, causal), none otherwise — each
    affine in the micro-batch. ``new_bytes``: the storages their outputs newly allocate, deduplicated
    (a forward op's are what selective activation checkpointing keeps when its class is saved:
    cost/selective.py); None in traces written before it."""

    op_class: str
    count: int
    flops: Affine
    bytes: Affine
    dims: tuple[Affine, ...] = ()
    new_bytes: Affine | None = None

    def dims_at(self, batch_size: int) -> tuple[int, ...]:
        return tuple(max(0, round(d.at(batch_size))) for d in self.dims)

    @staticmethod
    def from_dict(d: dict) -> "KernelRecord":
        new = d.get("new_bytes")
        return KernelRecord(d["op_class"], int(d["count"]), Affine(**d["flops"]), Affine(**d["bytes"]),
                            tuple(Affine(**x) for x in d.get("dims", ())), Affine(**new) if new is not None else None)


@dataclass(frozen=True)
class TPCollective:
    """One tensor-parallel collective over the tp group, per micro-batch: ``kind`` "all_gather" |
    "reduce_scatter" | "all_reduce", in ``phase`` "fwd" | "bwd"; ``full_bytes``: the full tensor of the
    collective on one rank (the all-gather's output, the reduce-scatter's input, the all-reduce's buffer),
    affine in the micro-batch (a parameter gradient's all-reduce: fixed)."""

    kind: str
    phase: str
    full_bytes: Affine

    @staticmethod
    def from_dict(d: dict) -> "TPCollective":
        return TPCollective(d["kind"], d["phase"], Affine(**d["full_bytes"]))


@dataclass(frozen=True)
class ModuleTrace:
    """One module (by fully qualified name; the root is ``""``)."""

    fqn: str
    type_name: str  # class name, e.g. "TransformerBlock"
    parent: str | None  # None for the root
    children: tuple[str, ...]  # direct children, in registration order
    structural_hash: str  # equal for structurally identical modules (same classes, shapes, dtypes)
    # Parameters registered directly on this module (recurse=False). A parameter shared by several
    # modules (tied weights) is counted once, at the first module that registers it.
    param_count: int
    param_bytes_by_dtype: dict[str, int]  # dtype name ("float32") -> bytes, as built
    buffer_bytes: int  # buffers registered directly on this module
    calls: int  # forward calls in one step (0: never called, e.g. an unused module)
    # Per micro-batch, in the compute dtype (Affine in the batch size):
    input_bytes: Affine  # tensor inputs of its forward (what a checkpointed unit keeps)
    output_bytes: Affine  # tensor outputs of its forward
    saved_bytes_self: Affine  # tensors saved for backward by its own ops, deduplicated by storage
    fwd_flops_self: Affine
    bwd_flops_self: Affine
    # Largest rise of live non-parameter bytes above the level at its entry, children included:
    fwd_peak_rise_bytes: Affine  # during its forward (what it saves and outputs counts)
    bwd_peak_rise_bytes: Affine  # during its backward (parameter gradients excluded)
    # aten ops its own code dispatches in one step (its calls together), forward and backward: the
    # per-op framework overhead (dispatcher, kernel launch) the time model adds. Not batch-dependent.
    # Defaults: traces written before op counting load with none.
    fwd_ops_self: int = 0
    bwd_ops_self: int = 0
    param_tensors: int = 0  # parameter tensors registered directly (counted like param_count; optimizer overhead)
    # Other modules that register one of this module's own Parameter objects directly (tied weights,
    # e.g. GPT-2's lm_head.weight is wte.weight): FSDP2 needs all of them in one unit. Traces written
    # before this field load with none.
    tied_with: tuple[str, ...] = ()
    # Of ``input_bytes``, the storages someone else already holds when the module is called: the batch,
    # or an input of an earlier-called module that is not its ancestor (a U-Net skip connection: a down
    # block's output is the next block's input and later the matching up block's; an encoder output
    # every decoder block takes). A checkpointed unit keeps only the rest as new bytes (memory.py,
    # [Note: Checkpointed inputs held elsewhere]). Traces written before this field load with none.
    input_shared_bytes: Affine = ZERO
    # Of ``saved_bytes_self``, the gradients of parameters its own ops compute in forward and save, which
    # backward hands to autograd as they are (the parameter's gradient is that storage: no new bytes in
    # backward): a fused output layer and loss (model/loss.py). Traces written before this field: none.
    forward_grad_bytes: Affine = ZERO
    # Storages its own forward ops allocated that the forward's output holds beyond its tensors (a KV cache)
    # until it is dropped after the loss: trace/held.py. Traces written before this field load with none.
    held_bytes_self: Affine = ZERO
    # The highest level of live non-parameter bytes while its own code runs after its last child returned,
    # above the level at its entry (0 without children): what a container's own code reaches, e.g. a
    # loss computed inside the root's forward with its decoder's output still held (cost/memory.py,
    # [Note: A container's own code]). Traces written before this field load with none.
    fwd_tail_rise_bytes: Affine = ZERO
    # The mirror in backward: the highest level while its own code's backward runs before the first of its
    # children's backward begins, above the level at its backward's entry (0 without children), e.g. the
    # backward of that loss (cost/memory.py, [Note: A container's own code]). Traces written before this field
    # load with none.
    bwd_head_rise_bytes: Affine = ZERO
    # The kernels of its own forward and backward (trace/kernel_ops.py, [Note: kernel records]), for the
    # GPU kernel model (cost/kernels.py). Traces written before them load with none (priced from FLOPs).
    fwd_kernels: tuple[KernelRecord, ...] = ()
    bwd_kernels: tuple[KernelRecord, ...] = ()
    # Of its subtree's forward kernels, those after the last tensor the subtree saves for backward: a
    # checkpointed recomputation stops before them (trace/capture.py [Note: Early stop of the
    # recomputation]). Traces written before this field load with none (the whole forward recomputed).
    fwd_tail_kernels: tuple[KernelRecord, ...] = ()
    # Of ``param_bytes_by_dtype``, the 0-d parameters (CLIP's ``logit_scale``): FSDP2 cannot shard them,
    # so apply_plan replicates them on every rank (execute/apply.py, [Note: 0-d parameters]) and the cost
    # model holds them whole. Traces written before this field load with none.
    scalar_param_bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    # Of ``output_bytes``, the storages ops of its forward (children included) allocated, by kernel class
    # (trace/kernel_ops.py): selective checkpointing stores them and the next module holds them too
    # (cost/selective.py). Traces written before this field load with none.
    output_bytes_by_class: dict[str, Affine] = field(default_factory=dict)
    # Of its own parameters (``param_count``, ``param_tensors``, ``param_bytes_by_dtype``, and of the 0-d ones
    # ``scalar_param_bytes_by_dtype``), those frozen as built (``requires_grad`` False: a fine-tune's base
    # weights). FSDP2 all-gathers them like the others, but they get no gradient, no reduce-scatter and no
    # optimizer state (docs/frozen_facts.md); the ``trainable_*`` properties are the rest. Traces written
    # before these fields load with none frozen: every parameter trains, as those traces assumed.
    frozen_param_count: int = 0
    frozen_param_tensors: int = 0
    frozen_param_bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    frozen_scalar_param_bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    # Whether a tensor input of its forward requires grad (in any call). FSDP2 runs a unit's post-backward
    # (reshard, reduce-scatter) from autograd when its inputs' gradients are computed, and only if some input
    # requires grad; otherwise in the root's final callback, after the whole backward (docs/frozen_facts.md,
    # [Note: Post-backward without an input that requires grad]): the first block after a frozen embedding.
    # Whether an output requires grad (FSDP2's pre-backward hook) is whether the module is in the trace's
    # ``backward_order``. None in traces written before this field.
    input_requires_grad: bool | None = None
    # Of ``param_bytes_by_dtype`` (and of its sharded and 0-d parts alike), what quantised weights store: an NF4
    # weight's codes, scalers, factors, mean and code table (shard_planner/model/param_storage.py, [Note: NF4
    # parameters as stored]). FSDP2 gathers them through the tensor's own fsdp_pre_all_gather, which mixed
    # precision does not cast, floating parts (the factors) included; they never train. Traces written
    # before this field load with none.
    quantized_param_bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    # The tensor-parallel collectives its style issues (trace/tp_local.py, [Note: The collectives torch 2.13
    # issues per style]), in the order they ran; none at tp_size 1 and in traces written before them.
    tp_collectives: tuple[TPCollective, ...] = ()
    # Of its own parameters, each plain tensor FSDP2 shards on dim 0 (not 0-d, not a quantised weight's
    # part) as (dim0, numel, dtype as built, trainable): the cost model pads its shard to ceil(dim0 / N)
    # rows as FSDP2 does (cost/fsdp2_rules.py [Note: Dim-0 padding]). Traces written before this field
    # load with none (sharded sizes unpadded: numel / N).
    sharded_param_shapes: tuple[tuple[int, int, str, bool], ...] = ()

    @property
    def param_bytes(self) -> int:
        return sum(self.param_bytes_by_dtype.values())

    @property
    def trainable_param_count(self) -> int:
        return self.param_count - self.frozen_param_count

    @property
    def trainable_param_tensors(self) -> int:
        return self.param_tensors - self.frozen_param_tensors

    @property
    def trainable_param_bytes_by_dtype(self) -> dict[str, int]:
        """``param_bytes_by_dtype`` less the frozen parameters: what gets gradients and optimizer state."""
        return _less(self.param_bytes_by_dtype, self.frozen_param_bytes_by_dtype)

    @property
    def trainable_param_bytes(self) -> int:
        return self.param_bytes - self.frozen_param_bytes

    @property
    def frozen_param_bytes(self) -> int:
        return sum(self.frozen_param_bytes_by_dtype.values())

    @property
    def trainable_scalar_param_bytes_by_dtype(self) -> dict[str, int]:
        """``scalar_param_bytes_by_dtype`` less the frozen ones: the 0-d parameters whose gradients apply_plan
        all-reduces."""
        return _less(self.scalar_param_bytes_by_dtype, self.frozen_scalar_param_bytes_by_dtype)

    @property
    def trainable_sharded_param_bytes_by_dtype(self) -> dict[str, int]:
        """``sharded_param_bytes_by_dtype`` less the frozen parameters: what FSDP2 reduce-scatters gradients of
        (its sharded gradients and optimizer states are these over the shard group)."""
        return _less(self.trainable_param_bytes_by_dtype, self.trainable_scalar_param_bytes_by_dtype)

    @property
    def sharded_param_bytes_by_dtype(self) -> dict[str, int]:
        """``param_bytes_by_dtype`` without the 0-d parameters: what FSDP2 shards."""
        return _less(self.param_bytes_by_dtype, self.scalar_param_bytes_by_dtype)


@dataclass(frozen=True)
class ModelTrace:
    """Everything the cost model and solver need about one model at one sequence length."""

    model_path: str
    model_class: str
    compute_dtype: str  # "bfloat16" or "float32": dtype of activations in the traced step
    batch_sizes: tuple[int, int]  # the two traced micro-batch sizes the Affines were fitted from
    tokens_per_sample: int | None  # sequence length for token models, None otherwise
    modules: tuple[ModuleTrace, ...]  # in named_modules() order, root first
    forward_order: tuple[str, ...]  # fqns by first forward entry
    backward_order: tuple[str, ...]  # fqns by first backward entry (gradient of an output arrives)
    batch_input_bytes: Affine  # the batch's inputs and targets
    loss_saved_bytes: Affine  # saved by loss_fn (outside every module)
    loss_peak_rise_bytes: Affine  # transient peak of loss_fn forward+backward (e.g. fp32 logits)
    loss_flops: Affine
    fingerprint: str  # trace.structure.model_fingerprint of the model: plans record it, the executor checks it
    trace_seconds: float = 0.0
    reused_modules: int = 0  # modules whose numbers were copied from an identical traced twin
    loss_ops: int = 0  # aten ops of loss_fn, forward and backward (0 in traces older than op counts)
    loss_kernels: tuple[KernelRecord, ...] = ()  # kernels of loss_fn, forward and backward (none in older traces)
    # The model file's TRAINING defaults (micro_batch, seq_len, optimizer, lr), so that planning from a
    # trace.json uses them as planning from the model file does. Traces written before it load with none.
    training: dict = field(default_factory=dict)
    # What the forward's output holds for a later call, e.g. "cache (DynamicCache)": a transformers decoder
    # built with use_cache=True (trace/cache.py, [Note: A forward that builds a cache]); no plan may then
    # checkpoint (shard_planner/plan/checkpointing.py). None: nothing, or a trace written before this field.
    forward_cache: str | None = None
    # The tensor-parallel degree and styles the trace is one rank of (trace/tp_local.py), and the loss's
    # collectives (loss parallelism's all-reduces). 1, None and none: no tensor parallelism, as traces
    # written before them; their JSON then has none of these keys. The degree is a fact of the numbers (as
    # compute_dtype): the plan's layout (parallel/mesh.py Mesh.tp) is derived from it by the planner
    # (solve/context.py PlanContext.layouts) and checked equal to it where both meet (cost/api.py, report).
    tp_size: int = 1
    tensor_parallel: TensorParallel | None = None
    loss_tp_collectives: tuple[TPCollective, ...] = ()
    schema_version: int = TRACE_SCHEMA_VERSION

    @cached_property
    def _by_fqn(self) -> dict[str, ModuleTrace]:
        return {m.fqn: m for m in self.modules}

    def module(self, fqn: str) -> ModuleTrace:
        try:
            return self._by_fqn[fqn]
        except KeyError:
            raise KeyError(f"module {fqn!r} is not in the trace of {self.model_path}") from None

    def __contains__(self, fqn: str) -> bool:
        return fqn in self._by_fqn

    @cached_property
    def _subtrees(self) -> dict[str, tuple[ModuleTrace, ...]]:
        return {}  # filled by subtree(): the cost tables walk the same subtrees for every plan they price

    def subtree(self, fqn: str) -> tuple[ModuleTrace, ...]:
        """The module and all its descendants, in named_modules() order."""
        found = self._subtrees.get(fqn)
        if found is None:
            out, stack = [], [fqn]
            while stack:
                m = self.module(stack.pop())
                out.append(m)
                stack.extend(reversed(m.children))
            found = self._subtrees[fqn] = tuple(out)
        return found

    def subtree_param_count(self, fqn: str) -> int:
        return sum(m.param_count for m in self.subtree(fqn))

    def subtree_param_bytes(self, fqn: str) -> int:
        return sum(m.param_bytes for m in self.subtree(fqn))

    def subtree_sum(self, fqn: str, attr: str) -> Affine:
        """Sum of an Affine ``*_self`` field over the subtree, e.g. ``subtree_sum("layers.0", "fwd_flops_self")``."""
        total = ZERO
        for m in self.subtree(fqn):
            total = total + getattr(m, attr)
        return total

    def subtree_trainable_param_count(self, fqn: str) -> int:
        return sum(m.trainable_param_count for m in self.subtree(fqn))

    def subtree_trainable_param_bytes(self, fqn: str) -> int:
        return sum(m.trainable_param_bytes for m in self.subtree(fqn))

    @property
    def param_count(self) -> int:
        return sum(m.param_count for m in self.modules)

    @property
    def trainable_param_count(self) -> int:
        """Parameters that train (``requires_grad`` as built); ``param_count`` in a trace without frozen ones."""
        return sum(m.trainable_param_count for m in self.modules)

    @property
    def has_frozen_params(self) -> bool:
        """Whether any parameter is frozen (a fine-tune); False in traces written before frozen ones were recorded."""
        return any(m.frozen_param_tensors for m in self.modules)

    # ---- JSON ----
    def to_dict(self) -> dict:
        d = asdict(self)
        if self.tp_size == 1 and self.tensor_parallel is None:  # no tensor parallelism: its JSON as before
            del d["tp_size"], d["tensor_parallel"]
        if not self.loss_tp_collectives:
            del d["loss_tp_collectives"]
        for m in d["modules"]:
            for key in ("tp_collectives", "sharded_param_shapes"):  # none: its JSON as before
                if not m[key]:
                    del m[key]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @staticmethod
    def from_dict(d: dict) -> "ModelTrace":
        from shard_planner.errors import UserError

        if d.get("schema_version") != TRACE_SCHEMA_VERSION:
            raise UserError(
                f"trace schema version {d.get('schema_version')!r} is not {TRACE_SCHEMA_VERSION}: re-run shard-planner trace"
            )
        d = dict(d)
        modules = tuple(_module_from_dict(m) for m in d.pop("modules"))
        affines = {k: Affine(**d.pop(k)) for k in list(d) if isinstance(d[k], dict) and set(d[k]) == {"fixed", "per_sample"}}
        d["loss_kernels"] = tuple(KernelRecord.from_dict(k) for k in d.get("loss_kernels", ()))
        d["loss_tp_collectives"] = tuple(TPCollective.from_dict(c) for c in d.get("loss_tp_collectives", ()))
        if d.get("tensor_parallel") is not None:
            d["tensor_parallel"] = TensorParallel(**d["tensor_parallel"])
        return ModelTrace(
            modules=modules,
            batch_sizes=tuple(d.pop("batch_sizes")),
            forward_order=tuple(d.pop("forward_order")),
            backward_order=tuple(d.pop("backward_order")),
            **affines,
            **d,
        )

    @staticmethod
    def from_json(text: str) -> "ModelTrace":
        return ModelTrace.from_dict(json.loads(text))


def _module_from_dict(d: dict) -> ModuleTrace:
    d = dict(d)
    for k, v in list(d.items()):
        if isinstance(v, dict) and set(v) == {"fixed", "per_sample"}:
            d[k] = Affine(**v)
    d["children"] = tuple(d["children"])
    d["tied_with"] = tuple(d.get("tied_with", ()))
    d["output_bytes_by_class"] = {c: Affine(**v) for c, v in d.get("output_bytes_by_class", {}).items()}
    for key in ("fwd_kernels", "bwd_kernels", "fwd_tail_kernels"):
        d[key] = tuple(KernelRecord.from_dict(k) for k in d.get(key, ()))
    d["tp_collectives"] = tuple(TPCollective.from_dict(c) for c in d.get("tp_collectives", ()))
    d["sharded_param_shapes"] = tuple((int(d0), int(k), str(dt), bool(t))
                                      for d0, k, dt, t in d.get("sharded_param_shapes", ()))
    return ModuleTrace(**d)


def _less(total: dict[str, int], part: dict[str, int]) -> dict[str, int]:
    """``total`` less ``part`` per dtype, without the dtypes left at zero."""
    if not part:
        return total
    out = {dt: nb - part.get(dt, 0) for dt, nb in total.items()}
    return {dt: nb for dt, nb in out.items() if nb}
