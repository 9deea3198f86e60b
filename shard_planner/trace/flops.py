"""FLOP counts per aten op: FlopCounterMode's formulas, plus the kernels it counts as zero.

The tracer counts FLOPs op by op inside its own dispatch mode, so that it can attribute them to the
module whose *own* code ran the op (``*_flops_self``) and to forward or backward; the formulas are
exactly those of :class:`torch.utils.flop_counter.FlopCounterMode` (its ``flop_registry``, built with
our ``custom_mapping``), so a total agrees with a plain FlopCounterMode run.

FlopCounterMode has no formula for the attention kernels that a CPU (real or fake) picks:
``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, nor for the
``_fused_attention_overrideable`` pair (XPU and out-of-tree backends). Without a mapping they count as
0, which loses the 4·b·h·s·s·d attention term. We map them onto FlopCounterMode's own SDPA formulas
(``sdpa_flop_count``: 2 batched matmuls forward, QK^T and PV, = 4·b·h·s_q·s_k·d; backward: 5 matmuls
including the recomputed scores, = 2.5x forward). Like FlopCounterMode for the CUDA kernels, a causal
mask is counted as full attention (no halving): the kernels skip masked tiles, so this is the work of a
dense kernel, and it is what Kaplan et al. 2020 (Table 1, 2·n_layer·n_ctx·d_attn per token forward)
and PaLM (Chowdhery et al. 2022, Appendix B, 6·N + 12·L·H·Q·T per token) count.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from shard_planner.trace.kernel_ops import grouped_mm_flop

logger = logging.getLogger(__name__)

aten = torch.ops.aten


def _sdpa_forward_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """query (b, h_q, s_q, d), key/value (b, h_kv, s_k, d): 4·b·h_q·s_q·s_k·d; causal counted as full."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """grad_out (b, h_q, s_q, d): 5 matmuls (scores recomputed), 2.5x the forward; causal counted as full."""
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``_grouped_mm(a, b, offs)`` (MoE experts; transformers' default expert kernel): 2 x output elements
    x each group's reduction length (trace/kernel_ops.py ``grouped_mm_flop``)."""
    return grouped_mm_flop(a_shape, b_shape, out_shape)


# Kernels FlopCounterMode (torch 2.13) has no formula for; the attention ones take (query, key, value,
# ...) or (grad_out, query, key, value, ...) as their leading tensor arguments.
EXTRA_FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    aten._grouped_mm: _grouped_mm_flop,
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_forward_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward_flop,
    aten._scaled_dot_product_fused_attention_overrideable: _sdpa_forward_flop,
    aten._scaled_dot_product_fused_attention_overrideable_backward: _sdpa_backward_flop,
}


def flop_registry() -> dict[Any, Callable[..., int]]:
    """op overload packet -> formula(*args, out_val=..., **kwargs), as FlopCounterMode builds it."""
    return dict(FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS).flop_registry)


class FlopCounter:
    """Counts one op at a time with FlopCounterMode's formulas (see the module docstring)."""

    def __init__(self) -> None:
        self._registry = flop_registry()

    def __contains__(self, packet) -> bool:
        return packet in self._registry

    def count(self, func, args, kwargs, out) -> int:
        formula = self._registry.get(func._overloadpacket)
        if formula is None:
            return 0
        return int(formula(*args, **kwargs, out_val=out))
