"""Measure a hardware profile on the local machine: matmul throughput, memory bandwidth, and the
latency and bus bandwidth of all-gather / reduce-scatter (gloo on CPU, NCCL on GPU).

``calibrate(world_size=2, device="auto") -> (HardwareProfile, toml_text)``; ``write_profile`` writes the
TOML atomically. Collectives are timed in a spawned world of ``world_size`` ranks over several sizes and
fitted to the ring model the cost model uses (shard_planner/cost/collectives.py):

    time(bytes) = alpha * (p - 1) + (p - 1) / p * bytes / busbw

by least squares: the intercept gives alpha (per ring step), the slope gives busbw. Every number in the
written file says how it was measured.
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

from shard_planner.errors import UserError
from shard_planner.fileio import write_atomic
from shard_planner.profile import HardwareProfile, Interconnect

logger = logging.getLogger(__name__)

MATMUL_N = {"cpu": 1024, "cuda": 8192}
COPY_BYTES = {"cpu": 64 * 2**20, "cuda": 1 * 2**30}
COLLECTIVE_BYTES = {"cpu": (2**16, 2**18, 2**20, 4 * 2**20), "cuda": (2**20, 16 * 2**20, 128 * 2**20, 512 * 2**20)}


@dataclass(frozen=True)
class CollectiveFit:
    latency_s: float  # per ring step
    busbw_bytes_per_s: float
    samples: tuple[tuple[int, float], ...]  # (bytes, median seconds)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    _sync(device)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure_matmul_flops_per_s(device: torch.device, dtype: torch.dtype, repeats: int = 5) -> float:
    """2 n^3 FLOPs of an n x n matmul per second (n = MATMUL_N), the median of ``repeats``."""
    n = MATMUL_N[device.type]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _time(lambda: a @ b, device, repeats)


def measure_copy_bytes_per_s(device: torch.device, repeats: int = 5) -> float:
    """Read + write bytes per second of a large tensor copy."""
    numel = COPY_BYTES[device.type] // 4
    src = torch.empty(numel, device=device)
    dst = torch.empty_like(src)
    return 2 * numel * 4 / _time(lambda: dst.copy_(src), device, repeats)


def fit_ring(samples: list[tuple[int, float]], world_size: int) -> CollectiveFit:
    """Fit t = a + s * bytes minimising the *relative* squared error (weights 1/t^2, so the small,
    latency-bound sizes count as much as the large ones); alpha = a / (p - 1), busbw = (p - 1) / (p * s)."""
    ws = [1.0 / (t * t) for _, t in samples]
    xs = [float(b) for b, _ in samples]
    ys = [t for _, t in samples]
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sxx if sxx else 0.0
    intercept = my - slope * mx
    if intercept < 0:  # no measurable latency: a line through the origin
        slope = sum(w * x * y for w, x, y in zip(ws, xs, ys)) / sum(w * x * x for w, x in zip(ws, xs))
        intercept = 0.0
    p = world_size
    slope = max(slope, 1e-15)  # flat: bandwidth effectively unbounded at these sizes
    return CollectiveFit(latency_s=intercept / (p - 1), busbw_bytes_per_s=(p - 1) / (p * slope),
                         samples=tuple(samples))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective_rank(rank: int, world_size: int, port: int, device_type: str, out_dir: str, repeats: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    lines = []
    for kind in ("all_gather", "reduce_scatter"):
        for nbytes in COLLECTIVE_BYTES[device_type]:
            numel = nbytes // 4 // world_size * world_size
            full = torch.zeros(numel, device=device)
            shard = torch.zeros(numel // world_size, device=device)

            def run():
                if kind == "all_gather":
                    dist.all_gather_single(full, shard)
                else:
                    dist.reduce_scatter_single(shard, full)

            times = []
            run()
            for _ in range(repeats):
                dist.barrier()
                _sync(device)
                t0 = time.perf_counter()
                run()
                _sync(device)
                times.append(time.perf_counter() - t0)
            lines.append(f"{kind} {numel * 4} {statistics.median(times)}")
    if rank == 0:
        with open(os.path.join(out_dir, "collectives.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


def measure_collectives(world_size: int, device_type: str, repeats: int = 5) -> dict[str, CollectiveFit]:
    """Time all-gather and reduce-scatter in a spawned world; fit each to the ring model."""
    import torch.multiprocessing as mp

    if world_size < 2:
        raise UserError("calibrate: --world-size must be at least 2 to measure collectives")
    if device_type == "cuda" and torch.cuda.device_count() < world_size:
        raise UserError(f"calibrate: --world-size {world_size} needs {world_size} GPUs, "
                        f"this machine has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_collective_rank, args=(world_size, _free_port(), device_type, out_dir, repeats),
                           nprocs=world_size, join=True, start_method="spawn")
        with open(os.path.join(out_dir, "collectives.txt")) as f:
            rows = [line.split() for line in f if line.strip()]
    out = {}
    for kind in ("all_gather", "reduce_scatter"):
        samples = [(int(b), float(t)) for k, b, t in rows if k == kind]
        out[kind] = fit_ring(samples, world_size)
    return out


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


def calibrate(world_size: int = 2, device: str = "auto", name: str = "local") -> tuple[HardwareProfile, str]:
    """Measure this machine; return the profile and its TOML text (with how each number was measured)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    if device == "cpu":
        torch.set_num_threads(1)  # one thread per rank, as the executor's ranks run
    logger.info("calibrate: matmul and copy on %s", dev)
    flops = {"float32": measure_matmul_flops_per_s(dev, torch.float32),
             "bfloat16": measure_matmul_flops_per_s(dev, torch.bfloat16)}
    copy_bw = measure_copy_bytes_per_s(dev)
    logger.info("calibrate: collectives over %d ranks", world_size)
    fits = measure_collectives(world_size, device)
    # the slower of the two collectives: FSDP runs both
    latency = max(f.latency_s for f in fits.values())
    busbw = min(f.busbw_bytes_per_s for f in fits.values())
    if device == "cuda":
        props = torch.cuda.get_device_properties(dev)
        memory = props.total_memory
        gpus_per_node = torch.cuda.device_count()
        reserved = 1 << 30
        h2d_src = torch.empty(COPY_BYTES["cuda"] // 4, pin_memory=True)
        h2d_dst = torch.empty_like(h2d_src, device=dev)
        h2d = h2d_src.numel() * 4 / _time(lambda: h2d_dst.copy_(h2d_src, non_blocking=True), dev, 5)
        pg_bytes = 1 << 30
    else:
        memory = _host_memory_bytes()
        gpus_per_node = 64
        reserved = 0
        h2d = copy_bw
        pg_bytes = 0
    profile = HardwareProfile(
        name=name, device=device, memory_bytes=int(memory), usable_fraction=0.92 if device == "cuda" else 0.8,
        reserved_bytes=reserved, per_process_group_bytes=pg_bytes,
        peak_flops_per_s=dict(flops, float16=flops["bfloat16"]), compute_efficiency=1.0,
        memory_bandwidth_bytes_per_s=copy_bw, host_to_device_bytes_per_s=h2d,
        interconnect=Interconnect(gpus_per_node=gpus_per_node, intra_node_latency_s=latency,
                                  intra_node_busbw_bytes_per_s=busbw, inter_node_latency_s=latency,
                                  inter_node_busbw_bytes_per_s=busbw),
        reduce_scatter_temp_fraction=1.0 if device == "cpu" else 0.0,
    )
    return profile, to_toml(profile, fits, world_size)


def to_toml(p: HardwareProfile, fits: dict[str, CollectiveFit], world_size: int) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    n, backend = MATMUL_N[p.device], "nccl" if p.device == "cuda" else "gloo"
    samples = "; ".join(f"{k}: " + ", ".join(f"{b // 1024} KiB {t * 1e3:.2f} ms" for b, t in f.samples)
                        for k, f in fits.items())
    ic = p.interconnect
    lines = [
        f"# Measured by `shard-planner calibrate --world-size {world_size}` on {when} (torch {torch.__version__}).",
        f"# Collective samples ({backend}, {world_size} ranks): {samples}",
        f'name = "{p.name}"',
        f'device = "{p.device}"',
        f"memory_bytes = {p.memory_bytes}  # {'torch.cuda.get_device_properties().total_memory' if p.device == 'cuda' else 'host physical memory (sysconf)'}",
        f"usable_fraction = {p.usable_fraction}  # headroom for allocator fragmentation (REFERENCE.md){'' if p.device == 'cuda' else ', the OS and the ranks process images'}",
        f"reserved_bytes = {p.reserved_bytes}  # {'CUDA context + NCCL buffers (not measured: ~1 GiB)' if p.device == 'cuda' else 'the storage tracker counts tensor storages only'}",
        f"per_process_group_bytes = {p.per_process_group_bytes}  # {'~1 GB per NCCL process group (pytorch#153302)' if p.device == 'cuda' else 'a gloo group holds no tensor storage'}",
        "compute_efficiency = 1.0  # peak_flops_per_s below is measured matmul throughput already",
        f"memory_bandwidth_bytes_per_s = {p.memory_bandwidth_bytes_per_s:.4g}  # measured: {COPY_BYTES[p.device] // 2**20} MiB tensor copy, read + write",
        f"host_to_device_bytes_per_s = {p.host_to_device_bytes_per_s:.4g}  # measured: {'pinned host-to-device copy' if p.device == 'cuda' else 'the host is the device (copy bandwidth)'}",
        f"reduce_scatter_temp_fraction = {p.reduce_scatter_temp_fraction}  # {'gloo copies the reduce-scatter input (storage tracker)' if p.device == 'cpu' else 'NCCL allocates no tensor'}",
        "",
        "[peak_flops_per_s]",
        f"float32 = {p.peak_flops_per_s['float32']:.4g}  # measured: {n}^3 fp32 matmul",
        f"bfloat16 = {p.peak_flops_per_s['bfloat16']:.4g}  # measured: {n}^3 bf16 matmul",
        f"float16 = {p.peak_flops_per_s['float16']:.4g}  # taken equal to bfloat16",
        "",
        "[interconnect]",
        f"gpus_per_node = {ic.gpus_per_node}  # {'torch.cuda.device_count()' if p.device == 'cuda' else 'every rank on this host'}",
        f"intra_node_latency_s = {ic.intra_node_latency_s:.4g}  # ring fit intercept / (p - 1), slower of all-gather and reduce-scatter",
        f"intra_node_busbw_bytes_per_s = {ic.intra_node_busbw_bytes_per_s:.4g}  # ring fit slope, slower of all-gather and reduce-scatter",
        f"inter_node_latency_s = {ic.inter_node_latency_s:.4g}  # not measured (one node): taken equal to intra-node",
        f"inter_node_busbw_bytes_per_s = {ic.inter_node_busbw_bytes_per_s:.4g}  # not measured (one node): taken equal to intra-node",
    ]
    return "\n".join(lines) + "\n"


def write_profile(text: str, path: str) -> None:
    write_atomic(path, text)
