"""Kernel records: each aten op of a traced step as a kernel class, the shape that decides its speed, and
the bytes it moves; then, per module, compact records fitted over the two traced batch sizes.

[Note: kernel records] The cost model prices compute per kernel (shard_planner/cost/kernels.py):
a matmul's speed depends on (M, N, K) and its operands' layout, FlashAttention's on (batch x heads,
sequence, head dim, causal), a convolution's on its direction, everything else on the bytes it reads
and writes. The tracer hands every op to
:func:`classify` (inside its dispatch mode, where the fake tensors' sizes are known) and keeps, per
module call and phase, the sequence of :class:`OpSample`. Both traced batch sizes run the same code, so
their sequences pair up op by op; :func:`fit_records` aggregates the pairs by (class, shape at b1,
shape at b2) into :class:`~shard_planner.trace.types.KernelRecord` whose FLOPs, bytes and dimensions
are affine in the micro-batch (a token dimension is b x seq, a weight dimension fixed; a matmul's
layout code is the larger batch's). Views and
allocations run no kernel and are not recorded (they still count as aten ops for the per-op host
overhead).

[Note: copies only one batch size runs] "The same code" can still run different ops: ``x.contiguous()``
(and ``reshape``) copies a strided view only when it is not already contiguous, and at batch 1 a slice
along the sequence of a (1, T + 1) tensor is (a size-1 dimension's stride does not count). transformers'
causal-LM loss (``ForCausalLMLoss``: ``labels[..., 1:].contiguous()``) runs a ``clone`` at batch 2 that
batch 1 skips; before this rule the two sequences did not pair and the whole module, the root with the
fp32 cast, ``_log_softmax`` and ``nll_loss_forward`` of every logit, got no records (priced from its 0
FLOPs). So sequences that differ only by copies are aligned (difflib's longest matching blocks, on the
class, the op's name and the number of dimensions); the ops both run pair as above, and each copy only one batch size
runs is a record proportional to the micro-batch through that size (a copy of a (b, T) tensor:
bytes(b) = bytes at b_i x b / b_i). Sequences that differ by anything else (a model whose ops depend on
the batch size) still give no records.
"""

from __future__ import annotations

import logging
from difflib import SequenceMatcher
from typing import NamedTuple

import torch
from torch.utils._pytree import tree_leaves

from shard_planner.trace.types import Affine, KernelRecord

logger = logging.getLogger(__name__)

aten = torch.ops.aten

MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "addbmm"}
GROUPED_OPS = {"_grouped_mm", "_scaled_grouped_mm"}
ATTENTION_FWD_OPS = {
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward", "_efficient_attention_forward",
}
ATTENTION_BWD_OPS = {name + "_backward" for name in ATTENTION_FWD_OPS}
# conv1d/2d/3d and conv_transpose* decompose to ``convolution`` above the dispatcher: not listed
CONV_FWD_OPS = {"convolution", "_convolution", "cudnn_convolution", "cudnn_convolution_transpose", "mkldnn_convolution",
                "_slow_conv2d_forward", "slow_conv3d_forward", "slow_conv_transpose2d", "slow_conv_transpose3d"}
CONV_BWD_OPS = {"convolution_backward", "_slow_conv2d_backward", "mkldnn_convolution_backward"}
REDUCTION_OPS = {
    "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data", "sum", "mean", "amax",
    "amin", "max", "min", "var", "var_mean", "std", "norm", "linalg_vector_norm", "logsumexp", "cumsum",
    "argmax", "argmin", "all", "any", "prod",
}
LOSS_OPS = {"nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward", "mse_loss",
            "mse_loss_backward", "binary_cross_entropy", "binary_cross_entropy_backward",
            "binary_cross_entropy_with_logits", "smooth_l1_loss", "smooth_l1_loss_backward", "huber_loss"}
COPY_OPS = {"_to_copy", "copy_", "clone", "contiguous", "cat", "stack", "_copy_from", "constant_pad_nd",
            "repeat", "expand_copy", "_copy_from_and_resize", "lift_fresh_copy", "roll", "flip"}
