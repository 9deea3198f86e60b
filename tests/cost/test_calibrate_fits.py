"""Fits of `shard-planner calibrate` (execute/calibrate_kernels.py): each recovers the constants that
generated synthetic samples through the cost model's own functions; the written profile loads, validates,
prices with the roofline and round-trips its [kernels] table."""

from __future__ import annotations

import math

import pytest
import torch

from shard_planner.cost.collectives import ring_time_s
from shard_planner.cost.kernels import Device, KernelConstants, attention_time_s, matmul_time_s
from shard_planner.execute import calibrate_kernels as ck
from shard_planner.execute import kernel_calibration as kcal_mod
from shard_planner.hardware.profile import Interconnect, load_profile

PEAK, BW = 1e11, 2e10


def _kc(**kw) -> KernelConstants:
    return ck._constants(**kw)


def test_matmul_fit_recovers_tile_pipeline_and_efficiency():
    truth = dict(matmul_efficiency=0.7, matmul_tiles=((32, 32),), matmul_tile_k=16, matmul_stages=4,
                 l2_bytes_per_clk_per_sm=ck.CLOCK_NORM / 1e-3)
    dev = Device(_kc(**truth), PEAK, BW)
    samples = [ck.Sample(op, matmul_time_s(op, dev)) for op in
               (ck.matmul_op(m, n, k, 4) for m, n, k in ck.MATMUL_SHAPES)]
    fit, err = ck.fit_matmul(samples, PEAK, BW, sm_count=1, max_split_k=1)
    assert err < 1e-12
    assert fit["matmul_tiles"] == ((32, 32),) and fit["matmul_tile_k"] == 16 and fit["matmul_stages"] == 4
    assert fit["matmul_efficiency"] == pytest.approx(0.7, rel=1e-9)


def test_matmul_fit_above_one_means_the_reference_peak_was_slow():
    dev = Device(_kc(matmul_tiles=((64, 64),), matmul_tile_k=64, matmul_stages=1), 1.5 * PEAK, BW)
    samples = [ck.Sample(op, matmul_time_s(op, dev)) for op in
               (ck.matmul_op(m, n, k, 4) for m, n, k in ck.MATMUL_SHAPES[:6])]
    fit, err = ck.fit_matmul(samples, PEAK, BW, sm_count=1, max_split_k=1)
    assert err < 1e-12 and fit["matmul_efficiency"] == pytest.approx(1.5, rel=1e-9)


def _attention_samples(truth: KernelConstants, elt_bytes: int):
    """Forward and backward samples of ATTENTION_SHAPES priced by ``truth`` (what a fit must recover)."""
    dev = Device(truth, PEAK, BW)
    fwd, bwd = [], []
    for bh, s, d, causal in ck.ATTENTION_SHAPES:
        op_f, op_b = ck.attention_ops(bh, s, d, causal, elt_bytes)
        fwd.append(ck.Sample(op_f, attention_time_s(op_f, dev, False)))
        bwd.append(ck.Sample(op_b, attention_time_s(op_b, dev, True)))
    return fwd, bwd


def test_attention_fit_recovers_block_overhead_head_dim_ratio_and_efficiencies():
    truth = _kc(attention_block=64, attention_tile_overhead=2.0, exp_per_clk_per_sm=ck.CLOCK_NORM / (4 * 8.0),
                attention_fwd_efficiency=0.6, attention_bwd_efficiency=0.45)
    fwd, bwd = _attention_samples(truth, 4)
    fit, err = ck.fit_attention(fwd, bwd, PEAK, BW)
    assert err < 1e-12
    assert fit["attention_block"] == 64 and fit["attention_tile_overhead"] == 2.0
    assert fit["exp_per_clk_per_sm"] == pytest.approx(truth.exp_per_clk_per_sm)
    assert fit["attention_fwd_efficiency"] == pytest.approx(0.6, rel=1e-9)
    assert fit["attention_bwd_efficiency"] == pytest.approx(0.45, rel=1e-9)


