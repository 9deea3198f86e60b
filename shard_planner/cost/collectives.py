"""Collective times: the alpha-beta ring model, intra- vs inter-node, hierarchical for HSDP.

For a ring all-gather or reduce-scatter over p ranks of a buffer of ``nbytes`` (the full, unsharded
size), nccl-tests define bus bandwidth so that

    time = latency_s * (p - 1) + (p - 1) / p * nbytes / busbw_bytes_per_s

(nccl-tests doc/PERFORMANCE.md: busbw = algbw * (n-1)/n for all-gather and reduce-scatter, and
2 (n-1)/n for all-reduce, which is a reduce-scatter followed by an all-gather). A group whose ranks are
all on one node uses the profile's intra-node latency and busbw; a group that spans nodes is limited
by its slowest link, the inter-node one (per GPU).

Rank layout: ranks are numbered node by node (torchrun's default), the shard group is contiguous and
the replicate group (HSDP) strides by the shard size — the ("replicate", "shard") mesh of
``init_device_mesh``.
"""

from __future__ import annotations

from shard_planner.profile import HardwareProfile


def _link(profile: HardwareProfile, spans_nodes: bool) -> tuple[float, float]:
    ic = profile.interconnect
    if spans_nodes:
        return ic.inter_node_latency_s, ic.inter_node_busbw_bytes_per_s
    return ic.intra_node_latency_s, ic.intra_node_busbw_bytes_per_s


def shard_group_spans_nodes(profile: HardwareProfile, group_size: int) -> bool:
    """A contiguous group of ``group_size`` ranks leaves its node when it is larger than a node."""
    return group_size > profile.interconnect.gpus_per_node


def replicate_group_spans_nodes(profile: HardwareProfile, shard_size: int, replicate: int) -> bool:
    """Replicas stride by ``shard_size`` ranks: they share a node only if all of them fit in one."""
    return replicate > 1 and shard_size * replicate > profile.interconnect.gpus_per_node


def ring_time_s(nbytes: float, group_size: int, latency_s: float, busbw_bytes_per_s: float) -> float:
    """One ring all-gather or reduce-scatter of ``nbytes`` (the unsharded size) over ``group_size`` ranks."""
    if group_size <= 1 or nbytes <= 0:
        return 0.0
    return latency_s * (group_size - 1) + (group_size - 1) / group_size * nbytes / busbw_bytes_per_s


def all_gather_time_s(profile: HardwareProfile, nbytes: float, group_size: int) -> float:
    """All-gather over a contiguous group (FSDP's shard group, or a smaller reshard group)."""
    lat, bw = _link(profile, shard_group_spans_nodes(profile, group_size))
    return ring_time_s(nbytes, group_size, lat, bw)


def ring_bandwidth_s(profile: HardwareProfile, nbytes: float, group_size: int) -> float:
    """The bandwidth term alone of an all-gather or reduce-scatter over a contiguous group: bytes that
    join another collective of the same group (the solver's linear model, for modules that join the
    root unit's all-gather and reduce-scatter)."""
    _, bw = _link(profile, shard_group_spans_nodes(profile, group_size))
    return ring_time_s(nbytes, group_size, 0.0, bw)


def replica_all_reduce_time_s(profile: HardwareProfile, nbytes: float, shard_size: int, replicate: int) -> float:
    """HSDP: the all-reduce of the 1/shard reduce-scatter output of ``nbytes`` across the replicas
    (all-reduce = reduce-scatter + all-gather: two ring passes); 0 without replicas."""
    if replicate <= 1:
        return 0.0
    lat, bw = _link(profile, replicate_group_spans_nodes(profile, shard_size, replicate))
    return 2 * ring_time_s(nbytes / shard_size, replicate, lat, bw)


def reduce_scatter_time_s(profile: HardwareProfile, nbytes: float, shard_size: int, replicate: int = 1) -> float:
    """Gradient reduction: reduce-scatter of ``nbytes`` in the shard group, then for HSDP an all-reduce of
    the 1/shard result across the replicas (FSDP2 ``foreach_reduce``; a hierarchical reduction)."""
    lat, bw = _link(profile, shard_group_spans_nodes(profile, shard_size))
    t = ring_time_s(nbytes, shard_size, lat, bw)
    if replicate > 1:
        t += replica_all_reduce_time_s(profile, nbytes, shard_size, replicate)
    return t
