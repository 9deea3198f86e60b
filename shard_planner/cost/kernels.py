"""A roofline model of GPU kernel time, per group of identical kernels (pure functions).

    time = max(FLOPs / achievable FLOP/s for that kernel's shape, bytes / achievable bandwidth)
           + count x device launch gap

A GPU block then takes max(device time, host time), host time = ops x the profile's per_op_overhead_s
(the host issues kernels asynchronously and runs ahead: shard_planner/cost/time.py).

Achievable FLOP/s by kernel class ([Note: kernel classes]):

- matmul (and grouped matmul, per group): peak x ``matmul_efficiency`` (the best a large GEMM reaches,
  published "maximum achievable matmul FLOPS", measured in short bursts at the boost clock) x
  ``sustained_clock_fraction`` (the clock the GPU holds at its power limit under back-to-back dense
  GEMMs with training-like operands, over the boost clock the peak is quoted at: [Note: sustained
  clock]) x a shape factor <= 1, the best over the device's CTA
  tile shapes (CUTLASS / cuBLAS tile sizes) and split-K factors of
    * wave quantisation: ceil(M/tm)·ceil(N/tn)·split CTAs run in waves of ``sm_count``; the last wave
      is partly idle, and a tile hanging over the matrix edge computes padding:
      useful = M·N / (waves · sm_count · tm · tn / split);
    * tile arithmetic intensity: a tm x tn tile streams (tm + tn)·tk operands from L2 for 2·tm·tn·tk
      FLOPs; below the SM's ridge (tensor FLOP/clk per SM / L2 bytes/clk per SM) it starves:
      min(1, tm·tn / (tm + tn) / ridge) (operands of 2 bytes);
    * the K pipeline: a multistage mainloop fills ``matmul_stages - 1`` K-slices of ``matmul_tile_k``
      before its first MMA (CUTLASS multistage), so K/split elements run in the time of
      K/split + (stages - 1)·tk.
  Bytes: (M·K + K·N + M·N) x element size, and fp32 partial sums for split-K (written and read once).
  The rate is also scaled by ``matmul_layout_efficiency`` of the operands' layout ([Note: matmul
  layouts]).
- attention (FlashAttention forward / backward, one kernel per call): peak x the published
  long-sequence efficiency at head dim 128 (``attention_fwd_efficiency``, ``..._bwd_...``), corrected
  for head dim and for short sequences:
    * head dim: each score element costs 4·d tensor FLOPs (QK^T and PV) but one exponential on the
      special-function units, whose rate (``exp_per_clk_per_sm``) is a fixed fraction of the tensor
      rate; the part not hidden scales as 1/d: 1/eff(d) = 1/eff(128) + r·(1/d - 1/128), with
      r = tensor FLOP/clk / (4 x exp/clk) per SM (the backward does 2.5x the matmul FLOPs per
      exponential: r / 2.5);
    * sequence: the kernel walks ``attention_block``-row query tiles; each costs a fixed
      ``attention_tile_overhead`` (in key-tile units: loading Q, writing O and the row statistics)
      beside its n (causal: i + 1, the diagonal tile computed in full) key tiles.
  Traced FLOPs count causal attention as full (4·b·h·s²·d: trace/flops.py); the kernel does
  (n + 1) / 2n of it plus the overhead.
    * a fixed time per tile it visits (``attention_tile_fwd_s`` / ``..._bwd_s``, per batch x head, query
      tiles of ``attention_block`` rows x key blocks of ``attention_kv_block`` keys): 0 on the GPU
      profiles; a CPU pays it ([Note: attention tiles on a CPU]).
- convolution forward / backward (input and weight gradients): FLOPs as traced at peak x
  ``conv_fwd_efficiency`` / ``conv_bwd_efficiency``, bytes at the achieved bandwidth. Profiles without
  them price convolutions at the large-GEMM rate (an implicit GEMM: cuDNN's convolutions run on the
  same tensor cores); `calibrate` measures them (execute/calibrate_kernels.py measure_convolutions):
  on this project's CPU a bf16 3x3 convolution's forward ran at 0.6-1.2 GFLOP/s, its backward at ~10,
  against 23-78 and 40-61 in fp32. A CPU also pays a fixed time per call (``conv_call_fwd_s`` /
  ``conv_call_bwd_s``, 0 on GPU profiles): oneDNN's backward averaged ~0.27 ms a call in the tiny U-Net
  (bf16, one thread), where its FLOPs take a fraction of that.
- everything else (elementwise, norms, softmax/reductions, copies and casts, embedding gathers and
  their backward, the loss): bytes read + written / (HBM bandwidth x ``memory_efficiency``), the FLOPs
  at the matmul ceiling as a floor (never binding for these classes).

[Note: sustained clock] A training step runs GEMMs back to back for seconds on every GPU of the node at
once; a GEMM with random-like operands draws the GPU to its power limit and the clock drops below the
boost clock the datasheet peak assumes (dynamic switching power: Horace He, "Strangely, Matrix
Multiplications on GPUs Run Faster When Given 'Predictable' Data!", thonking.ai 2024: 8192^3 bf16 on an
A100, cuBLAS, 257 TFLOP/s with randn operands against 295 with zeros). The maximum-achievable-matmul
figures are bursts at the boost clock after an idle gap (stas00/ml-engineering mamf-finder.py v4: MAMF
"ran at the boost clock"; its sustained MSMF "matches sustained training throughput"). Only the GEMMs
take the fraction: FlashAttention and the memory-bound kernels keep the tensor cores below half busy
(their published rates, 35-73% of peak) and the HBM, not the clock, bounds the rest.

[Note: matmul layouts] A GEMM library may run some operand layouts on slower code than others. The
trace records each matmul's layout (trace/kernel_ops.py matmul_layout: which dimension of A (M, K) and
of B (K, N) is contiguous; a Linear's forward x @ W^T is "kk", its input gradient dY @ W "kn", its
weight gradient dY^T @ X "mn"), and ``matmul_layout_efficiency`` holds each layout's rate over the best
one, in the order kk, kn, mk, mn. Measured on the CPU this project runs on (torch 2.13.0, AVX2, no
native bf16, one thread as each rank runs; `shard-planner calibrate`, execute/calibrate_kernels.py
measure_layouts): a bf16 512^3 GEMM runs at 8.0 GFLOP/s as kk, 1.3 as kn, 1.3 as mk and 16.9 as mn
(the four layouts take different loops of ATen's fallback CPU GEMM,
aten/src/ATen/native/cpu/BlasKernel.cpp gemm_notrans_ / gemm_transa_ / gemm_transb_ / gemm_transab_);
fp32 (MKL) runs all four within 2x of each other. A Linear's step runs one GEMM of each of kk, kn and
mn: priced at the kn rate (what timing a @ b measures), its bf16 GEMMs came out 2.4x too slow. GPU
profiles leave the factors at 1: cuBLAS has tensor-core kernels for every layout (not measured here).
The same CPU's bf16 attention (ATen's flash attention for CPU) computes in fp32 blocks: its forward ran
at 86 GFLOP/s against the bf16 GEMM's best 17, its backward at ~8; so bf16 has its own attention
constants too, fitted against the bf16 GEMM peak without the cap at 1.

Every device constant comes from the profile's ``[kernels]`` table, each with its source there.
Constants that differ by compute dtype (a CPU's bf16 GEMM layouts and attention) are overridden in a
sub-table named for the dtype, e.g. ``[kernels.bfloat16]``: :func:`kernel_constants`.

[Note: attention tiles on a CPU] ATen's CPU flash attention (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp)
walks each batch x head in query blocks against key blocks, and every block pair runs its own small GEMM
calls, softmax bookkeeping and buffer work. At the small shapes of small models that fixed work, not the
FLOPs, sets the pace. Measured on one thread of an AMD EPYC with AVX512-BF16 (bf16): the backward takes
~1.8 us per query row at sequences 64-256 whatever the head dim (16-64) or causality (16x128x16 causal
3.72 ms, 16x128x32 3.57 ms, 8x256x64 3.84 ms), while its FLOPs differ 4x. So a call costs FLOPs / (peak
x efficiency) + batch x heads x tiles x ``attention_tile_{fwd,bwd}_s``, tiles as :func:`attention_tiles`
counts them. ``calibrate`` fits the two times and ``attention_kv_block`` on a CPU; on that sweep the fit's
msle falls from 0.21 to under 0.01. GPU profiles leave them 0: FlashAttention's tiles run in parallel
across the SMs and their fixed work is inside the published efficiencies.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

from shard_planner.errors import ProfileError

# [Note: kernel classes] The op classes a trace groups kernels into (trace records; issue 12).
MATMUL = "matmul"
GROUPED_MATMUL = "grouped_matmul"
ATTENTION_FWD = "attention_fwd"
ATTENTION_BWD = "attention_bwd"
CONV_FWD = "conv_fwd"
CONV_BWD = "conv_bwd"
MEMORY_BOUND = ("elementwise", "reduction", "copy", "embedding", "loss", "other")
OP_CLASSES = (MATMUL, GROUPED_MATMUL, ATTENTION_FWD, ATTENTION_BWD, CONV_FWD, CONV_BWD) + MEMORY_BOUND

# FlashAttention-2 backward: 5 matmuls against the forward's 2 with one exponential recomputed per score
# (Dao 2023, Algorithm 2; trace/flops.py counts 2.5x the forward).
BWD_MATMUL_PER_EXP = 2.5
HEAD_DIM_REF = 128  # the head dim the profile's attention efficiencies are quoted at
MATMUL_LAYOUTS = ("kk", "kn", "mk", "mn")  # trace/kernel_ops.py matmul_layout codes 0-3


_MAY_BE_ZERO = ("kernel_launch_s", "attention_tile_fwd_s", "attention_tile_bwd_s", "attention_kv_block",
                "conv_call_fwd_s", "conv_call_bwd_s")


@dataclass(frozen=True)
class KernelConstants:
    """A device's kernel constants: the profile's ``[kernels]`` table (sources there)."""

    sm_count: int
    matmul_efficiency: float  # largest-GEMM FLOP/s / peak
    matmul_tiles: tuple[tuple[int, int], ...]  # CTA tiles (tm, tn) the GEMM library chooses among
    matmul_tile_k: int
    matmul_stages: int
    tensor_flop_per_clk_per_sm: float
    l2_bytes_per_clk_per_sm: float
    exp_per_clk_per_sm: float
    attention_fwd_efficiency: float  # at head dim 128, long sequences, over the dtype's GEMM peak
    attention_bwd_efficiency: float
    attention_block: int
    attention_tile_overhead: float
    memory_efficiency: float  # achieved / datasheet HBM bandwidth
    kernel_launch_s: float  # device-side gap between back-to-back kernels
    max_split_k: int = 16
    # convolution FLOP/s over the dtype's GEMM peak; None: the large-GEMM rate (module docstring)
    conv_fwd_efficiency: float | None = None
    conv_bwd_efficiency: float | None = None
    sustained_clock_fraction: float = 1.0  # power-limited GEMM clock / boost clock ([Note: sustained clock])
    # rate of each operand layout over the best, order kk, kn, mk, mn ([Note: matmul layouts])
    matmul_layout_efficiency: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)
    # fixed seconds per (query tile x key block) an attention call visits, per batch x head; key blocks of
    # attention_kv_block keys (0: attention_block). 0: none ([Note: attention tiles on a CPU])
    attention_tile_fwd_s: float = 0.0
    attention_tile_bwd_s: float = 0.0
    attention_kv_block: int = 0
    # fixed seconds per convolution call (forward; backward's input and weight gradients), beside its FLOPs:
    # 0: none. A CPU's oneDNN convolutions pay it at small shapes (execute/calibrate_kernels.py fit_conv)
    conv_call_fwd_s: float = 0.0
    conv_call_bwd_s: float = 0.0

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "matmul_tiles":
                if not v or any(len(t) != 2 or min(t) <= 0 for t in v):
                    raise ProfileError(f"[kernels] matmul_tiles must be a list of 'MxN' tiles, got {v!r}")
            elif f.name.startswith("conv_") and v is None:
                continue
            elif f.name == "matmul_layout_efficiency":
                if len(v) != len(MATMUL_LAYOUTS) or any(not isinstance(x, (int, float)) or not 0 < x <= 1 for x in v):
                    raise ProfileError("[kernels] matmul_layout_efficiency must be 4 fractions in (0, 1] "
                                       f"(layouts {', '.join(MATMUL_LAYOUTS)}), got {v!r}")
            elif not (isinstance(v, (int, float)) and v >= 0) or (f.name not in _MAY_BE_ZERO and v == 0):
                raise ProfileError(f"[kernels] {f.name} must be a positive number, got {v!r}")
        # attention's efficiencies are over the dtype's GEMM peak and may exceed 1 where attention runs other
        # code than the GEMMs (a CPU's bf16 attention computes in fp32: [Note: matmul layouts])
        for name in ("matmul_efficiency", "memory_efficiency", "sustained_clock_fraction"):
            if getattr(self, name) > 1:
                raise ProfileError(f"[kernels] {name} is a fraction of peak (<= 1), got {getattr(self, name)!r}")

    @staticmethod
    def from_table(table: dict) -> "KernelConstants":
        """From a profile's ``[kernels]`` TOML table (tiles written as "256x128" strings); the dtype
        sub-tables (:func:`kernel_constants`) are not constants."""
        d = {k: v for k, v in table.items() if not isinstance(v, dict)}
        try:
            d["matmul_tiles"] = tuple(tuple(int(x) for x in str(t).lower().split("x")) for t in d["matmul_tiles"])
            if "matmul_layout_efficiency" in d:
                d["matmul_layout_efficiency"] = tuple(d["matmul_layout_efficiency"])
            return KernelConstants(**d)
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"[kernels] table malformed ({exc}); see profiles/a100-80gb.toml") from None

    @property
    def ridge_flop_per_byte(self) -> float:
        """Tensor FLOPs per L2 byte an SM needs to stay busy."""
        return self.tensor_flop_per_clk_per_sm / self.l2_bytes_per_clk_per_sm

    @property
    def exp_ratio(self) -> float:
        """r: tensor FLOP/clk / (4 x exp/clk): the un-hidden exponential cost x head dim (module docstring)."""
        return self.tensor_flop_per_clk_per_sm / (4 * self.exp_per_clk_per_sm)


@dataclass(frozen=True)
class Device:
    """What pricing a kernel needs: the constants, peak FLOP/s of the compute dtype, HBM bandwidth."""

    kernels: KernelConstants
    peak_flops_per_s: float
    memory_bandwidth_bytes_per_s: float

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.memory_bandwidth_bytes_per_s * self.kernels.memory_efficiency


@dataclass(frozen=True)
class KernelOp:
    """A group of identical kernels at one micro-batch: ``count`` launches, their total FLOPs and bytes
    (read + written), and the shape that decides their speed: matmul (batch, M, N, K, layout) per launch
    ([Note: matmul layouts]; 4 dims: layout kk); attention (batch x heads, seq_q, seq_k, head_dim,
    causal 0/1); () for the other classes."""

    op_class: str
    count: int
    flops: float
    bytes: float
    dims: tuple[int, ...] = ()


def matmul_candidates(m: int, n: int, k: int, kc: KernelConstants, batch: int = 1) -> list[tuple[float, int]]:
    """Per split-K factor, the best fraction of the large-GEMM rate over the tiles (module docstring)."""
    out = []
    for split in range(1, kc.max_split_k + 1):
        k_each = k / split
        if split > 1 and k_each < 2 * kc.matmul_tile_k:
            break  # each CTA would run less than two K slices: partial sums cost more than they fill
        pipe = k_each / (math.ceil(k_each / kc.matmul_tile_k) * kc.matmul_tile_k
                         + (kc.matmul_stages - 1) * kc.matmul_tile_k)
        best = 0.0
        for tm, tn in kc.matmul_tiles:
            ctas = math.ceil(m / tm) * math.ceil(n / tn) * batch * split
            waves = math.ceil(ctas / kc.sm_count)
            quant = (m * n * batch) / (waves * kc.sm_count * tm * tn / split)
            intensity = min(1.0, (tm * tn / (tm + tn)) / kc.ridge_flop_per_byte)
            best = max(best, quant * intensity * pipe)
        out.append((best, split))
    return out


def matmul_shape_factor(m: int, n: int, k: int, kc: KernelConstants, batch: int = 1) -> tuple[float, int]:
    """The best (fraction of the large-GEMM rate, split-K) over tiles and split-K, ignoring the
    split's partial-sum traffic (which :func:`matmul_time_s` adds)."""
    if min(m, n, k, batch) <= 0:
        return 1.0, 1
    return max(matmul_candidates(m, n, k, kc, batch), key=lambda c: (c[0], -c[1]))