def test_attention_fit_with_tile_cost_recovers_the_per_tile_times_and_key_block():
    """A CPU's attention: FLOPs at an efficiency plus a fixed time per (query tile x key block) visited
    (cost/kernels.py [Note: attention tiles on a CPU]); the fit finds both per direction and the key block."""
    truth = _kc(attention_block=32, attention_tile_overhead=0.125, exp_per_clk_per_sm=ck.CLOCK_NORM / (4 * 1e-3),
                attention_fwd_efficiency=0.3, attention_bwd_efficiency=0.7, attention_kv_block=512,
                attention_tile_fwd_s=8e-6, attention_tile_bwd_s=5e-5)
    fwd, bwd = _attention_samples(truth, 2)
    fit, err = ck.fit_attention(fwd, bwd, PEAK, BW, cap=math.inf, tile_cost=True)
    assert err < 1e-12
    assert fit["attention_block"] == 32 and fit["attention_kv_block"] == 512
    assert fit["attention_tile_fwd_s"] == pytest.approx(8e-6, rel=1e-6)
    assert fit["attention_tile_bwd_s"] == pytest.approx(5e-5, rel=1e-6)
    assert fit["attention_bwd_efficiency"] == pytest.approx(0.7, rel=1e-6)
    # without the tile cost (a GPU's fit) the same samples fit worse, and no tile time is reported
    plain, plain_err = ck.fit_attention(fwd, bwd, PEAK, BW, cap=math.inf)
    assert plain_err > 1e-3 and plain["attention_tile_bwd_s"] == 0.0 and plain["attention_kv_block"] == 0


def test_conv_fit_with_call_cost_recovers_efficiency_and_time_per_call():
    from shard_planner.cost.kernels import conv_time_s

    truth = Device(_kc(conv_fwd_efficiency=0.6, conv_bwd_efficiency=0.4, conv_call_fwd_s=5e-5, conv_call_bwd_s=2e-4),
                   PEAK, BW)
    ops = [(ck.KernelOp("conv_fwd", n, f, f / 100), ck.KernelOp("conv_bwd", n, 2 * f, f / 50))
           for n, f in ((1, 1e6), (1, 2e7), (2, 1.5e8), (1, 4e8))]
    fwd = [ck.Sample(f, conv_time_s(f, truth, False)) for f, _ in ops]
    bwd = [ck.Sample(b, conv_time_s(b, truth, True)) for _, b in ops]
    fit, err = ck.fit_conv(fwd, bwd, PEAK, BW, call_cost=True)
    assert err < 1e-12
    assert fit["conv_fwd_efficiency"] == pytest.approx(0.6, rel=1e-6)
    assert fit["conv_call_bwd_s"] == pytest.approx(2e-4, rel=1e-6)
    plain, plain_err = ck.fit_conv(fwd, bwd, PEAK, BW)  # a GPU's fit: no time per call
    assert plain_err > 1e-3 and plain["conv_call_fwd_s"] == 0.0


