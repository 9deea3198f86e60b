"""The roofline kernel model (shard_planner/cost/kernels.py) on hand-computed shapes."""

import math

import pytest

from shard_planner.cost.kernels import (ATTENTION_BWD, ATTENTION_FWD, MATMUL, Device, KernelConstants, KernelOp,
                                        attention_efficiency, block_time_s, device_of, kernel_constants,
                                        matmul_shape_factor, op_time_s)
from shard_planner.errors import ProfileError
from shard_planner.hardware.profile import PROFILES_DIR, load_profile
from shard_planner.plan.numerics import Numerics

# A toy device: 4 SMs, one 128x128 tile (K slices of 32, 3 stages), ridge 2048 / 32 = 64 FLOP/byte.
KC = KernelConstants(
    sm_count=4, matmul_efficiency=0.8, matmul_tiles=((128, 128),), matmul_tile_k=32, matmul_stages=3,
    tensor_flop_per_clk_per_sm=2048, l2_bytes_per_clk_per_sm=32, exp_per_clk_per_sm=16,
    attention_fwd_efficiency=0.73, attention_bwd_efficiency=0.63, attention_block=128,
    attention_tile_overhead=1.0, memory_efficiency=0.9, kernel_launch_s=1e-6)
DEV = Device(KC, peak_flops_per_s=100e12, memory_bandwidth_bytes_per_s=1e12)


def test_one_full_wave_pays_only_the_pipeline_fill():
    # 256x256 = 4 tiles = one wave of 4 SMs, no padding; K 256 runs in the time of 256 + 2 x 32
    factor, split = matmul_shape_factor(256, 256, 256, KC)
    assert split == 1
    assert factor == pytest.approx(256 / 320)


def test_wave_quantisation_and_split_k():
    # 384x256 = 6 tiles on 4 SMs: 2 waves, 75% busy. Split-K 2: 12 CTAs = 3 full waves, each K 3200.
    no_split = 384 * 256 / (2 * 4 * 128 * 128) * 6400 / (6400 + 64)
    split2 = 384 * 256 * 2 / (3 * 4 * 128 * 128) * 3200 / (3200 + 64)
    assert no_split == pytest.approx(0.742574, rel=1e-5) and split2 == pytest.approx(0.980392, rel=1e-5)
    factor, split = matmul_shape_factor(384, 256, 6400, KC)
    assert (factor, split) == (pytest.approx(split2), 2)


def test_small_tiles_starve_below_the_ridge():
    # 64x64 tile: 64*64/128 = 32 FLOP/byte against a ridge of 64: half rate; one tile, K 6400 (split-K
    # would help: 4 SMs), so compare the tile term at a size that fills the GPU with one split.
    kc = KernelConstants(**{**KC.__dict__, "matmul_tiles": ((64, 64),), "max_split_k": 1})
    factor, _ = matmul_shape_factor(128, 128, 6400, kc)
    assert factor == pytest.approx(0.5 * 6400 / 6464)


def test_matmul_time_is_the_roofline_plus_launch():
    m = n = k = 256
    op = KernelOp(MATMUL, 1, 2 * m * n * k, 2 * (m * k + k * n + m * n), (1, m, n, k))
    compute_s = 2 * m * n * k / (100e12 * 0.8 * 0.8)  # 5.24e-7 s
    memory_s = 2 * 3 * 256 * 256 / 0.9e12  # 4.37e-7 s
    assert op_time_s(op, DEV) == pytest.approx(max(compute_s, memory_s) + 1e-6)
    # memory-bound: a skinny GEMM moving far more bytes than it computes
    skinny = KernelOp(MATMUL, 3, 3 * 2 * 256 * 256 * 256, 9e9, (1, 256, 256, 256))
    assert op_time_s(skinny, DEV) == pytest.approx(9e9 / 0.9e12 + 3e-6)


def test_elementwise_at_achieved_bandwidth():
    op = KernelOp("elementwise", 10, 1e9, 9e9)
    assert op_time_s(op, DEV) == pytest.approx(0.01 + 10e-6)
    assert op_time_s(KernelOp("loss", 0, 1.0, 1.0), DEV) == 0.0


