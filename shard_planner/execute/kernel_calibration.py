"""One kernel calibration of a device: the sweeps of execute/calibrate_kernels.py run and fitted into the
profile's ``[kernels]`` table and its per-dtype sub-tables, and the TOML lines that say how each
constant was measured (the measurements and fits themselves are documented in calibrate_kernels.py)."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field

import torch

from shard_planner.cost.kernels import MATMUL_LAYOUTS, KernelConstants
from shard_planner.execute.calibrate_kernels import (BLOCK_GRID, EXP_RATIO_GRID, KV_BLOCK_GRID, LAYOUT_N, RIDGE_GRID, STAGES_GRID,
                                                     TILE_GRID, TILE_K_GRID, TILE_OVERHEAD_GRID, Sample, _constants,
                                                     fit_attention, fit_conv, fit_matmul, measure_attention,
                                                     measure_convolutions, measure_dispatch_floor_s, measure_layouts,
                                                     measure_matmuls, measure_memory_efficiency)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DtypeCalibration:
    """A compute dtype whose kernels run other code than the sweep dtype's (CPU bf16 without native bf16
    instructions): its own peak, GEMM layout rates and attention fit, the profile's ``[kernels.<dtype>]``."""

    dtype: str
    peak_flops_per_s: float  # the fastest operand layout of a LAYOUT_N^3 GEMM
    layout_efficiency: tuple[float, ...]  # per layout, over the fastest (MATMUL_LAYOUTS order)
    attention: dict  # fit_attention's constants for this dtype
    attention_err: float
    attention_samples: tuple[Sample, ...]
    conv: dict = field(default_factory=dict)  # fit_conv's efficiencies for this dtype
    conv_samples: tuple[Sample, ...] = ()
    conv_err: float = math.nan  # fit_conv's mean squared log error

    def table(self) -> dict:
        """The ``[kernels.<dtype>]`` sub-table (cost/kernels.py kernel_constants)."""
        return dict(matmul_layout_efficiency=list(self.layout_efficiency), **self.attention, **self.conv)


@dataclass(frozen=True)
class KernelCalibration:
    constants: KernelConstants
    dtype: str  # of the sweeps
    peak_flops_per_s: float  # the sweep dtype's peak, raised to the sweep's best rate when that is higher
    floor_s: float  # dispatch floor subtracted from each sample (CPU: per eager op; CUDA: the gap per kernel)
    matmul_err: float  # the fits' mean squared log errors
    attention_err: float
    matmul_samples: tuple[Sample, ...]
    attention_samples: tuple[Sample, ...]
    achieved_bytes_per_s: dict
    by_dtype: tuple[DtypeCalibration, ...] = ()
    conv_samples: tuple[Sample, ...] = ()
    conv_err: float = math.nan


def calibrate_dtype(device: torch.device, dtype_name: str, bandwidth: float, floor_s: float, repeats: int,
                    quick: bool) -> DtypeCalibration:
    """The GEMM layouts and the attention sweep in ``dtype_name`` (module docstring)."""
    dtype = getattr(torch, dtype_name)
    logger.info("calibrate: %s GEMM layouts and attention", dtype_name)
    peak, layouts = measure_layouts(device, dtype, repeats)
    fwd, bwd = measure_attention(device, dtype, repeats, quick, floor_s)
    # uncapped: CPU bf16 attention computes in fp32 and can outrun the bf16 GEMMs (cost/kernels.py)
    at_fit, at_err = fit_attention(fwd, bwd, peak, bandwidth, cap=math.inf, tile_cost=device.type == "cpu")
    cf, cb = measure_convolutions(device, dtype, repeats, floor_s)
    conv_fit, conv_err = fit_conv(cf, cb, peak, bandwidth, call_cost=device.type == "cpu")
    return DtypeCalibration(dtype_name, peak, layouts, at_fit, at_err, tuple(fwd + bwd), conv_fit, tuple(cf + cb),
                            conv_err)


