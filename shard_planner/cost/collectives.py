"""Collective times: the alpha-beta ring model, intra- vs inter-node, hierarchical for HSDP.

For a ring all-gather or reduce-scatter over p ranks of a buffer of ``nbytes`` (the full, unsharded
size), nccl-tests define bus bandwidth so that

    time = latency_s * (p - 1) + (p - 1) / p * nbytes / busbw_bytes_per_s

(nccl-tests doc/PERFORMANCE.md: busbw = algbw * (n-1)/n for all-gather and reduce-scatter, and
2 (n-1)/n for all-reduce, which is a reduce-scatter followed by an all-gather). A group whose ranks are
all on one node uses the profile's intra-node latency and busbw; a group that spans nodes is limited
by its slowest link, the inter-node one (per GPU).

Bus bandwidth rises with message size (nccl-tests curves: small messages are latency- and
protocol-bound, NCCL's LL and LL128 protocols before Simple; large ones reach the plateau). Per link the
profile may give a half-bandwidth size n_1/2 (Hockney's form):

    busbw(n) = busbw_plateau * n / (n + n_1/2)
    so (p - 1) / p * n / busbw(n) = (p - 1) / p * (n + n_1/2) / busbw_plateau

with n the collective's message size as nccl-tests report it (the full buffer of an all-gather or
reduce-scatter; the buffer of an all-reduce). The time stays affine in n: n_1/2 adds
(p - 1) / p x n_1/2 / plateau per ring pass, a fixed cost of the protocols' ramp that, unlike the
per-step latency alpha (p - 1), hardly grows with p. A curve measured at p_ref ranks gives alpha from
its small-message floor (time / ring steps) and n_1/2 from the ramp of what remains
(profiles/h100-80gb.toml cites the curve and derives both). Without n_1/2 (0, the default) busbw is
the plateau at every size: profiles written before the curve, and cpu-gloo, price exactly as before.
Every collective of the cost model and the solver's linear model is priced by :func:`ring_time_s`.

Rank layout: ranks are numbered node by node (torchrun's default), the shard group is contiguous and
the replicate group (HSDP) strides by the shard size — the ("replicate", "shard") mesh of
``init_device_mesh``. Which group leaves a node is the layout's to say (shard_planner/parallel/mesh.py
``Mesh.*_group_spans_nodes``, [Note: which size means what]): the functions here take the plan's layout
and ask it, and :func:`tp_collective_time_s` the layout of the tensor-parallel group (its ranks adjacent:
inside a node when the degree is at most the node's GPUs).
"""

from __future__ import annotations

from shard_planner.plan.comm import ALL_REDUCE
from shard_planner.cost import fsdp2_rules  # called through the module: a test changes a rule, every caller follows
from shard_planner.parallel.mesh import Mesh
from shard_planner.hardware.profile import HardwareProfile


def _link(profile: HardwareProfile, spans_nodes: bool) -> tuple[float, float, float]:
    """(latency_s, plateau busbw_bytes_per_s, busbw_half_bytes) of the link a group runs over."""
    ic = profile.interconnect
    if spans_nodes:
        return ic.inter_node_latency_s, ic.inter_node_busbw_bytes_per_s, ic.inter_node_busbw_half_bytes
    return ic.intra_node_latency_s, ic.intra_node_busbw_bytes_per_s, ic.intra_node_busbw_half_bytes


def busbw_at_bytes(nbytes: float, busbw_bytes_per_s: float, busbw_half_bytes: float = 0.0) -> float:
    """nccl-tests bus bandwidth of a ``nbytes`` message: plateau x n / (n + n_1/2); the plateau when n_1/2 is 0."""
    if busbw_half_bytes <= 0:
        return busbw_bytes_per_s
    return busbw_bytes_per_s * nbytes / (nbytes + busbw_half_bytes)