def test_attention_tiles_causal_and_head_dim():
    # 1024 tokens = 8 query tiles; each adds one tile of overhead. Full: 64 tiles visited of 64 counted.
    assert attention_efficiency(1024, 1024, 128, False, False, KC) == pytest.approx(0.73 * 64 / 72)
    # causal: 8*9/2 = 36 tiles visited, the trace counts all 64
    assert attention_efficiency(1024, 1024, 128, True, False, KC) == pytest.approx(0.73 * 64 / 44)
    # head dim 64: the exponential's share doubles; r = 2048 / (4 x 16) = 32
    eff64 = 1 / (1 / 0.73 + 32 * (1 / 64 - 1 / 128))
    assert eff64 == pytest.approx(0.617341, rel=1e-5)
    assert attention_efficiency(1024, 1024, 64, False, False, KC) == pytest.approx(eff64 * 64 / 72)
    # backward: 2.5x the matmuls per exponential
    eff_bwd64 = 1 / (1 / 0.63 + 32 / 2.5 * (1 / 64 - 1 / 128))
    assert attention_efficiency(1024, 1024, 64, False, True, KC) == pytest.approx(eff_bwd64 * 64 / 72)


def test_attention_time_uses_the_efficiency():
    flops = 4 * 16 * 1024 * 1024 * 128  # 16 heads, forward
    op = KernelOp(ATTENTION_FWD, 1, flops, 4 * 16 * 1024 * 128 * 2, (16, 1024, 1024, 128, 1))
    assert op_time_s(op, DEV) == pytest.approx(flops / (100e12 * 0.73 * 64 / 44) + 1e-6)
    bwd = KernelOp(ATTENTION_BWD, 1, 2.5 * flops, 0, (16, 1024, 1024, 128, 1))
    assert op_time_s(bwd, DEV) == pytest.approx(2.5 * flops / (100e12 * 0.63 * 64 / 44) + 1e-6)


def test_block_is_the_slower_of_device_and_host():
    ops = [KernelOp("elementwise", 1, 0, 9e6)]  # 10 us + 1 us launch
    assert block_time_s(ops, DEV, host_s=5e-6) == pytest.approx(11e-6)
    assert block_time_s(ops, DEV, host_s=50e-6) == pytest.approx(50e-6)


def test_gpu_profiles_carry_kernel_constants():
    gpu = [p.stem for p in PROFILES_DIR.glob("*.toml") if load_profile(p.stem).device == "cuda"]
    assert {"a100-40gb", "a100-80gb", "h100-80gb", "h200", "l4", "mi300x"} <= set(gpu)
    for name in gpu:
        prof = load_profile(name)  # a V100 has fp16 tensor cores and no bf16 ones (profiles/v100-32gb.toml)
        dev = device_of(prof, "bfloat16" if "bfloat16" in prof.peak_flops_per_s else "float16")
        assert dev is not None and 0 < dev.kernels.matmul_efficiency <= 1
        # a big square GEMM reaches the profile's ceiling within 3%
        factor, _ = matmul_shape_factor(16384, 16384, 16384, dev.kernels)
        assert factor == pytest.approx(1.0, abs=0.03), name
    assert kernel_constants(load_profile("cpu-gloo")) is None


def test_a100_numbers_from_the_datasheet():
    kc = kernel_constants(load_profile("a100-80gb"))
    assert kc.sm_count == 108
    assert 108 * kc.tensor_flop_per_clk_per_sm * 1.41e9 == pytest.approx(312e12, rel=0.01)
    assert math.isclose(kc.matmul_efficiency, 267.9 / 312, rel_tol=1e-3)


def test_malformed_table_is_a_profile_error():
    with pytest.raises(ProfileError, match="kernels"):
        KernelConstants.from_table({"sm_count": 108})
    with pytest.raises(ProfileError, match="fraction"):
        KernelConstants(**{**KC.__dict__, "matmul_efficiency": 1.5})