def calibrate_kernels(device: torch.device, peak_flops_per_s: dict[str, float], copy_bytes_per_s: float,
                      repeats: int = 5, quick: bool = False) -> KernelCalibration:
    """Measure the sweeps on ``device`` and fit every [kernels] constant (module docstring)."""
    dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    dtype = getattr(torch, dtype_name)
    peak = peak_flops_per_s[dtype_name]
    if device.type == "cuda":
        sm_count, max_split = torch.cuda.get_device_properties(device).multi_processor_count, 16
    else:
        sm_count, max_split = torch.get_num_threads(), 1
    mem_eff, achieved = measure_memory_efficiency(device, copy_bytes_per_s, repeats)
    bandwidth = copy_bytes_per_s * mem_eff
    floor_s = measure_dispatch_floor_s(device, repeats)
    logger.info("calibrate: GEMM shape sweep")
    mm = measure_matmuls(device, dtype, repeats, quick, floor_s)
    mm_fit, mm_err = fit_matmul(mm, peak, bandwidth, sm_count, max_split)
    if mm_fit["matmul_efficiency"] > 1:  # the sweep beat the n x n reference: it is the peak
        peak *= mm_fit["matmul_efficiency"]
        mm_fit["matmul_efficiency"] = 1.0
    logger.info("calibrate: attention forward and backward")
    fwd, bwd = measure_attention(device, dtype, repeats, quick, floor_s)
    at_fit, at_err = fit_attention(fwd, bwd, peak, bandwidth, tile_cost=device.type == "cpu")
    logger.info("calibrate: convolution forward and backward")
    cf, cb = measure_convolutions(device, dtype, repeats, floor_s)
    conv_fit, conv_err = fit_conv(cf, cb, peak, bandwidth, call_cost=device.type == "cpu")
    kc = _constants(sm_count=sm_count, max_split_k=max_split, memory_efficiency=mem_eff,
                    # on CUDA the floor is the launch gap itself (measure_dispatch_floor_s); a CPU has none
                    kernel_launch_s=floor_s if device.type == "cuda" else 0.0, **mm_fit, **at_fit, **conv_fit)
    by_dtype = (calibrate_dtype(device, "bfloat16", bandwidth, floor_s, repeats, quick),) if device.type == "cpu" else ()
    return KernelCalibration(kc, dtype_name, peak, floor_s, mm_err, at_err, tuple(mm), tuple(fwd + bwd), achieved,
                             by_dtype, tuple(cf + cb), conv_err)


def _conv_samples_text(samples) -> str:
    return ", ".join(f"{s.op.op_class[5:]} {s.op.flops / 1e6:.0f} MFLOP {s.time_s * 1e3:.3g} ms" for s in samples)


def _conv_lines(effs: dict, samples, err: float, what: str, always: bool = False) -> list[str]:
    lines = [f"conv_{d}_efficiency = {effs[f'conv_{d}_efficiency']:.4g}  # {what}3x3 convolution {d} over the GEMM "
             f"peak, closed form (fit msle {err:.3g}, both directions) over "
             f"{_conv_samples_text([s for s in samples if s.op.op_class == 'conv_' + d])}"
             for d in ("fwd", "bwd")]
    if always or any(effs.get(f"conv_call_{d}_s") for d in ("fwd", "bwd")):  # a sub-table's 0 replaces the base's
        lines += [f"conv_call_{d}_s = {effs.get(f'conv_call_{d}_s', 0.0):.4g}  # {what}3x3 convolution sweep: fixed time per "
                  f"call, closed form beside the {d} efficiency" for d in ("fwd", "bwd")]
    return lines


def _tile_lines(a: dict, what: str, always: bool = False) -> list[str]:
    """The per-tile attention time's lines (cost/kernels.py [Note: attention tiles on a CPU]); none when
    both are 0 (a GPU's fit) unless ``always`` (a dtype sub-table: its 0 must replace the base table's)."""
    if not (always or a.get("attention_tile_fwd_s") or a.get("attention_tile_bwd_s")):
        return []
    return [f"attention_tile_{d}_s = {a.get(f'attention_tile_{d}_s', 0.0):.4g}  # {what}attention sweep: closed form "
            f"beside the {d} efficiency, per batch x head x (query tile x key block) visited" for d in ("fwd", "bwd")] + [
        f"attention_kv_block = {a.get('attention_kv_block', 0)}  # {what}attention sweep: grid {KV_BLOCK_GRID} "
        "(0: attention_block)"]


def _attention_samples_text(samples) -> str:
    return ", ".join(f"{s.op.op_class[10:]} {s.op.dims[0]}x{s.op.dims[1]}x{s.op.dims[3]}{'c' if s.op.dims[4] else ''} "
                     f"{s.time_s * 1e3:.3g} ms" for s in samples)