def matmul_time_s(op: KernelOp, dev: Device) -> float:
    """Device time of ``op.count`` GEMMs of shape ``op.dims`` = (batch, M, N, K[, layout]), FLOPs and bytes
    as traced: the fastest split-K, its fp32 partial sums (written and read once) counted in the bytes;
    the layout's rate ([Note: matmul layouts]; records without one price as "kk")."""
    batch, m, n, k = op.dims[:4]
    if min(m, n, k, batch) <= 0:
        return op.bytes / dev.bandwidth_bytes_per_s
    layout = op.dims[4] if len(op.dims) > 4 else 0
    peak = (dev.peak_flops_per_s * dev.kernels.matmul_efficiency * dev.kernels.sustained_clock_fraction
            * dev.kernels.matmul_layout_efficiency[layout])
    best = math.inf
    for factor, split in matmul_candidates(m, n, k, dev.kernels, batch):
        partial_bytes = op.count * 2 * 4 * m * n * batch * split if split > 1 else 0
        best = min(best, max(op.flops / (peak * factor), (op.bytes + partial_bytes) / dev.bandwidth_bytes_per_s))
    return best


def attention_efficiency(seq_q: int, seq_k: int, head_dim: int, causal: bool, backward: bool,
                         kc: KernelConstants) -> float:
    """Traced-FLOP/s / peak of one FlashAttention call (module docstring): head-dim and tile corrections
    of the published long-sequence efficiency; causal counted as full attention, as the trace does."""
    eff_ref = kc.attention_bwd_efficiency if backward else kc.attention_fwd_efficiency
    r = kc.exp_ratio / (BWD_MATMUL_PER_EXP if backward else 1.0)
    eff = 1.0 / (1.0 / eff_ref + r * (1.0 / head_dim - 1.0 / HEAD_DIM_REF))
    n_q = math.ceil(seq_q / kc.attention_block)
    n_k = math.ceil(seq_k / kc.attention_block)
    if causal:
        # query tile i visits the i + 1 key tiles up to the diagonal (n_q = n_k for self-attention)
        visited = n_q * (n_q + 1) / 2 if n_q == n_k else n_q * n_k - n_q * (n_q - 1) / 2
    else:
        visited = n_q * n_k
    counted = n_q * n_k  # the traced FLOPs: every tile pair in full
    return eff * counted / (visited + n_q * kc.attention_tile_overhead)


