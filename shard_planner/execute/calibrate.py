"""Measure a hardware profile on the local machine: matmul throughput, memory bandwidth, the roofline
kernel model's constants, and the latency and bus-bandwidth curve of all-gather / reduce-scatter (gloo
on CPU, NCCL on GPU).

``calibrate(world_size=2, device="auto", quick=False) -> (HardwareProfile, toml_text)``; ``write_profile``
writes the TOML atomically. The profile says ``compute_model = "roofline"`` and carries the measured
``[kernels]`` table: the GEMM shape sweep, attention forward/backward, elementwise bandwidth and launch
cost, each fitted as shard_planner/execute/calibrate_kernels.py documents. Collectives are timed in a
spawned world of ``world_size`` ranks from a 4-byte-per-rank message (the latency floor) to MiBs and
fitted to the ring model the cost model uses (shard_planner/cost/collectives.py):

    time(bytes) = alpha * (p - 1) + (p - 1) / p * (bytes + n_1/2) / plateau

(alpha from the floor, plateau and n_1/2 by least squares on relative error: calibrate_kernels.fit_curve).
``fit_ring`` (alpha and busbw from a line, no curve) is the older fit, kept for callers. Every number in
the written file says how it was measured. Matmul throughput, copy bandwidth, the kernel sweeps and the
collectives take the fastest of their repeats (on a shared machine other processes only ever add time);
``--quick`` runs 3 repeats instead of 5 and drops the largest CPU GEMM shape and attention sequence.

Framework overheads (the time model's per-op, per-unit and per-tensor terms, shard_planner/cost/time.py):

- per aten op: forward + backward of a stack of tiny Linear + GELU layers (FLOPs negligible), divided
  by the aten ops it dispatches (counted as the tracer counts them: every non-``prim`` op). This
  includes what an op costs in a training step on top of its kernel: Python module calls, the
  dispatcher, autograd graph construction and the backward engine.
- per FSDP unit: in the spawned world, OVERHEAD_LAYERS tiny Linear layers grouped into U units
  (``fully_shard`` on each group, then the root) for U in OVERHEAD_UNITS; the least-squares slope of
  the fastest step time (forward, backward, optimizer; other processes only add time) against U, less the ring model's time of the unit's
  three collectives (all-gather before forward and before backward, reduce-scatter after backward),
  which the time model counts apart. The op count is the same for every U, so ops do not enter the slope.
- per optimizer parameter tensor: AdamW's ``step()`` over the sharded (DTensor) parameters of the
  finest model, divided by the tensors (bandwidth is negligible at these sizes); and the same over the plain
  parameters of the same layers without FSDP2 (the single-device step's, cost/engines/single.py).
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

from shard_planner.cost.fits import GPU_USABLE_FRACTION
from shard_planner.cost.retries import STATED_CALL_S
from shard_planner.cost.collectives import ring_time_s
from shard_planner.cost.host_share import usable_cores
from shard_planner.execute.calibrate_kernels import LAYOUT_N, CurveFit, fit_curve, slower
from shard_planner.execute.kernel_timing import device_time_s, host_samples
from shard_planner.execute.kernel_calibration import calibrate_kernels, kernels_toml
from shard_planner.errors import UserError
from shard_planner.fileio import write_atomic
from shard_planner.hardware.profile import HardwareProfile, Interconnect

logger = logging.getLogger(__name__)

MATMUL_N = {"cpu": 1024, "cuda": 8192}
COPY_BYTES = {"cpu": 64 * 2**20, "cuda": 1 * 2**30}
# sizes of the collectives' curve (bytes, the unsharded message); the first (4 bytes per rank) is the latency floor
COLLECTIVE_BYTES = {"cpu": (0, 2**12, 2**14, 2**16, 2**18, 2**20, 4 * 2**20),
                    "cuda": (0, 2**16, 2**20, 16 * 2**20, 128 * 2**20, 512 * 2**20)}
OVERHEAD_WIDTH = 16  # features of the tiny Linear layers of the overhead measurements
OVERHEAD_LAYERS = 16
OVERHEAD_UNITS = (1, 2, 4, 8, 16)  # units the OVERHEAD_LAYERS layers are grouped into


@dataclass(frozen=True)
class CollectiveFit:
    latency_s: float  # per ring step
    busbw_bytes_per_s: float
    samples: tuple[tuple[int, float], ...]  # (bytes, median seconds)


def _time(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(host_samples(fn, device, repeats))


def measure_matmul_flops_per_s(device: torch.device, dtype: torch.dtype, repeats: int = 5) -> float:
    """2 n^3 FLOPs of an n x n matmul per second (n = MATMUL_N), one call as kernel_timing.device_time_s times it."""
    n = MATMUL_N[device.type]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / device_time_s(lambda: a @ b, device, repeats)


def measure_copy_bytes_per_s(device: torch.device, repeats: int = 5) -> float:
    """Read + write bytes per second of a large tensor copy, one call as kernel_timing.device_time_s times it."""
    numel = COPY_BYTES[device.type] // 4
    src = torch.empty(numel, device=device)
    dst = torch.empty_like(src)
    return 2 * numel * 4 / device_time_s(lambda: dst.copy_(src), device, repeats)


class _OpCounter:
    """Counts the aten ops dispatched, as the tracer does (trace/capture.py, Step.record_op: non-prim ops)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace != "prim":
                    counter.ops += 1
                return func(*args, **(kwargs or {}))

        self.ops = 0
        self.mode = Mode()