def dtype_toml(d: DtypeCalibration, sweep_dtype: str) -> list[str]:
    """The ``[kernels.<dtype>]`` sub-table's lines, each with how it was measured."""
    rates = ", ".join(f"{name} {e * d.peak_flops_per_s / 1e9:.3g}" for name, e in zip(MATMUL_LAYOUTS, d.layout_efficiency))
    eff = ", ".join(f"{e:.4g}" for e in d.layout_efficiency)
    a = d.attention
    return [
        f"[kernels.{d.dtype}]",
        f"# {d.dtype} kernels run other code than {sweep_dtype}'s here: these keys replace [kernels]' for "
        f"{d.dtype} compute (cost/kernels.py kernel_constants). Attention samples: {_attention_samples_text(d.attention_samples)}",
        f"matmul_layout_efficiency = [{eff}]  # measured: {LAYOUT_N}^3 {d.dtype} GEMM per operand layout "
        f"(GFLOP/s {rates}) over the fastest ([Note: matmul layouts])",
        f"attention_fwd_efficiency = {a['attention_fwd_efficiency']:.4g}  # {d.dtype} attention sweep: closed form "
        f"(fit msle {d.attention_err:.3g}, both directions)",
        f"attention_bwd_efficiency = {a['attention_bwd_efficiency']:.4g}  # {d.dtype} attention sweep: closed form",
        f"attention_block = {a['attention_block']}  # {d.dtype} attention sweep: grid {BLOCK_GRID}",
        f"attention_tile_overhead = {a['attention_tile_overhead']}  # {d.dtype} attention sweep: grid {TILE_OVERHEAD_GRID}",
        f"exp_per_clk_per_sm = {a['exp_per_clk_per_sm']:.6g}  # {d.dtype} attention sweep: grid {EXP_RATIO_GRID}",
    ] + _tile_lines(a, f"{d.dtype} ", always=True) + (_conv_lines(d.conv, d.conv_samples, d.conv_err, f"{d.dtype} ", always=True) if d.conv else [])


def kernels_toml(cal: KernelCalibration) -> list[str]:
    """The [kernels] table's lines, each with how it was measured and fitted."""
    kc = cal.constants
    table = asdict(kc)  # the constants by name, for the line builders shared with the dtype sub-tables
    mm = ", ".join(f"{s.op.dims[1]}x{s.op.dims[2]}x{s.op.dims[3]} {s.time_s * 1e3:.3g} ms" for s in cal.matmul_samples)
    at = _attention_samples_text(cal.attention_samples)
    bw = ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in cal.achieved_bytes_per_s.items())
    fit = "measured by shard-planner calibrate (execute/calibrate_kernels.py)"
    return [
        "[kernels]",
        f"# The roofline kernel model (cost/kernels.py), {fit}. GEMM samples (MxNxK): {mm}",
        f"# Attention samples (batch*heads x seq x head dim, c causal): {at}",
        f"# Elementwise samples: {bw}",
        f"sm_count = {kc.sm_count}  # {'multiprocessor count' if kc.max_split_k > 1 else 'threads per rank (torch.get_num_threads)'}: not fitted",
        f"matmul_efficiency = {kc.matmul_efficiency:.4g}  # GEMM sweep: closed-form log-mean over FLOP-bound shapes (fit msle {cal.matmul_err:.3g})",
        f"matmul_tiles = [\"{kc.matmul_tiles[0][0]}x{kc.matmul_tiles[0][1]}\"]  # GEMM sweep: square tile, grid {TILE_GRID}",
        f"matmul_tile_k = {kc.matmul_tile_k}  # GEMM sweep: grid {TILE_K_GRID}",
        f"matmul_stages = {kc.matmul_stages}  # GEMM sweep: grid {STAGES_GRID}",
        f"max_split_k = {kc.max_split_k}  # {'CUDA: searched up to 16' if kc.max_split_k > 1 else 'CPU: one thread gains nothing from split-K'}",
        f"tensor_flop_per_clk_per_sm = {kc.tensor_flop_per_clk_per_sm:.6g}  # normalisation: only ratios to it enter the model",
        f"l2_bytes_per_clk_per_sm = {kc.l2_bytes_per_clk_per_sm:.6g}  # GEMM sweep: tile ridge {kc.ridge_flop_per_byte:.3g} FLOP/byte, grid {RIDGE_GRID}",
        f"exp_per_clk_per_sm = {kc.exp_per_clk_per_sm:.6g}  # attention sweep: head-dim ratio r = {kc.exp_ratio:.3g}, grid {EXP_RATIO_GRID}",
        f"attention_fwd_efficiency = {kc.attention_fwd_efficiency:.4g}  # attention sweep: closed form (fit msle {cal.attention_err:.3g}, both directions)",
        f"attention_bwd_efficiency = {kc.attention_bwd_efficiency:.4g}  # attention sweep: closed form, backward = fwd+bwd less fwd",
        f"attention_block = {kc.attention_block}  # attention sweep: grid {BLOCK_GRID}",
        f"attention_tile_overhead = {kc.attention_tile_overhead}  # attention sweep: grid {TILE_OVERHEAD_GRID}",
    ] + _tile_lines(table, "") + [
        f"memory_efficiency = {kc.memory_efficiency:.4g}  # median elementwise bytes/s / copy bandwidth, <= 1",
        f"kernel_launch_s = {kc.kernel_launch_s:.4g}  # {'CUDA graph replay of tiny kernels' if kc.max_split_k > 1 else 'CPU: 0, per_op_overhead_s holds each op fixed cost'}",
    ] + (_conv_lines(table, cal.conv_samples, cal.conv_err, "") if kc.conv_fwd_efficiency is not None else []) \
      + [line for d in cal.by_dtype for line in [""] + dtype_toml(d, cal.dtype)]