def attention_tiles(seq_q: int, seq_k: int, causal: bool, kc: KernelConstants) -> int:
    """Query tiles x key blocks one batch x head of an attention call visits: ``attention_block``-row
    query tiles, ``attention_kv_block``-key blocks (0: ``attention_block``), causal: key blocks up to the
    diagonal ([Note: attention tiles on a CPU])."""
    bq = kc.attention_block
    bk = kc.attention_kv_block or bq
    n_q = math.ceil(seq_q / bq)
    if not causal:
        return n_q * math.ceil(seq_k / bk)
    return sum(math.ceil(min(seq_k, (i + 1) * bq) / bk) for i in range(n_q))


def attention_time_s(op: KernelOp, dev: Device, backward: bool) -> float:
    """Device time of ``op.count`` FlashAttention calls, dims (batch x heads, seq_q, seq_k, head_dim, causal)."""
    bh, seq_q, seq_k, head_dim, causal = op.dims
    kc = dev.kernels
    eff = attention_efficiency(seq_q, seq_k, head_dim, bool(causal), backward, kc)
    t = max(op.flops / (dev.peak_flops_per_s * eff), op.bytes / dev.bandwidth_bytes_per_s)
    tile_s = kc.attention_tile_bwd_s if backward else kc.attention_tile_fwd_s
    if tile_s:
        t += op.count * bh * attention_tiles(seq_q, seq_k, bool(causal), kc) * tile_s
    return t