EMBEDDING_OPS = {"embedding", "embedding_dense_backward", "index_select", "index", "index_put", "index_put_",
                 "_index_put_impl_", "index_add", "index_add_", "gather", "scatter", "scatter_add", "scatter_add_",
                 "take", "_embedding_bag", "_embedding_bag_backward", "_embedding_bag_dense_backward"}
# Ops that alias or allocate without a kernel (views are recognised by their schema: OpOverload.is_view).
NO_KERNEL_OPS = {"_unsafe_view", "detach", "alias", "lift_fresh", "_reshape_alias", "as_strided", "empty",
                 "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_",
                 "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"}


# Op name sets by kernel class, in the order they are tried (the rest: "elementwise").
_CLASS_OF_NAMES = (("matmul", MATMUL_OPS), ("grouped_matmul", GROUPED_OPS), ("attention_fwd", ATTENTION_FWD_OPS),
                   ("attention_bwd", ATTENTION_BWD_OPS), ("conv_fwd", CONV_FWD_OPS), ("conv_bwd", CONV_BWD_OPS),
                   ("reduction", REDUCTION_OPS), ("loss", LOSS_OPS),
                   ("copy", COPY_OPS), ("embedding", EMBEDDING_OPS))


class OpSample(NamedTuple):
    """One kernel as traced at one batch size."""

    op_class: str
    dims: tuple[int, ...]
    flops: int
    bytes: int
    new_bytes: int = 0  # storages its outputs newly allocate (forward ops; selective checkpointing)
    op: str = ""  # the aten op's name: which copy is which ([Note: copies only one batch size runs])


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))


def _arg(func, args, kwargs, name: str, default=None):
    """The value of argument ``name`` of ``func`` as called (positional or keyword)."""
    if name in kwargs:
        return kwargs[name]
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) and not a.kwarg_only else default
    return default


def _column_major(x: torch.Tensor) -> bool:
    """Whether matrix operand ``x`` (..., rows, cols) is stored with its rows dimension contiguous and
    its columns not. Anything else runs row-major: a row-major operand, a size-1 column dimension, and
    an operand with neither dimension contiguous (the CPU GEMM copies it row-major first: ATen
    native/LinearAlgebra.cpp addmm_impl_cpu_)."""
    return x.stride(-2) == 1 and x.stride(-1) != 1 and x.shape[-1] != 1


def matmul_layout(a: torch.Tensor, b: torch.Tensor) -> int:
    """The operand layout of C = A @ B with A (M, K) and B (K, N) ([Note: matmul layouts]):
    2 x (A M-contiguous) + (B N-contiguous): 0 "kk" (x @ W^T, a Linear's forward), 1 "kn" (both
    row-major: the input gradient dY @ W), 2 "mk", 3 "mn" (dY^T @ X, the weight gradient)."""
    return 2 * _column_major(a) + (not _column_major(b))


def _matmul_dims(name: str, args) -> tuple[int, ...]:
    """(batch, M, N, K, layout) of mm / addmm / bmm / baddbmm (/ _scaled_mm: mm's layout)."""
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm", "addbmm") else (args[0], args[1])
    layout = matmul_layout(a, b)
    if a.dim() == 3 and name != "addbmm":
        return int(a.shape[0]), int(a.shape[1]), int(b.shape[-1]), int(a.shape[2]), layout
    if a.dim() == 3:  # addbmm: a sum over the batch of (M, K) x (K, N)
        return 1, int(a.shape[1]), int(b.shape[-1]), int(a.shape[0] * a.shape[2]), layout
    return 1, int(a.shape[0]), int(b.shape[1]), int(a.shape[1]), layout


