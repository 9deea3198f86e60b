"""Where bench_published's error sits, by kernel class: a diagnosis, not a correction.

For each row, the share of its priced device time that each kernel class takes (GEMMs, FlashAttention
forward and backward together, the memory-bound rest), checkpointed blocks' recomputed forward counted
again. Attention's forward and backward are one class: their ratio is the same in every row without
activation checkpointing, so the rows cannot tell them apart.
Then, over a group of rows, the least-squares c_k in

    ln(predicted / published) = sum_k c_k x share_k

c_k is what the rows say about class k: were every class priced right but k, and k's time off by a
factor (1 + c_k) (c_k > 0: that class priced too fast), the rows would show exactly this. It changes no
prediction; it says which kernel class a device measurement should look at first (an A100 GEMM or
attention sweep: `benchmarks/gpu_kernels.py measure`). The classes' shares are collinear across rows
(the sequence length moves them together), so a coefficient is only as good as its group's spread.
"""

from __future__ import annotations

import math

from shard_planner.cost.kernels import ATTENTION_BWD, ATTENTION_FWD, MATMUL, device_of, records_time_s

CLASSES = ("matmul", "attention", "memory_bound")


def _class_of(op_class: str) -> str:
    if op_class == MATMUL:
        return "matmul"
    return "attention" if op_class in (ATTENTION_FWD, ATTENTION_BWD) else "memory_bound"


def class_shares(trace, micro_batch: int, profile, checkpointed_prefix: str | None) -> dict[str, float]:
    """Share of one micro-batch's priced device time per kernel class (CLASSES), the forward of modules
    under ``checkpointed_prefix`` counted twice (full recomputation); {} without kernel records."""
    dev = device_of(profile, "bfloat16")
    if dev is None:
        return {}
    seconds = dict.fromkeys(CLASSES, 0.0)

    def add(records, times: int = 1) -> None:
        for r in records:
            seconds[_class_of(r.op_class)] += times * records_time_s((r,), micro_batch, dev)

    for m in trace.modules:
        recomputed = checkpointed_prefix is not None and m.fqn.startswith(checkpointed_prefix)
        add(m.fwd_kernels, 2 if recomputed else 1)
        add(m.bwd_kernels)
    add(trace.loss_kernels)
    total = sum(seconds.values())
    return {f"share_{k}": round(v / total, 4) for k, v in seconds.items()} if total > 0 else {}


def attribution(rows: list[dict], label: str) -> dict:
    """The least-squares c_k of the module docstring over ``rows``, in percent, and the fit's median
    |residual|."""
    import numpy as np

    rows = [r for r in rows if "share_matmul" in r]
    if len(rows) <= len(CLASSES):
        return dict(group=label, rows=len(rows))
    x = np.array([[r[f"share_{k}"] for k in CLASSES] for r in rows])
    y = np.array([math.log1p(r["error_pct"] / 100) for r in rows])
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    resid = y - x @ coef
    return dict(group=label, rows=len(rows), **{f"{k}_pct": round(float(c) * 100, 1) for k, c in zip(CLASSES, coef)},
                median_abs_residual_pct=round(float(np.median(np.abs(resid))) * 100, 2))


def by_gpu(rows: list[dict], gpus_per_node: int) -> list[dict]:
    """:func:`attribution` per GPU model, over all its rows and over its one-node rows without AC (the
    rows communication and recomputation confound least)."""
    return [attribution([r for r in rows if r["gpu"] == gpu and keep(r)], f"{gpu}, {label}")
            for gpu in sorted({r["gpu"] for r in rows}) for label, keep in (
                ("all rows", lambda r: True),
                (f"{gpus_per_node} GPUs, no AC", lambda r: r["n_gpus"] == gpus_per_node and r["ac"] == "none"))]