def ring_time_s(nbytes: float, group_size: int, latency_s: float, busbw_bytes_per_s: float,
                busbw_half_bytes: float = 0.0) -> float:
    """One ring all-gather or reduce-scatter of ``nbytes`` (the unsharded size) over ``group_size`` ranks:
    alpha (p - 1) + (p - 1) / p x n / busbw(n), busbw(n) from the plateau and n_1/2 (:func:`busbw_at_bytes`)."""
    if group_size <= 1 or nbytes <= 0:
        return 0.0
    # n / busbw(n) = (n + n_1/2) / plateau: the same expression without a division by a small busbw
    steps = group_size - 1
    return latency_s * steps + steps / group_size * (nbytes + busbw_half_bytes) / busbw_bytes_per_s


def all_gather_time_s(profile: HardwareProfile, nbytes: float, mesh: Mesh, group_size: int | None = None) -> float:
    """All-gather over the layout's shard group (or a smaller reshard group of ``group_size`` of its ranks)."""
    size = mesh.shard_group_size if group_size is None else group_size
    lat, bw, half = _link(profile, mesh.shard_group_spans_nodes(profile.interconnect.gpus_per_node, size))
    return ring_time_s(nbytes, size, lat, bw, half)


def ring_bandwidth_s(profile: HardwareProfile, nbytes: float, mesh: Mesh) -> float:
    """The bandwidth term alone of an all-gather or reduce-scatter over the layout's shard group: bytes that
    join another collective of the same group (the solver's linear model, for modules that join the
    root unit's all-gather and reduce-scatter). The marginal bytes of a collective run at the plateau:
    with busbw(n) = plateau x n / (n + n_1/2) the time is linear in n, and the joined collective pays
    the n_1/2 term once."""
    _, bw, _ = _link(profile, mesh.shard_group_spans_nodes(profile.interconnect.gpus_per_node))
    return ring_time_s(nbytes, mesh.shard_group_size, 0.0, bw)


def replica_all_reduce_time_s(profile: HardwareProfile, nbytes: float, mesh: Mesh) -> float:
    """HSDP: the all-reduce of the 1/shard reduce-scatter output of ``nbytes`` across the layout's replicas
    (all-reduce = reduce-scatter + all-gather: two ring passes); 0 without replicas."""
    if not mesh.is_hsdp:
        return 0.0
    lat, bw, half = _link(profile, mesh.replicate_group_spans_nodes(profile.interconnect.gpus_per_node))
    # nccl-tests all-reduce busbw = 2 (p-1)/p x n / t: two ring passes over the same message size n
    return 2 * ring_time_s(fsdp2_rules.shard_bytes(nbytes, mesh.shard_group_size), mesh.replicate_group_size, lat, bw,
                           half)


def reduce_scatter_time_s(profile: HardwareProfile, nbytes: float, mesh: Mesh) -> float:
    """Gradient reduce-scatter of ``nbytes`` in the layout's shard group. Under HSDP FSDP2's
    ``foreach_reduce`` then all-reduces the 1/shard result across the replicas
    (:func:`replica_all_reduce_time_s`, priced apart: cost/unit_collectives.py), a hierarchical reduction."""
    lat, bw, half = _link(profile, mesh.shard_group_spans_nodes(profile.interconnect.gpus_per_node))
    return ring_time_s(nbytes, mesh.shard_group_size, lat, bw, half)


def tp_collective_time_s(profile: HardwareProfile, kind: str, nbytes: float, mesh: Mesh) -> float:
    """One tensor-parallel collective of ``nbytes`` (its full tensor: cost/tp_comm.py) over the layout's tp
    group (adjacent ranks): a ring all-gather or reduce-scatter, or an all-reduce (two ring passes,
    nccl-tests' 2 (n-1)/n bus factor). ``kind``: shard_planner.plan.comm's collective names."""
    lat, bw, half = _link(profile, mesh.tp_group_spans_nodes(profile.interconnect.gpus_per_node))
    one_pass = ring_time_s(nbytes, mesh.tp_size, lat, bw, half)
    return 2 * one_pass if kind == ALL_REDUCE else one_pass