def grouped_mm_dims(a: torch.Tensor, b: torch.Tensor) -> tuple[int, ...]:
    """(groups, M per group, N, K per group) of ``_grouped_mm(a, b, offs)``: a (T, K) x b (G, K, N) routes
    T rows to G experts; (G, M, K) x (G, K, N) is batched; a (M, T) x b (T, N) with offsets over T gives
    the per-expert weight gradients (G, M, N)."""
    if a.dim() == 2 and b.dim() == 3:
        g = int(b.shape[0])
        return g, max(1, round(a.shape[0] / g)), int(b.shape[2]), int(a.shape[1])
    if a.dim() == 3 and b.dim() == 3:
        return int(a.shape[0]), int(a.shape[1]), int(b.shape[2]), int(a.shape[2])
    if a.dim() == 3:  # (G, M, K) x (K, T) with offsets over T
        return int(a.shape[0]), int(a.shape[1]), max(1, round(b.shape[1] / a.shape[0])), int(a.shape[2])
    return 1, int(a.shape[0]), int(b.shape[1]), int(a.shape[1])


def grouped_mm_flop(a_shape, b_shape, out_shape) -> int:
    """FLOPs of ``_grouped_mm``: 2 x output elements x the reduction length of each (FlopCounterMode has
    no formula: torch/utils/flop_counter.py registers mm/addmm/bmm/baddbmm only)."""
    if len(a_shape) == 2 and len(b_shape) == 2:  # (M, T) x (T, N), offsets split T among the groups
        return 2 * a_shape[0] * b_shape[1] * a_shape[1]
    n_out = 1
    for s in out_shape:
        n_out *= s
    return 2 * n_out * a_shape[-1]


def _attention_dims(func, name: str, args, kwargs) -> tuple[int, ...]:
    """(batch x heads, seq_q, seq_k, head_dim, causal) from query (B, H, S_q, D) and key (B, H_kv, S_k, D)."""
    q, k = (args[1], args[2]) if name.endswith("_backward") else (args[0], args[1])
    causal = bool(_arg(func, args, kwargs, "is_causal", False))
    if name in ("_flash_attention_forward", "_flash_attention_backward",
                "_efficient_attention_forward", "_efficient_attention_backward"):  # (B, S, H, D) layout
        return int(q.shape[0] * q.shape[2]), int(q.shape[1]), int(k.shape[1]), int(q.shape[3]), int(causal)
    return int(q.shape[0] * q.shape[1]), int(q.shape[2]), int(k.shape[2]), int(q.shape[3]), int(causal)


def op_names_of_class(op_class_name: str) -> frozenset[str]:
    """The aten op names (overload packets) of a kernel class; empty for "elementwise" (every op no set
    names) and any class without a fixed list."""
    return frozenset(next((names for cls, names in _CLASS_OF_NAMES if cls == op_class_name), ()))


def op_class(func, out) -> str | None:
    """The kernel class of aten op ``func`` (cost/kernels.py OP_CLASSES), or None when it runs no kernel
    (views, allocations, metadata). The one classification: :func:`classify` prices by it and the
    executor's selective checkpointing policy (execute/apply.py) saves by it."""
    if func.namespace == "prim" or getattr(func, "is_view", False):
        return None
    name = func._overloadpacket.__name__
    if name in NO_KERNEL_OPS:
        return None
    for cls, names in _CLASS_OF_NAMES:
        if name in names:
            return cls
    if not any(isinstance(t, torch.Tensor) for t in tree_leaves(out)):
        return None
    return "elementwise"


def classify(func, args, kwargs, out, flops: int, new_bytes: int = 0) -> OpSample | None:
    """The kernel ``func(*args, **kwargs) -> out`` runs, or None when it runs none (views, allocations,
    metadata). Bytes: every tensor argument read plus every tensor output written; ``new_bytes``: the
    storages its outputs newly allocate (what selective checkpointing keeps when the class is saved)."""
    cls = op_class(func, out)
    if cls is None:
        return None
    moved = _nbytes(args) + _nbytes(kwargs) + _nbytes(out)
    name = func._overloadpacket.__name__
    if cls == "matmul":
        dims = _matmul_dims(name, args)
    elif cls == "grouped_matmul":
        dims = grouped_mm_dims(args[0], args[1])
    elif cls in ("attention_fwd", "attention_bwd"):
        dims = _attention_dims(func, name, args, kwargs)
    else:
        dims = ()
    return OpSample(cls, dims, flops, moved, new_bytes, name)