def conv_time_s(op: KernelOp, dev: Device, backward: bool) -> float:
    """Device time of ``op.count`` convolutions (forward, or the backward's input and weight gradients):
    FLOPs at the profile's convolution efficiency (the large-GEMM rate without one), bytes at the
    achieved bandwidth."""
    kc = dev.kernels
    eff = kc.conv_bwd_efficiency if backward else kc.conv_fwd_efficiency
    call_s = kc.conv_call_bwd_s if backward else kc.conv_call_fwd_s
    return max(op.flops / (dev.peak_flops_per_s * (kc.matmul_efficiency if eff is None else eff)),
               op.bytes / dev.bandwidth_bytes_per_s) + op.count * call_s


def memory_bound_time_s(op: KernelOp, dev: Device) -> float:
    """Bytes at the achieved HBM bandwidth; the FLOPs at the large-GEMM rate as a floor."""
    return max(op.bytes / dev.bandwidth_bytes_per_s,
               op.flops / (dev.peak_flops_per_s * dev.kernels.matmul_efficiency))


def op_time_s(op: KernelOp, dev: Device) -> float:
    """Device time of one group of kernels, launch gaps included."""
    if op.count <= 0:
        return 0.0
    if op.op_class in (MATMUL, GROUPED_MATMUL) and len(op.dims) in (4, 5):
        t = matmul_time_s(op, dev)
    elif op.op_class in (ATTENTION_FWD, ATTENTION_BWD) and len(op.dims) == 5:
        t = attention_time_s(op, dev, backward=op.op_class == ATTENTION_BWD)
    elif op.op_class in (CONV_FWD, CONV_BWD):
        t = conv_time_s(op, dev, backward=op.op_class == CONV_BWD)
    else:
        t = memory_bound_time_s(op, dev)
    return t + op.count * dev.kernels.kernel_launch_s