def test_tile_fit_without_a_tile_cost_is_the_plain_fit():
    at_one, at_half, meas = [1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [2.0, 4.0, 6.0]  # eff 0.5 exactly
    eff, tile_s = ck._affine_eff_tile(at_one, at_half, [5.0, 1.0, 9.0], meas, cap=1.0)
    assert eff == pytest.approx(0.5) and tile_s == pytest.approx(0.0, abs=1e-12)


SIZES = (8, 2**12, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24)


@pytest.mark.parametrize("world", (3, 4, 8))
@pytest.mark.parametrize("alpha,busbw,half", [(5e-5, 1e9, 3e5), (2e-4, 5e8, 0.0), (1e-6, 3e11, 4e6), (0.0, 1e9, 1e5)])
def test_collective_curve_fit_recovers_latency_plateau_and_half_size(world, alpha, busbw, half):
    samples = [(p, n, ring_time_s(n, p, alpha, busbw, half)) for p in (2, world) for n in SIZES]
    fit = ck.fit_curve(samples)
    assert fit.busbw_bytes_per_s == pytest.approx(busbw, rel=1e-6)
    assert fit.busbw_half_bytes == pytest.approx(half, rel=1e-6, abs=1e-3)
    assert fit.latency_s == pytest.approx(alpha, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("p", (2, 4))
def test_collective_curve_at_one_group_size_counts_the_fixed_time_as_latency(p):
    alpha, busbw, half = 5e-5, 1e9, 3e5
    samples = [(p, n, ring_time_s(n, p, alpha, busbw, half)) for n in SIZES]
    fit = ck.fit_curve(samples)
    assert fit.busbw_half_bytes == 0.0 and fit.busbw_bytes_per_s == pytest.approx(busbw, rel=1e-6)
    assert fit.latency_s == pytest.approx(alpha + half / (p * busbw), rel=1e-6)
    for _, n, t in samples:  # the same times: at one group size the two are one fixed time
        assert fit.time_s(n, p) == pytest.approx(t, rel=1e-6)


def test_collective_curve_fit_never_goes_negative():
    samples = [(2, 8, 1e-3), (2, 2**12, 1e-3), (2, 2**16, 1e-3), (2, 2**20, 1.1e-3), (4, 8, 1e-3), (4, 2**20, 1.2e-3)]
    fit = ck.fit_curve(samples)
    assert fit.busbw_half_bytes >= 0 and fit.latency_s >= 0
    assert math.isfinite(fit.busbw_bytes_per_s) and fit.busbw_bytes_per_s > 0


def test_slower_collective_is_chosen():
    a = ck.CurveFit(1e-4, 1e9, 0.0, ((2, 8, 1e-4), (2, 2**20, 1e-3)))
    b = ck.CurveFit(1e-4, 5e8, 1e5, ((2, 8, 1e-4), (2, 2**20, 2e-3)))
    assert ck.slower({"all_gather": a, "reduce_scatter": b}, 2) == "reduce_scatter"


def _written_profile(tmp_path, kcal):
    from shard_planner.execute.calibrate import Overheads, kernels_table, to_toml
    from shard_planner.hardware.profile import HardwareProfile

    curve = ck.CurveFit(1e-4, 8e8, 4e5, ((2, 8, 2e-4), (2, 2**20, 1.5e-3)))
    ic = Interconnect(gpus_per_node=64, intra_node_latency_s=1e-4, intra_node_busbw_bytes_per_s=8e8,
                      inter_node_latency_s=1e-4, inter_node_busbw_bytes_per_s=8e8,
                      intra_node_busbw_half_bytes=4e5, inter_node_busbw_half_bytes=4e5)
    prof = HardwareProfile(name="written", device="cpu", memory_bytes=2**34, usable_fraction=0.8, reserved_bytes=0,
                           per_process_group_bytes=0, peak_flops_per_s={"float32": 9e10, "bfloat16": 1e9,
                                                                        "float16": 1e9},
                           compute_efficiency=1.0, memory_bandwidth_bytes_per_s=2e10,
                           host_to_device_bytes_per_s=2e10, interconnect=ic, reduce_scatter_temp_fraction=1.0,
                           per_op_overhead_s=9e-6, per_unit_overhead_s=3e-3,
                           per_param_tensor_optimizer_overhead_s=3e-4,
                           kernels=kernels_table(kcal), compute_model="roofline")
    over = Overheads(9e-6, 225, 2e-3, 3e-3, 4e-3, 1e-3, ((1, 0.03), (16, 0.09)), 3e-4, ((32, 0.01),))
    path = tmp_path / "written.toml"
    path.write_text(to_toml(prof, {"all_gather": curve, "reduce_scatter": curve}, 2, over, kcal))
    return prof, load_profile(str(path))


def test_written_profile_loads_validates_and_round_trips(tmp_path):
    kc = _kc(matmul_efficiency=0.9, matmul_tiles=((32, 32),), matmul_tile_k=8, matmul_stages=3,
             attention_fwd_efficiency=0.8, attention_bwd_efficiency=0.5, attention_block=128,
             attention_tile_overhead=0.25, memory_efficiency=0.6, exp_per_clk_per_sm=16.0)
    op = ck.matmul_op(64, 64, 64, 4)
    kcal = kcal_mod.KernelCalibration(kc, "float32", 9e10, 3e-6, 0.1, 0.03, (ck.Sample(op, 1e-5),),
                                (ck.Sample(ck.attention_ops(8, 64, 64, 1, 4)[0], 2e-4),), {"add": 2e10})
    prof, loaded = _written_profile(tmp_path, kcal)
    assert loaded.compute_model == "roofline"
    assert KernelConstants.from_table(loaded.kernels) == kc  # the [kernels] table round-trips
    for f in ("peak_flops_per_s", "memory_bandwidth_bytes_per_s", "per_op_overhead_s", "per_unit_overhead_s",
              "per_param_tensor_optimizer_overhead_s", "interconnect", "memory_bytes", "device"):
        got, want = getattr(loaded, f), getattr(prof, f)
        if isinstance(want, dict):
            assert got == pytest.approx(want, rel=1e-3)
        elif isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-3)
        elif f == "interconnect":
            for k in vars(want):
                assert getattr(got, k) == pytest.approx(getattr(want, k), rel=1e-3)
        else:
            assert got == want


def test_bf16_sub_table_round_trips_and_prices_bf16_only(tmp_path):
    """CPU bf16's own GEMM layouts and attention ([kernels.bfloat16]) load back and replace the base
    constants for bf16 compute only (cost/kernels.py kernel_constants)."""
    from shard_planner.cost.kernels import device_of, kernel_constants

    kc = _kc(matmul_efficiency=0.9, matmul_tiles=((32, 32),), attention_fwd_efficiency=0.8,
             attention_bwd_efficiency=0.5)
    att = dict(attention_fwd_efficiency=0.3, attention_bwd_efficiency=0.1, attention_block=64,
               attention_tile_overhead=0.5, exp_per_clk_per_sm=128.0, attention_tile_fwd_s=0.0,
               attention_tile_bwd_s=4e-5, attention_kv_block=512)
    conv_op = ck.KernelOp("conv_fwd", 1, 1.5e8, 1e6)
    bf16 = kcal_mod.DtypeCalibration("bfloat16", 1.5e10, (1.0, 0.08, 0.09, 0.97), att, 0.02,
                               (ck.Sample(ck.attention_ops(8, 64, 64, 1, 2)[0], 3e-4),),
                               {"conv_fwd_efficiency": 0.04, "conv_bwd_efficiency": 0.5},
                               (ck.Sample(conv_op, 0.1), ck.Sample(ck.KernelOp("conv_bwd", 1, 3e8, 2e6), 0.03)))
    kcal = kcal_mod.KernelCalibration(kc, "float32", 9e10, 3e-6, 0.1, 0.03, (ck.Sample(ck.matmul_op(64, 64, 64, 4), 1e-5),),
                                (ck.Sample(ck.attention_ops(8, 64, 64, 1, 4)[0], 2e-4),), {"add": 2e10}, (bf16,))
    _, loaded = _written_profile(tmp_path, kcal)
    assert kernel_constants(loaded, "float32") == kc == kernel_constants(loaded)
    got = kernel_constants(loaded, "bfloat16")
    assert got.matmul_layout_efficiency == pytest.approx((1.0, 0.08, 0.09, 0.97), rel=1e-3)
    assert got.attention_bwd_efficiency == pytest.approx(0.1) and got.attention_block == 64
    assert got.attention_tile_bwd_s == pytest.approx(4e-5) and got.attention_kv_block == 512
    assert kernel_constants(loaded, "float32").attention_tile_bwd_s == 0.0
    assert got.matmul_tiles == kc.matmul_tiles  # keys the sub-table does not name stay the base's
    assert got.conv_fwd_efficiency == pytest.approx(0.04) and kc.conv_fwd_efficiency is None
    dev = device_of(loaded, "bfloat16")
    kk, kn = (ck.KernelOp("matmul", 1, 2.0 * 512**3, 3.0 * 512 * 512 * 2, (1, 512, 512, 512, layout)) for layout in (0, 1))
    assert matmul_time_s(kn, dev) == pytest.approx(matmul_time_s(kk, dev) / 0.08, rel=1e-6)


def test_layout_operands_have_the_layout_the_trace_records():
    """The calibration's operands of each layout are classified as that layout by the tracer, and the
    measured factors are fractions of the fastest."""
    from shard_planner.trace.kernel_ops import matmul_layout

    for layout in range(4):
        a, b = ck.layout_operands(8, 8, 8, layout, torch.device("cpu"), torch.float32)
        assert matmul_layout(a, b) == layout
    peak, eff = ck.measure_layouts(torch.device("cpu"), torch.float32, 1, n=32)
    assert peak > 0 and max(eff) == 1.0 and all(0 < e <= 1 for e in eff)


def test_convolution_efficiencies_fit_their_samples():
    peak, bw = 2e10, 1e10
    f = [ck.Sample(ck.KernelOp("conv_fwd", 1, 1.5e8, 1e6), 1.5e8 / (peak * 0.05))]
    b = [ck.Sample(ck.KernelOp("conv_bwd", 1, 3e8, 2e6), 3e8 / (peak * 0.5))]
    fit, err = ck.fit_conv(f, b, peak, bw)
    assert fit["conv_fwd_efficiency"] == pytest.approx(0.05) and fit["conv_bwd_efficiency"] == pytest.approx(0.5)
    assert err == pytest.approx(0.0, abs=1e-12)