def _tiny_stack(layers: int, device: torch.device) -> torch.nn.Module:
    with torch.device(device):
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(OVERHEAD_WIDTH, OVERHEAD_WIDTH),
                                                         torch.nn.GELU()) for _ in range(layers)])


def measure_per_op_overhead_s(device: torch.device, repeats: int = 30) -> tuple[float, int, float]:
    """Seconds per aten op of a training step's forward + backward on tiny tensors: (per op, ops, step s)."""
    model = _tiny_stack(OVERHEAD_LAYERS, device)
    x = torch.randn(4, OVERHEAD_WIDTH, device=device)

    def step():
        model(x).sum().backward()

    counter = _OpCounter()
    with counter.mode:
        step()
    for p in model.parameters():
        p.grad = None
    t = min(_time(step, device, repeats) for _ in range(3))  # min of medians: the machine is shared
    return t / counter.ops, counter.ops, t


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Ordinary least squares y = a + b x: (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def _overhead_samples(world_size: int, device: torch.device, repeats: int) -> list[str]:
    """Step time of OVERHEAD_LAYERS tiny layers in U FSDP2 units, for U in OVERHEAD_UNITS; and AdamW's
    step time over the finest model's sharded parameters (lines for the rank-0 file)."""
    from torch.distributed.fsdp import fully_shard

    lines = []
    for units in OVERHEAD_UNITS:
        per = OVERHEAD_LAYERS // units
        model = torch.nn.Sequential(*[_tiny_stack(per, device) for _ in range(units)])
        for group in model:
            fully_shard(group)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(4, OVERHEAD_WIDTH, device=device)

        def step():
            opt.zero_grad(set_to_none=True)
            model(x).sum().backward()
            opt.step()

        for _ in range(3):
            step()
        # the fastest step: on a shared machine other processes only ever add time
        lines.append(f"unit {units} {min(host_samples(step, device, repeats, barrier=True))}")
        if units == OVERHEAD_UNITS[-1]:
            tensors = sum(1 for _ in model.parameters())
            lines.append(f"optimizer {tensors} {min(host_samples(opt.step, device, repeats))}")
    plain = _tiny_stack(OVERHEAD_LAYERS, device)
    plain(torch.randn(4, OVERHEAD_WIDTH, device=device)).sum().backward()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    for _ in range(3):
        opt.step()
    tensors = sum(1 for _ in plain.parameters())
    lines.append(f"optimizer_plain {tensors} {min(host_samples(opt.step, device, repeats))}")
    return lines


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


def _collective_sample(kind: str, g: int, group, nbytes: int, rank: int, device: torch.device,
                       repeats: int) -> list[str]:
    """One line "kind group_size bytes fastest_s" (rank 0 of the group); ranks outside the group only
    join the barriers."""
    import torch.distributed as dist

    numel = max(nbytes // 4 // g, 1) * g
    full = torch.zeros(numel, device=device)
    shard = torch.zeros(numel // g, device=device)

    def run():
        if rank >= g:
            return
        if kind == "all_gather":
            dist.all_gather_single(full, shard, group=group)
        else:
            dist.reduce_scatter_single(shard, full, group=group)

    run()  # warm-up
    # the fastest: on a shared machine other processes only ever add time (calibrate_kernels.fit_curve)
    return [f"{kind} {g} {numel * 4} {min(host_samples(run, device, repeats, barrier=True))}"]


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
    for g in sorted({2, world_size}):  # two group sizes tell latency from n_1/2 (calibrate_kernels.fit_curve)
        group = dist.new_group(list(range(g))) if g < world_size else None
        for kind in ("all_gather", "reduce_scatter"):
            for nbytes in COLLECTIVE_BYTES[device_type]:
                lines += _collective_sample(kind, g, group, nbytes, rank, device, repeats)
    lines += _overhead_samples(world_size, device, repeats=max(repeats, 15))
    if rank == 0:
        write_atomic(os.path.join(out_dir, "collectives.txt"), "\n".join(lines) + "\n")  # the parent reads it
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
        samples = [(int(r[1]), int(r[2]), float(r[3])) for r in rows if r[0] == kind]
        out[kind] = fit_curve(samples)
    out["unit_samples"] = tuple((int(r[1]), float(r[2])) for r in rows if r[0] == "unit")
    for kind in ("optimizer", "optimizer_plain"):
        out[f"{kind}_samples"] = tuple((int(r[1]), float(r[2])) for r in rows if r[0] == kind)
    return out


@dataclass(frozen=True)
class Overheads:
    per_op_s: float
    per_op_ops: int  # ops of the measured forward + backward
    per_op_step_s: float
    per_unit_s: float
    unit_slope_s: float  # the raw slope of step time against units
    unit_comm_s: float  # the ring model's collectives of one tiny unit, subtracted from the slope
    unit_samples: tuple[tuple[int, float], ...]
    per_tensor_s: float
    optimizer_samples: tuple[tuple[int, float], ...]
    per_plain_tensor_s: float | None = None  # the same over plain tensors (None: not measured)
    optimizer_plain_samples: tuple[tuple[int, float], ...] = ()


def overheads_from(samples: dict, per_op: tuple[float, int, float], latency_s: float, busbw: float,
                   world_size: int, busbw_half_bytes: float = 0.0) -> Overheads:
    """Per-unit and per-tensor overheads from the world's samples (see the module docstring)."""
    units = samples["unit_samples"]
    _, slope = fit_line([float(u) for u, _ in units], [t for _, t in units])
    p = world_size
    unit_bytes = OVERHEAD_LAYERS // units[-1][0] * (OVERHEAD_WIDTH + 1) * OVERHEAD_WIDTH * 4  # the finest unit
    one = ring_time_s(unit_bytes, p, latency_s, busbw, busbw_half_bytes)  # the ring model the time model uses
    comm = 3 * one
    per_unit = max(0.0, slope - comm)
    if slope - comm < 0:
        logger.warning("calibrate: per-unit step time slope %.3g s is below the collectives' %.3g s; "
                       "per-unit overhead set to 0", slope, comm)
    n, t = samples["optimizer_samples"][0]
    plain = samples.get("optimizer_plain_samples") or ()
    return Overheads(per_op_s=per_op[0], per_op_ops=per_op[1], per_op_step_s=per_op[2], per_unit_s=per_unit,
                     unit_slope_s=slope, unit_comm_s=comm, unit_samples=tuple(units), per_tensor_s=t / n,
                     optimizer_samples=tuple(samples["optimizer_samples"]),
                     per_plain_tensor_s=plain[0][1] / plain[0][0] if plain else None,
                     optimizer_plain_samples=tuple(plain))


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


def _device_facts(device: str, dev: torch.device, copy_bw: float) -> tuple[int, int, int, float, int]:
    """(memory bytes, ranks per node, reserved bytes, host-to-device bytes/s, bytes per process group)."""
    if device == "cuda":
        props = torch.cuda.get_device_properties(dev)
        h2d_src = torch.empty(COPY_BYTES["cuda"] // 4, pin_memory=True)
        h2d_dst = torch.empty_like(h2d_src, device=dev)
        h2d = h2d_src.numel() * 4 / _time(lambda: h2d_dst.copy_(h2d_src, non_blocking=True), dev, 5)
        return props.total_memory, torch.cuda.device_count(), 1 << 30, h2d, 1 << 30
    return _host_memory_bytes(), 64, 0, copy_bw, 0


def kernels_table(kcal) -> dict:
    """A kernel calibration as the profile's [kernels] TOML table (tiles as "MxN" strings), with its
    per-dtype sub-tables (cost/kernels.py kernel_constants)."""
    from dataclasses import asdict

    kc = kcal.constants
    d = asdict(kc)
    d["matmul_tiles"] = [f"{m}x{n}" for m, n in kc.matmul_tiles]
    d.update({c.dtype: c.table() for c in kcal.by_dtype})
    return d


def calibrate(world_size: int = 2, device: str = "auto", name: str = "local",
              quick: bool = False) -> tuple[HardwareProfile, str]:
    """Measure this machine; return the profile and its TOML text (with how each number was measured).
    The profile prices compute with the roofline (``compute_model = "roofline"``) from the measured
    [kernels] table (execute/calibrate_kernels.py); ``quick`` drops the largest shapes and repeats."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    if device == "cpu":
        torch.set_num_threads(1)  # one thread per rank, as the executor's ranks run
    repeats = 3 if quick else 5
    logger.info("calibrate: matmul and copy on %s", dev)
    flops = {"float32": measure_matmul_flops_per_s(dev, torch.float32, repeats)}
    if device == "cuda":  # CPU: bf16 is calibrated by operand layout (calibrate_kernels.calibrate_dtype)
        flops["bfloat16"] = measure_matmul_flops_per_s(dev, torch.bfloat16, repeats)
    copy_bw = measure_copy_bytes_per_s(dev, repeats)
    per_op = measure_per_op_overhead_s(dev, repeats=15 if quick else 30)
    kcal = calibrate_kernels(dev, flops, copy_bw, repeats=repeats, quick=quick)
    flops[kcal.dtype] = kcal.peak_flops_per_s
    flops.update({d.dtype: d.peak_flops_per_s for d in kcal.by_dtype})
    logger.info("calibrate: collectives over %d ranks", world_size)
    samples = measure_collectives(world_size, device, repeats=2 * repeats + 2)
    fits = {k: samples[k] for k in ("all_gather", "reduce_scatter")}
    curve = fits[slower(fits, world_size)]  # FSDP runs both: the slower one prices them
    over = overheads_from(samples, per_op, curve.latency_s, curve.busbw_bytes_per_s, world_size,
                          curve.busbw_half_bytes)
    memory, gpus_per_node, reserved, h2d, pg_bytes = _device_facts(device, dev, copy_bw)
    lat, bw, half = curve.latency_s, curve.busbw_bytes_per_s, curve.busbw_half_bytes
    profile = HardwareProfile(
        name=name, device=device, memory_bytes=int(memory), usable_fraction=GPU_USABLE_FRACTION if device == "cuda" else 0.8,
        reserved_bytes=reserved, per_process_group_bytes=pg_bytes,
        peak_flops_per_s=dict(flops, float16=flops["bfloat16"]), compute_efficiency=1.0,
        memory_bandwidth_bytes_per_s=copy_bw, host_to_device_bytes_per_s=h2d,
        interconnect=Interconnect(gpus_per_node=gpus_per_node, intra_node_latency_s=lat,
                                  intra_node_busbw_bytes_per_s=bw, inter_node_latency_s=lat,
                                  inter_node_busbw_bytes_per_s=bw, intra_node_busbw_half_bytes=half,
                                  inter_node_busbw_half_bytes=half),
        reduce_scatter_temp_fraction=1.0 if device == "cpu" else 0.0,
        per_op_overhead_s=over.per_op_s, per_unit_overhead_s=over.per_unit_s,
        per_param_tensor_optimizer_overhead_s=over.per_tensor_s,
        plain_tensor_optimizer_overhead_s=over.per_plain_tensor_s,
        kernels=kernels_table(kcal), compute_model="roofline",
        host_cores=usable_cores() if device == "cpu" else 0, measured_ranks=world_size if device == "cpu" else 0,
        **(STATED_CALL_S if device == "cuda" else {}),  # not measured: the stated values (cost/retries.py)
    )
    return profile, to_toml(profile, fits, world_size, over, kcal)


def _load_note() -> str:
    try:
        return "load average %.2f, %.2f, %.2f (1, 5, 15 min)" % os.getloadavg()
    except OSError:
        return "load average unknown"


def to_toml(p: HardwareProfile, fits: dict[str, CollectiveFit | CurveFit], world_size: int,
            over: Overheads | None = None, kcal=None) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    n, backend = MATMUL_N[p.device], "nccl" if p.device == "cuda" else "gloo"
    samples = "; ".join(f"{k}: " + ", ".join(f"{s[-2]} B {'' if len(s) == 2 else f'p={s[0]} '}{s[-1] * 1e3:.2f} ms"
                                             for s in f.samples) for k, f in fits.items())
    ic = p.interconnect
    lines = [
        f"# Measured by `shard-planner calibrate --world-size {world_size}` on {when} (torch {torch.__version__}).",
        f"# Collective samples ({backend}, {world_size} ranks): {samples}",
        f"# Machine load when the measurement ended: {_load_note()}.",
        f'name = "{p.name}"',
        f'device = "{p.device}"',
        f"memory_bytes = {p.memory_bytes}  # {'torch.cuda.get_device_properties().total_memory' if p.device == 'cuda' else 'host physical memory (sysconf)'}",
        f"usable_fraction = {p.usable_fraction}  # " + ("the margin of the CUDA caching-allocator simulation "
            "(shard_planner/cost/fits.py [Note: The margin on a GPU])" if p.device == "cuda" else
            "headroom for allocator fragmentation (REFERENCE.md), the OS and the ranks process images"),
        f"reserved_bytes = {p.reserved_bytes}  # {'CUDA context + NCCL buffers (not measured: ~1 GiB)' if p.device == 'cuda' else 'the storage tracker counts tensor storages only'}",
        f"per_process_group_bytes = {p.per_process_group_bytes}  # {'~1 GB per NCCL process group (pytorch#153302)' if p.device == 'cuda' else 'a gloo group holds no tensor storage'}",
        "compute_efficiency = 1.0  # peak_flops_per_s below is measured matmul throughput already",
        f"memory_bandwidth_bytes_per_s = {p.memory_bandwidth_bytes_per_s:.4g}  # measured: {COPY_BYTES[p.device] // 2**20} MiB tensor copy, read + write",
        f"host_to_device_bytes_per_s = {p.host_to_device_bytes_per_s:.4g}  # measured: {'pinned host-to-device copy' if p.device == 'cuda' else 'the host is the device (copy bandwidth)'}",
        f'compute_model = "{p.compute_model}"  # {"the roofline over the measured [kernels] table below (cost/kernels.py)" if kcal is not None else "traced FLOPs at the measured matmul throughput"}',
        f"reduce_scatter_temp_fraction = {p.reduce_scatter_temp_fraction}  # {'gloo copies the reduce-scatter input (storage tracker)' if p.device == 'cpu' else 'NCCL allocates no tensor'}",
    ]
    if p.device == "cuda":
        lines += [f"{key} = {getattr(p, key):.4g}  # not measured: the stated value of shard_planner/cost/retries.py "
                  "STATED_CALL_S (profiles/h100-80gb.toml gives its source)" for key in STATED_CALL_S]
    if p.host_cores:
        lines += [
            f"host_cores = {p.host_cores}  # measured: the cores this process may run on (CPU affinity), shared by "
            "the ranks of this host (cost/host_share.py [Note: CPU ranks sharing cores])",
            f"measured_ranks = {p.measured_ranks}  # ranks running at once while the collectives and the per-unit "
            "and optimizer overheads below were measured",
        ]
    if over is not None:
        units = ", ".join(f"{u}: {t * 1e3:.2f} ms" for u, t in over.unit_samples)
        lines += [
            f"per_op_overhead_s = {p.per_op_overhead_s:.4g}  # measured: fwd+bwd of {OVERHEAD_LAYERS} tiny Linear+GELU layers, "
            f"{over.per_op_step_s * 1e3:.2f} ms / {over.per_op_ops} aten ops",
            f"per_unit_overhead_s = {p.per_unit_overhead_s:.4g}  # measured: slope of FSDP2 step time vs units "
            f"({over.unit_slope_s * 1e3:.3f} ms/unit; units {units}) less the ring model's 3 collectives "
            f"({over.unit_comm_s * 1e3:.3f} ms)",
            f"per_param_tensor_optimizer_overhead_s = {p.per_param_tensor_optimizer_overhead_s:.4g}  # measured: "
            f"AdamW step over {over.optimizer_samples[0][0]} tiny sharded tensors, {over.optimizer_samples[0][1] * 1e3:.2f} ms",
        ]
        if over.optimizer_plain_samples:
            (n, t), = over.optimizer_plain_samples
            lines.append(f"plain_tensor_optimizer_overhead_s = {p.plain_tensor_optimizer_overhead_s:.4g}  # measured: "
                         f"AdamW step over {n} tiny plain tensors (no FSDP2: the single-device step), {t * 1e3:.2f} ms")
    lines += [
        "",
        "[peak_flops_per_s]",
        f"float32 = {p.peak_flops_per_s['float32']:.4g}  # measured: {n}^3 fp32 matmul{'' if kcal is None or p.device != 'cpu' else ', or the GEMM sweep best rate when higher (execute/calibrate_kernels.py)'}",
        f"bfloat16 = {p.peak_flops_per_s['bfloat16']:.4g}  # measured: "
        + (f"the fastest operand layout of a {LAYOUT_N}^3 bf16 GEMM ([kernels.bfloat16])" if p.device == "cpu"
           else f"{n}^3 bf16 matmul"),
        f"float16 = {p.peak_flops_per_s['float16']:.4g}  # taken equal to bfloat16",
        "",
        "[interconnect]",
        f"gpus_per_node = {ic.gpus_per_node}  # {'torch.cuda.device_count()' if p.device == 'cuda' else 'every rank on this host'}",
        f"intra_node_latency_s = {ic.intra_node_latency_s:.4g}  # ring fit intercept / (p - 1), slower of all-gather and reduce-scatter",
        f"intra_node_busbw_bytes_per_s = {ic.intra_node_busbw_bytes_per_s:.4g}  # ring fit slope, slower of all-gather and reduce-scatter",
        f"inter_node_latency_s = {ic.inter_node_latency_s:.4g}  # not measured (one node): taken equal to intra-node",
        f"inter_node_busbw_bytes_per_s = {ic.inter_node_busbw_bytes_per_s:.4g}  # not measured (one node): taken equal to intra-node",
    ]
    if any(isinstance(f, CurveFit) for f in fits.values()):
        each = "; ".join(f"{k}: alpha {f.latency_s * 1e6:.1f} us, plateau {f.busbw_bytes_per_s / 1e9:.3g} GB/s, "
                         f"n_1/2 {f.busbw_half_bytes / 1024:.1f} KiB" for k, f in fits.items())
        lines[-4] = (f"intra_node_latency_s = {ic.intra_node_latency_s:.4g}  # latency per ring step of the curve fit (execute/calibrate_kernels.py fit_curve), "
                     "the slower collective over the sampled sizes")
        lines[-3] = (f"intra_node_busbw_bytes_per_s = {ic.intra_node_busbw_bytes_per_s:.4g}  # busbw(n) = plateau n / (n + n_1/2) "
                     f"fitted by message size; {each}")
        lines += [f"intra_node_busbw_half_bytes = {ic.intra_node_busbw_half_bytes:.4g}  # n_1/2 of the same fit",
                  f"inter_node_busbw_half_bytes = {ic.inter_node_busbw_half_bytes:.4g}  # not measured (one node): taken equal to intra-node"]
    if kcal is not None:
        lines += [""] + kernels_toml(kcal)
    return "\n".join(lines) + "\n"


def write_profile(text: str, path: str) -> None:
    write_atomic(path, text)