def test_sustained_clock_slows_only_the_gemms():
    # [Note: sustained clock]: a compute-bound GEMM takes 1 / fraction as long; attention and memory-bound
    # kernels keep their time; the fraction is a fraction of the boost clock (<= 1)
    throttled = Device(KernelConstants(**{**KC.__dict__, "sustained_clock_fraction": 0.9}), 100e12, 1e12)
    m = n = k = 1024
    gemm = KernelOp(MATMUL, 1, 2 * m * n * k, 2 * (m * k + k * n + m * n), (1, m, n, k))
    assert op_time_s(gemm, throttled) - 1e-6 == pytest.approx((op_time_s(gemm, DEV) - 1e-6) / 0.9)
    attn = KernelOp(ATTENTION_FWD, 1, 4 * 8 * 4096 ** 2 * 128, 1e6, (8, 4096, 4096, 128, 1))
    elementwise = KernelOp("elementwise", 10, 1e9, 9e9)
    for op in (attn, elementwise):
        assert op_time_s(op, throttled) == op_time_s(op, DEV)
    with pytest.raises(ProfileError, match="fraction"):
        KernelConstants(**{**KC.__dict__, "sustained_clock_fraction": 1.2})


def test_a100_sustained_clock_is_the_hpl_clock():
    for name in ("a100-80gb", "a100-40gb"):
        assert kernel_constants(load_profile(name)).sustained_clock_fraction == pytest.approx(1305 / 1410, rel=1e-3)


def test_matmul_layout_scales_the_gemm_rate():
    """[Note: matmul layouts]: a layout's rate is peak x its factor; 4-dim records price as "kk"."""
    slow_kn = Device(KernelConstants(**{**KC.__dict__, "matmul_layout_efficiency": (1.0, 0.1, 0.5, 1.0)}),
                     100e12, 1e12)
    m = n = k = 1024
    base = KernelOp(MATMUL, 1, 2 * m * n * k, 2 * (m * k + k * n + m * n), (1, m, n, k))
    t_kk = op_time_s(base, slow_kn) - 1e-6
    assert t_kk == pytest.approx(op_time_s(base, DEV) - 1e-6)
    for layout, factor in ((0, 1.0), (1, 0.1), (2, 0.5), (3, 1.0)):
        op = KernelOp(MATMUL, 1, base.flops, base.bytes, (1, m, n, k, layout))
        assert op_time_s(op, slow_kn) - 1e-6 == pytest.approx(t_kk / factor)
        assert op_time_s(op, DEV) == op_time_s(base, DEV)  # factors 1 (every GPU profile): layout-blind
    with pytest.raises(ProfileError, match="matmul_layout_efficiency"):
        KernelConstants(**{**KC.__dict__, "matmul_layout_efficiency": (1.0, 0.0, 1.0, 1.0)})


def test_convolutions_at_their_efficiency_or_the_gemm_rate():
    fwd = KernelOp("conv_fwd", 1, 1e12, 1e6)
    bwd = KernelOp("conv_bwd", 1, 2e12, 2e6)
    # without conv efficiencies: the large-GEMM rate (peak x matmul_efficiency), as before they existed
    assert op_time_s(fwd, DEV) - 1e-6 == pytest.approx(1e12 / (100e12 * 0.8))
    conv = Device(KernelConstants(**{**KC.__dict__, "conv_fwd_efficiency": 0.05, "conv_bwd_efficiency": 0.5}),
                  100e12, 1e12)
    assert op_time_s(fwd, conv) - 1e-6 == pytest.approx(1e12 / (100e12 * 0.05))
    assert op_time_s(bwd, conv) - 1e-6 == pytest.approx(2e12 / (100e12 * 0.5))
    memory_bound = KernelOp("conv_fwd", 1, 1e6, 1e12)
    assert op_time_s(memory_bound, conv) - 1e-6 == pytest.approx(1e12 / (1e12 * 0.9))


# ---- a fixed time per attention tile (CPU; cost/kernels.py [Note: attention tiles on a CPU]) ----
@pytest.mark.parametrize("seq, causal, bq, bk, tiles", [
    (128, True, 32, 1024, 4),  # 4 query tiles, each within the one key block
    (2048, False, 64, 512, 32 * 4),
    (2048, True, 512, 512, 1 + 2 + 3 + 4),
    (100, True, 64, 0, 1 + 2),  # key blocks of attention_block when attention_kv_block is 0
])
def test_attention_tiles(seq, causal, bq, bk, tiles):
    from shard_planner.cost.kernels import attention_tiles
    from shard_planner.execute.calibrate_kernels import _constants

    assert attention_tiles(seq, seq, causal, _constants(attention_block=bq, attention_kv_block=bk)) == tiles


