"""Measure and fit the roofline kernel model's constants (shard_planner/cost/kernels.py, the profile's
``[kernels]`` table) and the collectives' bus-bandwidth curve (cost/collectives.py) on the local device.

Every fit prices the measured samples with the *same functions the cost model uses* (kernels.matmul_time_s,
kernels.attention_time_s, collectives.ring_time_s) and picks the constants that minimise the mean squared
log error of predicted vs measured time (relative error: small and large shapes count alike). Each
measured time is one call as execute/kernel_timing.py times it: on CPU the fastest of ``repeats``
host-clock calls after a warm-up, on CUDA the device time of a captured batch of calls ([Note: timing a
kernel on the device]: the host clock around one call measured the host there). Discrete
constants are searched on a grid; each efficiency, given the discrete ones, is the closed-form geometric
mean of (time at efficiency 1) / (measured time) over the samples, capped at 1 (a fraction of peak).

What is measured, and how each quantity is fitted:

- ``peak_flops_per_s`` (per dtype) is the n x n matmul of execute/calibrate.py, except that when the
  GEMM sweep's fitted efficiency exceeds 1 (a loaded machine slowed the one long reference matmul) the
  sweep dtype's peak is raised by that factor and ``matmul_efficiency`` set to 1;
  ``memory_bandwidth_bytes_per_s`` is the large tensor copy. Both are the roofline's references.
- Dispatch floor: on CPU the fastest one-element add, on CUDA the device gap between kernels
  (``kernel_launch_s``, below). It is subtracted from every GEMM, attention and convolution sample (at
  least 10% of the sample kept) before fitting, because the cost model prices each op's fixed cost apart
  (``per_op_overhead_s`` on CPU, ``kernel_launch_s`` per kernel); the fits describe throughput only.
- GEMM shape sweep (MATMUL_SHAPES: square 32-1024 and skinny / short-K shapes, x8 on CUDA; fp32 on CPU,
  bf16 on CUDA; each timed as above) -> ``matmul_efficiency`` (closed form), the square
  CTA tile ``matmul_tiles`` = [t x t] for t in TILE_GRID, ``matmul_tile_k`` (TILE_K_GRID),
  ``matmul_stages`` (STAGES_GRID) and the tile ridge tensor/L2 (RIDGE_GRID; written as
  ``tensor_flop_per_clk_per_sm`` = CLOCK_NORM and ``l2_bytes_per_clk_per_sm`` = CLOCK_NORM / ridge: only
  the ratio enters the model). ``sm_count`` is not fitted: CUDA's multiprocessor count, on CPU the
  threads of one rank (torch.get_num_threads()); split-K is searched on CUDA only (``max_split_k`` 1 on CPU,
  where one thread gains nothing from it).
- Attention (``scaled_dot_product_attention`` at ATTENTION_SHAPES: batch x heads, sequences 64-1024,
  head dims 16-128, causal; forward timed alone, backward as forward + backward less the forward)
  -> ``attention_block`` (BLOCK_GRID), ``attention_tile_overhead`` (TILE_OVERHEAD_GRID) and the head-dim
  ratio r (EXP_RATIO_GRID; written as ``exp_per_clk_per_sm`` = CLOCK_NORM / (4 r)), shared by forward and
  backward, with ``attention_fwd_efficiency`` / ``attention_bwd_efficiency`` closed form per direction
  (time is affine in 1/efficiency there: the least-squares x = 1/eff of relative error). On a CPU, also
  ``attention_tile_{fwd,bwd}_s`` (a fixed time per tile, closed form beside the efficiency) and
  ``attention_kv_block`` (KV_BLOCK_GRID): cost/kernels.py [Note: attention tiles on a CPU].
  FLOPs as the trace counts them: 4 b h s^2 d forward (causal counted in full), 2.5x that backward.
- CPU only, bf16 (``[kernels.bfloat16]``, replacing those keys of [kernels] for bf16 compute): without
  native bf16 instructions its GEMM and attention kernels are other code than fp32's. A LAYOUT_N^3 GEMM
  in each operand layout -> ``peak_flops_per_s.bfloat16`` (the fastest) and
  ``matmul_layout_efficiency`` (each over it: cost/kernels.py [Note: matmul layouts]); the attention
  sweep in bf16 against that peak -> its attention constants, fitted as above.
- Convolutions (CONV_SHAPES, 3x3; forward alone, backward as forward + backward less the forward; FLOPs
  by FlopCounterMode as the trace counts them) -> ``conv_fwd_efficiency`` / ``conv_bwd_efficiency``,
  each the closed-form log mean over the samples, uncapped (in the sweep dtype, and in bf16 on CPU); on a
  CPU with ``conv_call_{fwd,bwd}_s``, a fixed time per call, closed form beside the efficiency.
- Elementwise / norm / reduction bandwidth (ELEMENTWISE_NUMEL elements: add, mul, GELU, softmax, LayerNorm,
  sum; bytes read + written) -> ``memory_efficiency`` = median achieved bytes/s / copy bandwidth, <= 1.
- Per-launch cost ``kernel_launch_s``: on CUDA, kernel_timing.LAUNCH_KERNELS tiny kernels in a replayed CUDA graph (the
  device's gap between kernels, no host launch in it); on CPU 0: ``per_op_overhead_s`` (calibrate.py)
  measures each op's whole fixed cost, dispatch and kernel entry included.
- Collectives by message size (all-gather and reduce-scatter, execute/calibrate.py's COLLECTIVE_BYTES
  from 4 bytes per rank to MiBs, in the spawned world, over groups of 2 ranks and of the whole world):
  t(p, n) = alpha (p-1) + (p-1)/p (n + n_1/2) / plateau, i.e. nccl-tests' busbw(n) = plateau x n /
  (n + n_1/2) plus a latency per ring step, fitted by least squares on relative error (:func:`fit_curve`)
  -> ``*_latency_s`` (alpha), ``*_busbw_bytes_per_s`` (plateau) and ``*_busbw_half_bytes`` (n_1/2).
  alpha and n_1/2 are both a fixed time at one group size: with a world of 2 ranks they cannot be told
  apart, and the fixed time is counted as latency per ring step (n_1/2 = 0); from 3 ranks on, the two
  group sizes separate them. The profile takes the collective that is slower over the sampled sizes;
  both fits are written in its comments. Each size's time is the fastest of the repeats, every rank
  starting after a barrier.
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
from dataclasses import dataclass

import torch

from shard_planner.cost.collectives import ring_time_s
from shard_planner.cost.kernels import (BWD_MATMUL_PER_EXP, MATMUL_LAYOUTS, Device, KernelConstants, KernelOp,
                                        attention_tiles, attention_time_s, conv_time_s, matmul_time_s)
from shard_planner.execute.kernel_timing import device_time_s, measure_launch_s

logger = logging.getLogger(__name__)

CLOCK_NORM = 1024.0  # tensor FLOP per "clock" per SM written to the profile: only ratios to it matter
TILE_GRID = (4, 8, 16, 32, 64, 128, 256)
TILE_K_GRID = (4, 8, 16, 32, 64, 128, 256)
STAGES_GRID = (1, 2, 3, 4, 6)
RIDGE_GRID = (1e-3, 1.0, 4.0, 16.0, 64.0)  # tensor FLOP per L2 byte; 1e-3: never binding
BLOCK_GRID = (16, 32, 64, 128, 256)
TILE_OVERHEAD_GRID = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
EXP_RATIO_GRID = (1e-3, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)  # 1e-3: no head-dim effect
KV_BLOCK_GRID = (0, 256, 512, 1024)  # attention_kv_block with a per-tile time (CPU); 0: attention_block
# (M, N, K) at scale 1 (CPU); CUDA multiplies each by 8
MATMUL_SHAPES = ((1024, 1024, 1024), (512, 512, 512), (256, 256, 256), (128, 128, 128), (64, 64, 64),
                 (32, 32, 32), (2048, 64, 512), (64, 2048, 512), (512, 512, 32), (512, 512, 2048),
                 (8, 1024, 1024), (1024, 8, 1024))
# (batch x heads, sequence, head dim, causal)
# head dims 16-128: at small head dims the softmax's exponentials, not the two matmuls, set the pace (the
# head-dim ratio r of the fit is decided by them)
ATTENTION_SHAPES = ((8, 64, 64, 1), (8, 256, 64, 1), (4, 1024, 64, 1), (8, 256, 128, 1), (8, 256, 64, 0),
                    (16, 128, 16, 1), (16, 128, 32, 1))
ELEMENTWISE_NUMEL = {"cpu": 4 * 2**20, "cuda": 64 * 2**20}
# 3x3 convolutions, (batch, channels in = out, height = width) at scale 1 (CPU); CUDA: batch and channels x4
CONV_SHAPES = ((8, 32, 32), (8, 64, 16), (8, 16, 64), (8, 8, 32), (8, 16, 16), (4, 32, 8))
LAYOUT_N = 512  # the GEMM of the layout measurement (CPU bf16: its slow layouts take ~0.2 s)


@dataclass(frozen=True)
class Sample:
    """One measured kernel: its op as the trace records it, and the median seconds."""

    op: KernelOp
    time_s: float


def _msle(pred: list[float], meas: list[float]) -> float:
    return sum(math.log(p / m) ** 2 for p, m in zip(pred, meas)) / len(meas)


def _closed_form_eff(at_one: list[float], meas: list[float], cap: float = 1.0) -> float:
    """Efficiency that best scales times priced at efficiency 1 to the measured ones (log mean), <= cap."""
    return min(cap, math.exp(sum(math.log(a / m) for a, m in zip(at_one, meas)) / len(meas)))


def _affine_eff(at_one: list[float], at_half: list[float], meas: list[float], cap: float = 1.0) -> float:
    """Attention time is affine in 1/efficiency (the head-dim term adds to it: cost/kernels.py): with
    t_i = a_i x + b_i, x = 1/eff, from the times at eff 1 and 1/2, the x of least relative squared
    error, closed form; eff <= cap. (:func:`_affine_eff_tile` without tiles.)"""
    return _affine_eff_tile(at_one, at_half, [0.0] * len(meas), meas, cap)[0]


def _affine_eff_tile(at_one: list[float], at_half: list[float], tiles: list[float], meas: list[float],
                     cap: float = 1.0) -> tuple[float, float]:
    """:func:`_affine_eff` with a fixed time c per tile beside: t_i = a_i x + b_i + n_i c (``tiles``: n_i),
    the (x, c >= 0) of least relative squared error, closed form (the 2x2 normal equations); returns
    (efficiency <= cap, c). Where the pair leaves the bounds, c = 0 or eff = cap and the other alone."""
    a = [(h - o) / m for o, h, m in zip(at_one, at_half, meas)]
    r = [1 - (o - (h - o)) / m for o, h, m in zip(at_one, at_half, meas)]  # 1 - b_i
    n = [k / m for k, m in zip(tiles, meas)]
    saa, snn, san = sum(x * x for x in a), sum(x * x for x in n), sum(x * y for x, y in zip(a, n))
    sar, snr = sum(x * y for x, y in zip(a, r)), sum(x * y for x, y in zip(n, r))
    det = saa * snn - san * san
    x = (sar * snn - snr * san) / det if det > 0 else 0.0
    c = (saa * snr - san * sar) / det if det > 0 else -1.0
    if c < 0 or x <= 0:  # no tile cost (no tiles, or a negative one): x alone
        x = sar / saa
        return (min(cap, 1.0 / x) if x > 0 else min(cap, 1.0)), 0.0
    if 1.0 / x > cap:  # efficiency at its cap: the tile time alone
        x = 1.0 / cap
        c = max(0.0, sum(ni * (ri - ai * x) for ni, ri, ai in zip(n, r, a)) / snn) if snn > 0 else 0.0
    return 1.0 / x, c


def _constants(base: KernelConstants | None = None, **kw) -> KernelConstants:
    d = dict(sm_count=1, matmul_efficiency=1.0, matmul_tiles=((64, 64),), matmul_tile_k=64, matmul_stages=1,
             tensor_flop_per_clk_per_sm=CLOCK_NORM, l2_bytes_per_clk_per_sm=CLOCK_NORM, exp_per_clk_per_sm=CLOCK_NORM,
             attention_fwd_efficiency=1.0, attention_bwd_efficiency=1.0, attention_block=64,
             attention_tile_overhead=1.0, memory_efficiency=1.0, kernel_launch_s=0.0, max_split_k=1,
             attention_tile_fwd_s=0.0, attention_tile_bwd_s=0.0, attention_kv_block=0, conv_call_fwd_s=0.0,
             conv_call_bwd_s=0.0)
    if base is not None:
        d.update({k: getattr(base, k) for k in d})
    d.update(kw)
    return KernelConstants(**d)


# ---- matmul ----

def matmul_op(m: int, n: int, k: int, elt_bytes: int, layout: int = 1) -> KernelOp:
    """A GEMM as the trace records it; layout 1 ("kn": both operands row-major) is what a @ b of two
    fresh tensors runs ([Note: matmul layouts])."""
    return KernelOp("matmul", 1, 2.0 * m * n * k, float((m * k + k * n + m * n) * elt_bytes), (1, m, n, k, layout))


def layout_operands(m: int, n: int, k: int, layout: int, device: torch.device, dtype: torch.dtype):
    """Operands A (m x k), B (k x n) of ``layout`` (cost/kernels.py MATMUL_LAYOUTS order): A M-contiguous
    for layouts 2-3, B K-contiguous for layouts 0 and 2 (trace/kernel_ops.py matmul_layout)."""
    a = torch.randn(k, m, device=device, dtype=dtype).t() if layout >= 2 else torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(n, k, device=device, dtype=dtype).t() if layout % 2 == 0 else torch.randn(k, n, device=device, dtype=dtype)
    return a, b


def measure_layouts(device: torch.device, dtype: torch.dtype, repeats: int, n: int = LAYOUT_N) -> tuple[float, tuple[float, ...]]:
    """An n^3 GEMM in each operand layout: (the best FLOP/s, each layout's FLOP/s over it), the
    layouts in cost/kernels.py MATMUL_LAYOUTS order ([Note: matmul layouts])."""
    rates = []
    for layout in range(len(MATMUL_LAYOUTS)):
        a, b = layout_operands(n, n, n, layout, device, dtype)
        rates.append(2.0 * n**3 / device_time_s(lambda: a @ b, device, repeats))
    best = max(rates)
    return best, tuple(r / best for r in rates)


def fit_matmul(samples: list[Sample], peak: float, bandwidth: float, sm_count: int,
               max_split_k: int) -> tuple[dict, float]:
    """Grid over tile, tile K, stages and ridge; matmul_efficiency closed form over the FLOP-bound samples.
    Returns ({constant: value}, mean squared log error)."""
    meas = [s.time_s for s in samples]
    best = None
    for tile, tk, stages, ridge in itertools.product(TILE_GRID, TILE_K_GRID, STAGES_GRID, RIDGE_GRID):
        kc = _constants(sm_count=sm_count, matmul_tiles=((tile, tile),), matmul_tile_k=tk, matmul_stages=stages,
                        l2_bytes_per_clk_per_sm=CLOCK_NORM / ridge, max_split_k=max_split_k)
        dev = Device(kc, peak, bandwidth)
        at_one = [matmul_time_s(s.op, dev) for s in samples]
        bound = [(a, t) for a, t, s in zip(at_one, meas, samples) if a > s.op.bytes / bandwidth * (1 + 1e-9)]
        eff = _closed_form_eff(*zip(*bound), cap=math.inf) if bound else 1.0
        # above 1 (the reference peak was slowed): the same prices as peak x eff at efficiency 1
        dev = Device(_constants(kc, matmul_efficiency=min(eff, 1.0)), peak * max(eff, 1.0), bandwidth)
        err = _msle([matmul_time_s(s.op, dev) for s in samples], meas)
        if best is None or err < best[1] - 1e-12:
            best = (dict(matmul_efficiency=eff, matmul_tiles=((tile, tile),), matmul_tile_k=tk,
                         matmul_stages=stages, l2_bytes_per_clk_per_sm=CLOCK_NORM / ridge), err)
    return best


def measure_dispatch_floor_s(device: torch.device, repeats: int) -> float:
    """The fixed cost each timed call pays that the cost model prices apart. CPU: the fastest call of a
    one-element add, what every eager op pays before its kernel works (``per_op_overhead_s``). CUDA: the
    device's gap between kernels in a replayed graph (``kernel_launch_s``; execute/kernel_timing.py)."""
    if device.type == "cuda":
        return measure_launch_s(device)
    x = torch.zeros(1)
    return device_time_s(lambda: x + x, device, 10 * repeats)


def _less_floor(t: float, floor_s: float) -> float:
    return max(t - floor_s, 0.1 * t)


def _forward_backward_s(forward, device: torch.device, grad: torch.Tensor, repeats: int,
                        floor_s: float) -> tuple[float, float]:
    """Seconds of ``forward()`` alone and of its backward (forward + backward less the forward, at least
    5% of the pair), each less the dispatch floor."""
    raw_fwd = device_time_s(forward, device, repeats)
    t_both = device_time_s(lambda: forward().backward(grad), device, repeats)
    return _less_floor(raw_fwd, floor_s), _less_floor(max(t_both - raw_fwd, 0.05 * t_both), floor_s)


def measure_matmuls(device: torch.device, dtype: torch.dtype, repeats: int, quick: bool,
                    floor_s: float = 0.0) -> list[Sample]:
    scale = 8 if device.type == "cuda" else 1
    shapes = MATMUL_SHAPES[1:] if quick and device.type == "cpu" else MATMUL_SHAPES
    out = []
    elt = torch.empty((), dtype=dtype).element_size()
    for m, n, k in shapes:
        m, n, k = m * scale, n * scale, k * scale
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        out.append(Sample(matmul_op(m, n, k, elt), _less_floor(device_time_s(lambda: a @ b, device, repeats), floor_s)))
    return out


# ---- attention ----

def attention_ops(bh: int, s: int, d: int, causal: int, elt_bytes: int) -> tuple[KernelOp, KernelOp]:
    """Forward and backward ops as the trace counts them (trace/flops.py: causal in full, backward 2.5x)."""
    fwd_flops = 4.0 * bh * s * s * d
    io = float(4 * bh * s * d * elt_bytes)  # q, k, v read, o written
    dims = (bh, s, s, d, causal)
    return (KernelOp("attention_fwd", 1, fwd_flops, io, dims),
            KernelOp("attention_bwd", 1, BWD_MATMUL_PER_EXP * fwd_flops, 2 * io, dims))


def fit_attention(fwd: list[Sample], bwd: list[Sample], peak: float, bandwidth: float,
                  cap: float = 1.0, tile_cost: bool = False) -> tuple[dict, float]:
    """Grid over block, tile overhead and head-dim ratio r; each direction's efficiency closed form, at
    most ``cap`` (1 against the sweep's own GEMM peak). ``tile_cost`` (a CPU): also a fixed time per
    visited tile in each direction, closed form beside the efficiency, and the key block over
    KV_BLOCK_GRID (cost/kernels.py [Note: attention tiles on a CPU])."""
    best = None
    kv_grid = KV_BLOCK_GRID if tile_cost else (0,)
    for block, over, r, kv in itertools.product(BLOCK_GRID, TILE_OVERHEAD_GRID, EXP_RATIO_GRID, kv_grid):
        if kv and kv < block:
            continue
        kc = _constants(attention_block=block, attention_tile_overhead=over, exp_per_clk_per_sm=CLOCK_NORM / (4 * r),
                        attention_kv_block=kv)
        dev = Device(kc, peak, bandwidth)
        fitted, err = {}, 0.0
        for d, samples, backward in (("fwd", fwd, False), ("bwd", bwd, True)):
            name, tile_name = f"attention_{d}_efficiency", f"attention_tile_{d}_s"
            meas = [s.time_s for s in samples]
            half = Device(_constants(kc, **{name: 0.5}), peak, bandwidth)
            at_one = [attention_time_s(s.op, dev, backward) for s in samples]
            at_half = [attention_time_s(s.op, half, backward) for s in samples]
            if tile_cost:
                tiles = [s.op.count * s.op.dims[0] * attention_tiles(s.op.dims[1], s.op.dims[2], bool(s.op.dims[4]), kc)
                         for s in samples]
                eff, tile_s = _affine_eff_tile(at_one, at_half, tiles, meas, cap)
            else:
                eff, tile_s = _affine_eff(at_one, at_half, meas, cap), 0.0
            fit = Device(_constants(kc, **{name: eff, tile_name: tile_s}), peak, bandwidth)
            err += _msle([attention_time_s(s.op, fit, backward) for s in samples], meas) * len(samples)
            fitted.update({name: eff, tile_name: tile_s})
        err /= len(fwd) + len(bwd)
        if best is None or err < best[1] - 1e-12:
            best = (dict(fitted, attention_block=block, attention_tile_overhead=over,
                         exp_per_clk_per_sm=CLOCK_NORM / (4 * r), attention_kv_block=kv), err)
    return best


def measure_attention(device: torch.device, dtype: torch.dtype, repeats: int,
                      quick: bool, floor_s: float = 0.0) -> tuple[list[Sample], list[Sample]]:
    import torch.nn.functional as F

    scale = 2 if device.type == "cuda" else 1  # GPU: longer sequences (x2) and more heads (x8)
    shapes = ATTENTION_SHAPES[:2] + ATTENTION_SHAPES[3:] if quick and device.type == "cpu" else ATTENTION_SHAPES
    fwd, bwd = [], []
    elt = torch.empty((), dtype=dtype).element_size()
    for bh, s, d, causal in shapes:
        bh, s = bh * scale ** 3, s * scale
        q, k, v = (torch.randn(1, bh, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

        def forward():
            return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))

        grad = torch.ones(1, bh, s, d, device=device, dtype=dtype)
        fwd_s, bwd_s = _forward_backward_s(forward, device, grad, repeats, floor_s)
        op_f, op_b = attention_ops(bh, s, d, causal, elt)
        fwd.append(Sample(op_f, fwd_s))
        bwd.append(Sample(op_b, bwd_s))
    return fwd, bwd


# ---- convolution ----

def measure_convolutions(device: torch.device, dtype: torch.dtype, repeats: int,
                         floor_s: float = 0.0) -> tuple[list[Sample], list[Sample]]:
    """3x3 convolutions (CONV_SHAPES): forward alone, backward (input and weight gradients) as forward +
    backward less the forward; FLOPs counted by FlopCounterMode, as the tracer counts them."""
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    scale = 4 if device.type == "cuda" else 1
    fwd, bwd = [], []
    elt = torch.empty((), dtype=dtype).element_size()
    for b, c, hw in CONV_SHAPES:
        b, c = b * scale, c * scale
        x = torch.randn(b, c, hw, hw, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(c, c, 3, 3, device=device, dtype=dtype, requires_grad=True)
        grad = torch.ones(b, c, hw, hw, device=device, dtype=dtype)

        def forward():
            return F.conv2d(x, w, padding=1)

        counter = FlopCounterMode(display=False)
        with counter:
            forward()
        fwd_flops = counter.get_total_flops()
        with counter:
            forward().backward(grad)
        bwd_flops = counter.get_total_flops() - fwd_flops
        io = float((2 * x.numel() + w.numel()) * elt)  # input and weight read, output written
        fwd_s, bwd_s = _forward_backward_s(forward, device, grad, repeats, floor_s)
        fwd.append(Sample(KernelOp("conv_fwd", 1, float(fwd_flops), io), fwd_s))
        bwd.append(Sample(KernelOp("conv_bwd", 1, float(bwd_flops), 2 * io), bwd_s))
    return fwd, bwd


def fit_conv(fwd: list[Sample], bwd: list[Sample], peak: float, bandwidth: float,
             call_cost: bool = False) -> tuple[dict, float]:
    """Each direction's efficiency, closed form over the samples (uncapped: a convolution may run other
    code than the GEMMs the peak was measured on); ``call_cost`` (a CPU): and a fixed time per call beside
    it, closed form (:func:`_affine_eff_tile` with one "tile" per call)."""
    dev = Device(_constants(conv_fwd_efficiency=1.0, conv_bwd_efficiency=1.0), peak, bandwidth)
    half = Device(_constants(conv_fwd_efficiency=0.5, conv_bwd_efficiency=0.5), peak, bandwidth)
    out, err = {}, 0.0
    for d, samples, backward in (("fwd", fwd, False), ("bwd", bwd, True)):
        name, call_name = f"conv_{d}_efficiency", f"conv_call_{d}_s"
        meas = [s.time_s for s in samples]
        at_one = [conv_time_s(s.op, dev, backward) for s in samples]
        if call_cost:
            eff, call_s = _affine_eff_tile(at_one, [conv_time_s(s.op, half, backward) for s in samples],
                                           [s.op.count for s in samples], meas, cap=math.inf)
        else:
            eff, call_s = _closed_form_eff(at_one, meas, cap=math.inf), 0.0
        fitted = Device(_constants(**{name: eff, call_name: call_s}), peak, bandwidth)
        err += _msle([conv_time_s(s.op, fitted, backward) for s in samples], meas) * len(samples)
        out.update({name: eff, call_name: call_s})
    return out, err / (len(fwd) + len(bwd))


# ---- memory-bound kernels and launch ----

def measure_memory_efficiency(device: torch.device, copy_bytes_per_s: float, repeats: int) -> tuple[float, dict]:
    """Median over elementwise / norm / reduction kernels of achieved bytes/s, / the copy bandwidth, <= 1."""
    import torch.nn.functional as F

    n = ELEMENTWISE_NUMEL[device.type]
    a = torch.randn(n, device=device)
    b = torch.randn(n, device=device)
    rows = a.view(-1, 1024)
    kernels = {  # name: (fn, bytes read + written)
        "add": (lambda: a + b, 12 * n), "mul": (lambda: a * b, 12 * n), "gelu": (lambda: F.gelu(a), 8 * n),
        "softmax": (lambda: torch.softmax(rows, -1), 8 * n),
        "layer_norm": (lambda: F.layer_norm(rows, (1024,)), 8 * n), "sum": (lambda: rows.sum(-1), 4 * n),
    }
    achieved = {k: nbytes / device_time_s(fn, device, repeats) for k, (fn, nbytes) in kernels.items()}
    return min(1.0, statistics.median(achieved.values()) / copy_bytes_per_s), achieved


# ---- collectives ----

@dataclass(frozen=True)
class CurveFit:
    """A collective's fit: latency per ring step, busbw plateau and n_1/2 (module docstring)."""

    latency_s: float
    busbw_bytes_per_s: float
    busbw_half_bytes: float
    samples: tuple[tuple[int, int, float], ...]  # (group size, bytes, fastest seconds)

    def time_s(self, nbytes: float, p: int) -> float:
        return ring_time_s(nbytes, p, self.latency_s, self.busbw_bytes_per_s, self.busbw_half_bytes)


def _weighted_lsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares of relative error (weights 1/y^2) for y = rows . x."""
    import numpy as np

    a = np.array(rows, dtype=float) / np.array(ys, dtype=float)[:, None]
    return [float(v) for v in np.linalg.lstsq(a, np.ones(len(ys)), rcond=None)[0]]


def fit_curve(samples: list[tuple[int, int, float]]) -> CurveFit:
    """Fit t = alpha (p-1) + (p-1)/p (n + n_1/2) / plateau to (p, n, t) samples, least squares on relative
    error, linear in (alpha, n_1/2 / plateau, 1 / plateau). alpha and n_1/2 are told apart only across
    group sizes (alpha grows with p - 1, the n_1/2 term with (p-1)/p); at one group size both are one
    fixed time, counted as latency per ring step (gloo and NCCL's rings pay it per step) with n_1/2 = 0.
    A negative alpha or n_1/2 is refitted at 0."""
    ps = [float(p) for p, _, _ in samples]
    feats = {"alpha": [p - 1 for p in ps], "half": [(p - 1) / p for p in ps],
             "inv_bw": [(p - 1) / p * n for p, (_, n, _) in zip(ps, samples)]}
    ys = [t for _, _, t in samples]
    terms = ["alpha", "half", "inv_bw"] if len(set(ps)) > 1 else ["alpha", "inv_bw"]
    while True:
        x = dict(zip(terms, _weighted_lsq([[feats[k][i] for k in terms] for i in range(len(ys))], ys)))
        neg = [k for k in ("alpha", "half") if k in x and x[k] < 0]
        if not neg or len(terms) == 1:
            break
        terms.remove(neg[0])
    inv_bw = x.get("inv_bw", 0.0)
    busbw = 1.0 / inv_bw if inv_bw > 0 else 1e15  # flat: bandwidth unbounded at these sizes
    return CurveFit(max(0.0, x.get("alpha", 0.0)), busbw, max(0.0, x.get("half", 0.0)) * busbw if inv_bw > 0 else 0.0,
                    tuple(samples))


def slower(fits: dict[str, CurveFit], p: int) -> str:
    """The collective whose fit is slower summed over the sampled sizes."""
    return max(fits, key=lambda k: sum(fits[k].time_s(n, p) for _, n, _ in fits[k].samples))