def _aligned(seq1: list[OpSample], seq2: list[OpSample]):
    """The op pairs of two sequences that differ at most by copies only one of them runs, and those copies
    each with the index of its sequence ([Note: copies only one batch size runs]); None when they differ
    by any other op."""
    if len(seq1) == len(seq2) and all(x.op_class == y.op_class and len(x.dims) == len(y.dims)
                                      for x, y in zip(seq1, seq2)):
        return list(zip(seq1, seq2)), []
    keys1, keys2 = [(x.op_class, x.op, len(x.dims)) for x in seq1], [(y.op_class, y.op, len(y.dims)) for y in seq2]
    pairs, used1, used2 = [], set(), set()
    for blk in SequenceMatcher(None, keys1, keys2, autojunk=False).get_matching_blocks():
        pairs += [(seq1[blk.a + i], seq2[blk.b + i]) for i in range(blk.size)]
        used1.update(range(blk.a, blk.a + blk.size))
        used2.update(range(blk.b, blk.b + blk.size))
    lone = ([(0, x) for i, x in enumerate(seq1) if i not in used1]
            + [(1, y) for i, y in enumerate(seq2) if i not in used2])
    if any(x.op_class != "copy" for _, x in lone):
        return None
    return pairs, lone


def fit_records(seq1: list[OpSample], seq2: list[OpSample], b1: int, b2: int) -> tuple[KernelRecord, ...]:
    """Pair the kernels of one module and phase at batch sizes b1 and b2 op by op and aggregate them by
    (class, shape at b1, shape at b2) ([Note: kernel records]); a copy only one batch size runs is its own
    record, proportional to the batch ([Note: copies only one batch size runs]). Sequences that differ by
    other ops (a model whose ops depend on the batch size) give no records: the block is then priced
    from its FLOPs."""
    aligned = _aligned(seq1, seq2)
    if aligned is None:
        logger.debug("kernel sequences differ between batch sizes %d and %d (%d vs %d ops): no records",
                     b1, b2, len(seq1), len(seq2))
        return ()
    pairs, lone = aligned
    groups: dict[tuple, list] = {}
    for x, y in pairs:
        g = groups.setdefault((x.op_class, x.dims, y.dims), [0, 0, 0, 0, 0, 0, 0])
        g[0] += 1
        g[1] += x.flops
        g[2] += y.flops
        g[3] += x.bytes
        g[4] += y.bytes
        g[5] += x.new_bytes
        g[6] += y.new_bytes
    out = []
    for (op_class, d1, d2), (count, f1, f2, m1, m2, n1, n2) in groups.items():
        dims = tuple(Affine.fit(b1, float(u), b2, float(v)) for u, v in zip(d1, d2))
        if op_class == "matmul" and len(d2) == 5:
            # the layout is a code, not a size: the larger batch's (at batch 1 a size-1 dimension's
            # stride is arbitrary, so the smaller batch's layout can differ)
            dims = dims[:4] + (Affine(float(d2[4]), 0.0),)
        out.append(KernelRecord(op_class, count, Affine.fit(b1, float(f1), b2, float(f2)),
                                Affine.fit(b1, float(m1), b2, float(m2)), dims,
                                Affine.fit(b1, float(n1), b2, float(n2))))
    for which, x in lone:  # a copy of a (b, ...) tensor: through the origin ([Note: copies only one ...])
        b = (b1, b2)[which]
        out.append(KernelRecord(x.op_class, 1, Affine(0.0, x.flops / b), Affine(0.0, x.bytes / b), (),
                                Affine(0.0, x.new_bytes / b)))
    return tuple(out)