def test_attention_tile_time_adds_per_call_head_and_tile():
    from shard_planner.cost.kernels import Device, KernelOp, attention_time_s
    from shard_planner.execute.calibrate_kernels import _constants

    base = _constants(attention_block=32, attention_kv_block=1024)
    tiled = _constants(base, attention_tile_fwd_s=1e-5, attention_tile_bwd_s=4e-5)
    op = KernelOp("attention_bwd", 3, 1e9, 1e6, (16, 128, 128, 16, 1))  # 3 calls, 16 batch x heads, 4 tiles each
    plain_s = attention_time_s(op, Device(base, 1e11, 1e10), True)
    assert attention_time_s(op, Device(tiled, 1e11, 1e10), True) == pytest.approx(plain_s + 3 * 16 * 4 * 4e-5)
    assert attention_time_s(op, Device(tiled, 1e11, 1e10), False) == pytest.approx(
        attention_time_s(op, Device(base, 1e11, 1e10), False) + 3 * 16 * 4 * 1e-5)


def test_attention_tile_constants_may_be_zero_but_not_negative():
    from shard_planner.errors import ProfileError
    from shard_planner.execute.calibrate_kernels import _constants

    assert _constants(attention_tile_bwd_s=0.0, attention_kv_block=0).attention_tile_bwd_s == 0.0
    with pytest.raises(ProfileError, match="attention_tile_bwd_s must be a positive number"):
        _constants(attention_tile_bwd_s=-1e-6)


def _with_memory_bound_records(trace):
    """``trace`` with a 6 MB-per-sample fp32 loss-like reduction in ln_f's forward, 9 MB in its backward and
    3 MB in the loss function: memory-bound kernel records (trace/kernel_ops.py) with no FLOPs."""
    from dataclasses import replace

    from shard_planner.trace.types import Affine, KernelRecord

    def rec(mb):
        return (KernelRecord("reduction", 1, Affine(0, 0), Affine(0, mb * 1e6)),)

    mods = tuple(replace(m, fwd_kernels=rec(6), bwd_kernels=rec(9)) if m.fqn == "ln_f" else m for m in trace.modules)
    return replace(trace, modules=mods, loss_kernels=rec(3))


def test_a_cpu_prices_memory_bound_kernels_bytes_beside_the_flops():
    # [Note: memory-bound kernels on a CPU priced from FLOPs]: before, a CPU profile priced them at 0 s
    from tests.models.report_fixtures import make_trace

    from shard_planner.cost import CostModel

    plain = make_trace(2)
    traced = _with_memory_bound_records(plain)
    cpu = load_profile("cpu-gloo")
    bw = cpu.memory_bandwidth_bytes_per_s
    before, after = CostModel(plain, cpu), CostModel(traced, cpu)
    f0, b0 = before.module_compute_s("ln_f", 4, Numerics())
    f1, b1 = after.module_compute_s("ln_f", 4, Numerics())
    assert f1 - f0 == pytest.approx(24e6 / bw) and b1 - b0 == pytest.approx(36e6 / bw)
    assert after.module_compute_s(None, 4, Numerics())[0] - before.module_compute_s(None, 4, Numerics())[0] \
        == pytest.approx(12e6 / bw)
    # the step simulator's compute holds them too (ln_f's forward and backward, the loss), at the
    # bandwidth of a rank's share of the host's cores (cost/host_share.py)
    from tests.models.report_fixtures import make_plan

    plan = make_plan(2, checkpoint_every=0)
    share_bw = after.for_world(plan.mesh.world_size).profile.memory_bandwidth_bytes_per_s
    per_sample_bytes = (6 + 9 + 3) * 1e6
    assert after.time(plan).compute_s - before.time(plan).compute_s == \
        pytest.approx(per_sample_bytes * plan.training.micro_batch / share_bw)
    # a GPU's FLOP model is fitted to whole steps, memory-bound kernels included: unchanged
    gpu = load_profile("h100-80gb")
    assert CostModel(traced, gpu).module_compute_s("ln_f", 4, Numerics()) == \
        CostModel(plain, gpu).module_compute_s("ln_f", 4, Numerics())