def ops_time_s(ops, dev: Device) -> float:
    """Device time of a sequence of kernel groups (one stream: they add up)."""
    return sum(op_time_s(op, dev) for op in ops)


def block_time_s(ops, dev: Device, host_s: float) -> float:
    """A GPU block: the slower of its kernels and the host issuing them (asynchronous launch)."""
    return max(ops_time_s(ops, dev), host_s)


_CONSTANTS: dict[tuple[int, str | None], tuple[dict, KernelConstants]] = {}


def kernel_constants(profile, dtype: str | None = None) -> KernelConstants | None:
    """The profile's ``[kernels]`` table as :class:`KernelConstants`, with the keys of its sub-table for
    compute dtype ``dtype`` (``[kernels.bfloat16]``), if any, in place of the base ones; None when the
    profile has no table (then compute is priced as traced FLOPs x compute_efficiency). Parsed once per
    table and dtype."""
    table = profile.kernels
    if not table:
        return None
    key = (id(table), dtype if isinstance(table.get(dtype), dict) else None)
    hit = _CONSTANTS.get(key)
    if hit is not None and hit[0] is table:
        return hit[1]
    kc = KernelConstants.from_table({**table, **table[key[1]]} if key[1] else table)
    _CONSTANTS[key] = (table, kc)  # the table kept alive with its key: ids are not reused
    return kc


