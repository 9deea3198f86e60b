"""Collectives by message size (shard_planner/cost/collectives.py): hand-computed times."""

from dataclasses import replace

import pytest

from shard_planner.cost.collectives import (
    all_gather_time_s, busbw_at_bytes, reduce_scatter_time_s, replica_all_reduce_time_s, ring_bandwidth_s,
    ring_time_s,
)
from shard_planner.errors import ProfileError
from shard_planner.parallel.mesh import Mesh
from shard_planner.hardware.profile import Interconnect, load_profile

MB = 1e6


def _profile(half_intra: float, half_inter: float):
    """8 GPUs per node; intra 1 us/step at 200 GB/s, inter 10 us/step at 100 GB/s."""
    ic = Interconnect(gpus_per_node=8, intra_node_latency_s=1e-6, intra_node_busbw_bytes_per_s=200e9,
                      inter_node_latency_s=1e-5, inter_node_busbw_bytes_per_s=100e9,
                      intra_node_busbw_half_bytes=half_intra, inter_node_busbw_half_bytes=half_inter)
    return replace(load_profile("h100-80gb"), interconnect=ic)


def test_busbw_follows_hockney():
    assert busbw_at_bytes(4 * MB, 200e9, 4 * MB) == pytest.approx(100e9)  # n = n_1/2: half the plateau
    assert busbw_at_bytes(12 * MB, 200e9, 4 * MB) == pytest.approx(150e9)  # 200 x 12 / 16
    assert busbw_at_bytes(1 * MB, 200e9, 0.0) == 200e9  # no curve: the plateau


def test_all_gather_intra_node_by_hand():
    p = _profile(4 * MB, 0.0)
    # 8 ranks, 8 MB: 7 x 1 us + 7/8 x (8 + 4) MB / 200 GB/s = 7 us + 52.5 us
    assert all_gather_time_s(p, 8 * MB, Mesh(8)) == pytest.approx(59.5e-6)
    # the same at busbw(n) = 200 x 8 / 12 = 133.3 GB/s: 7/8 x 8 MB / 133.3 GB/s = 52.5 us
    at_8mb = busbw_at_bytes(8 * MB, 200e9, 4 * MB)
    assert all_gather_time_s(p, 8 * MB, Mesh(8)) == pytest.approx(7e-6 + 7 / 8 * 8 * MB / at_8mb)
    # 1 MB: 7 us + 7/8 x 5 MB / 200 GB/s = 7 + 21.875 us; without the curve 7 + 4.375 us
    assert all_gather_time_s(p, 1 * MB, Mesh(8)) == pytest.approx(28.875e-6)
    assert all_gather_time_s(_profile(0.0, 0.0), 1 * MB, Mesh(8)) == pytest.approx(11.375e-6)


def test_effective_busbw_rises_with_size():
    p = _profile(4 * MB, 0.0)
    sizes = [2 ** k for k in range(16, 32)]
    busbw = [7 / 8 * n / all_gather_time_s(p, n, Mesh(8)) for n in sizes]
    assert all(b2 > b1 for b1, b2 in zip(busbw, busbw[1:]))
    assert busbw[-1] == pytest.approx(200e9, rel=0.01)  # 2 GiB: at the plateau within 1%
    assert busbw[6] < 0.5 * 200e9  # 4 MiB: below half (n_1/2 plus the latency term)


def test_inter_node_and_hsdp_by_hand():
    p = _profile(4 * MB, 2 * MB)
    # 16 ranks span two nodes: inter-node link. 16 MB: 15 x 10 us + 15/16 x (16 + 2) MB / 100 GB/s
    assert reduce_scatter_time_s(p, 16 * MB, Mesh(16)) == pytest.approx(150e-6 + 168.75e-6)
    # HSDP 8 x 4: the shard group (8) is intra-node; the replicas (4, stride 8) span nodes. Replica all-reduce of
    # 32 MB / 8 = 4 MB: 2 x (3 x 10 us + 3/4 x (4 + 2) MB / 100 GB/s) = 2 x (30 + 45) us
    assert replica_all_reduce_time_s(p, 32 * MB, Mesh(8, 4)) == pytest.approx(150e-6)
    # reduce-scatter in the shard group: 7 us + 7/8 x (32 + 4) MB / 200 GB/s = 7 + 157.5 us (the all-reduce apart)
    assert reduce_scatter_time_s(p, 32 * MB, Mesh(8, 4)) == pytest.approx(164.5e-6)


def test_marginal_bytes_run_at_the_plateau():
    """Bytes that join another collective cost their bandwidth at the plateau: the time is linear in n,
    so a + b priced together equals a priced alone plus ring_bandwidth_s(b)."""
    p = _profile(4 * MB, 2 * MB)
    a, b = 3 * MB, 5 * MB
    for n in (8, 16):
        m = Mesh(n)
        assert all_gather_time_s(p, a + b, m) == pytest.approx(all_gather_time_s(p, a, m) + ring_bandwidth_s(p, b, m))
    assert ring_bandwidth_s(p, 8 * MB, Mesh(8)) == pytest.approx(7 / 8 * 8 * MB / 200e9)


def test_profiles_without_the_curve_price_as_before():
    """cpu-gloo (no n_1/2): exactly the alpha-beta ring model."""
    gloo = load_profile("cpu-gloo")
    ic = gloo.interconnect
    assert ic.intra_node_busbw_half_bytes == 0.0 and ic.inter_node_busbw_half_bytes == 0.0
    n = 3.5 * MB
    expected = ic.intra_node_latency_s * 3 + 3 / 4 * n / ic.intra_node_busbw_bytes_per_s
    assert all_gather_time_s(gloo, n, Mesh(4)) == expected
    assert ring_time_s(n, 4, ic.intra_node_latency_s, ic.intra_node_busbw_bytes_per_s) == expected


def test_shipped_nvlink_profiles_have_the_curve():
    for name in ("a100-80gb", "a100-40gb", "h100-80gb", "h200"):
        ic = load_profile(name).interconnect
        # n_1/2 / plateau: the ~11 us ramp of the cited nccl-tests curve
        assert ic.intra_node_busbw_half_bytes / ic.intra_node_busbw_bytes_per_s == pytest.approx(11e-6, rel=0.1)


def test_negative_half_size_is_rejected():
    with pytest.raises(ProfileError, match="intra_node_busbw_half_bytes"):
        Interconnect(gpus_per_node=8, intra_node_latency_s=0, intra_node_busbw_bytes_per_s=1, inter_node_latency_s=0,
                     inter_node_busbw_bytes_per_s=1, intra_node_busbw_half_bytes=-1)