def device_of(profile, dtype: str) -> Device | None:
    """What pricing kernels of compute dtype ``dtype`` on ``profile`` needs; None without a [kernels] table."""
    kc = kernel_constants(profile, dtype)
    if kc is None:
        return None
    profile.check_compute_dtype(dtype)  # See [Note: A compute dtype the device lacks] (shard_planner/hardware/profile.py)
    return Device(kc, profile.peak_flops_per_s[dtype], profile.memory_bandwidth_bytes_per_s)


# ---- kernels of a trace (trace/types.py KernelRecord; trace/kernel_ops.py [Note: kernel records]) ----

# [Note: memory-bound kernels on a CPU priced from FLOPs] A CPU profile without a ``[kernels]`` table
# (cpu-gloo) prices compute as traced FLOPs at ``peak_flops_per_s``, a measured GEMM rate
# (compute_efficiency 1.0), plus aten ops x ``per_op_overhead_s``, measured on 16 tiny Linear+GELU layers
# whose tensors are a few KiB (execute/calibrate.py): a fixed cost per op, not the bytes an op moves.
# Elementwise ops, norms, softmax and the loss have no FLOPs (FlopCounterMode counts matmuls, attention and
# convolutions), and on a CPU the one thread that runs the GEMMs also runs them, in turn: so each also
# takes its bytes read + written (its kernel records, trace/kernel_ops.py) at the profile's measured copy
# bandwidth. They matter where a tensor is large beside the GEMMs: a transformers Llama (hidden 256,
# vocab 32000, seq 256, bf16, one thread of an AMD EPYC with AVX512-BF16) spent 54 of its 155 ms of step
# CPU time in them, 39 ms in the fp32 loss over (256, 32000) logits alone (_log_softmax 12, its backward
# 16, nll_loss_backward 10), where its ~1,100 ops x 8.9 us priced all of them at 10 ms. A GPU profile's
# FLOP model is not changed: its compute_efficiency is fitted to whole models' steps, memory-bound
# kernels included, and its host runs ahead of the device (cost/time.py).


def cpu_memory_bound_s(trace, micro_batch: int, profile) -> dict[str, tuple[float, float]]:
    """Per module, the forward and backward seconds of its own memory-bound kernels on a CPU profile
    priced from FLOPs ([Note: memory-bound kernels on a CPU priced from FLOPs]); empty on a GPU."""
    if profile.device != "cpu":
        return {}
    bw = profile.memory_bandwidth_bytes_per_s
    return {m.fqn: (memory_bound_bytes(m.fwd_kernels, micro_batch) / bw,
                    memory_bound_bytes(m.bwd_kernels, micro_batch) / bw)
            for m in trace.modules if m.fwd_kernels or m.bwd_kernels}


def cpu_loss_memory_bound_s(trace, micro_batch: int, profile) -> float:
    """The loss function's memory-bound kernels, forward and backward, as :func:`cpu_memory_bound_s`."""
    if profile.device != "cpu":
        return 0.0
    return memory_bound_bytes(trace.loss_kernels, micro_batch) / profile.memory_bandwidth_bytes_per_s


def memory_bound_bytes(records, micro_batch: int) -> float:
    """Bytes read + written by the memory-bound kernels of ``records`` at ``micro_batch``."""
    return sum(max(0.0, r.bytes.at(micro_batch)) for r in records if r.op_class in MEMORY_BOUND)



@functools.lru_cache(maxsize=1 << 16)
def _cached_op_time_s(op: KernelOp, dev: Device) -> float:
    return op_time_s(op, dev)  # repeated blocks share their records' shapes: priced once


def records_time_s(records, micro_batch: int, dev: Device) -> float:
    """Device seconds of a module's kernel records at ``micro_batch``."""
    total = 0.0
    for r in records:
        op = KernelOp(r.op_class, r.count, max(0.0, r.flops.at(micro_batch)), max(0.0, r.bytes.at(micro_batch)),
                      r.dims_at(micro_batch))
        total += _cached_op_time_s(op, dev)
    return total


def has_kernel_records(trace) -> bool:
    """Whether ``trace`` carries kernel records (traces written before them do not)."""
    return bool(trace.loss_kernels) or any(m.fwd_kernels or m.bwd_kernels for m in trace.modules)


def module_kernel_s(trace, micro_batch: int, dev: Device, fallback_flops_per_s: float) -> dict[str, tuple[float, float]]:
    """Per module, the device seconds of its own forward and backward at ``micro_batch``: its kernel
    records priced by the roofline; a module with no records in a phase (its op sequences did not pair
    across the traced batch sizes) takes that phase's FLOPs at ``fallback_flops_per_s``."""
    out = {}
    for m in trace.modules:
        fwd = (records_time_s(m.fwd_kernels, micro_batch, dev) if m.fwd_kernels
               else m.fwd_flops_self.at(micro_batch) / fallback_flops_per_s)
        bwd = (records_time_s(m.bwd_kernels, micro_batch, dev) if m.bwd_kernels
               else m.bwd_flops_self.at(micro_batch) / fallback_flops_per_s)
        out[m.fqn] = (fwd, bwd)
    return out


def loss_kernel_s(trace, micro_batch: int, dev: Device, fallback_flops_per_s: float) -> float:
    """Device seconds of the loss function (forward and backward) at ``micro_batch``."""
    if trace.loss_kernels:
        return records_time_s(trace.loss_kernels, micro_batch, dev)
    return trace.loss_flops.at(micro_batch) / fallback_flops_per_s


def block_kernel_s(trace, blocks, per_module: dict[str, tuple[float, float]]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Forward and backward device seconds of each of ``blocks`` (cost/tables.py Block: a module's subtree,
    or, ``self_only``, a container's own operations), summed from :func:`module_kernel_s`."""
    memo: dict[str, tuple[float, float]] = {}

    def subtree(fqn: str) -> tuple[float, float]:
        hit = memo.get(fqn)
        if hit is None:
            f, b = per_module.get(fqn, (0.0, 0.0))
            for c in trace.module(fqn).children:
                cf, cb = subtree(c)
                f, b = f + cf, b + cb
            memo[fqn] = hit = (f, b)
        return hit

    times = [per_module.get(blk.fqn, (0.0, 0.0)) if blk.self_only else subtree(blk.fqn) for blk in blocks]
    return tuple(t[0] for t in times), tuple(t[1] for t in times)
