"""How the calibration sweeps time a kernel (execute/calibrate_kernels.py; benchmarks/gpu_kernels.py).

CPU: the host clock around each call, from a synchronised start to its end (the kernel runs on the
calling thread); the fastest of ``repeats`` calls after a warm-up, because on a shared machine other
processes only ever add time.

CUDA ([Note: timing a kernel on the device]): the device's clock, with the host taken out.

[Note: timing a kernel on the device] An eager op costs the host 7-9 us before its kernel is queued
(on this project's H200: 8.75 us per ``x.add_(1)``, benchmarks/data/h200_2026-12-04/kernels_warm.json),
and a synchronisation before and after each call adds the launch and the host's wake-up to the sample.
The host clock around one call therefore measures the host, not the kernel, for anything shorter than
~10 us, and adds that much to every longer sample. :func:`device_time_s` instead captures ``batch``
back-to-back calls into a CUDA graph, whose replay queues them with no host work between kernels, and
times replays with CUDA events: per call = replay time / batch, the fastest of ``repeats`` replays. What
remains per kernel is the device's gap between kernels, which the cost model prices apart
(``kernel_launch_s``, :func:`measure_launch_s`). ``batch`` is sized from one eager call so that a replay
runs ~5 ms (at least MIN_BATCH calls: a replay's own launch is then under a microsecond per call). A call
that cannot be captured falls back to events around an eager batch: exact for kernels longer than the
host's per-op time, which is how benchmarks/gpu_kernels.py measured the H200 (its ``events_s``).
"""

from __future__ import annotations

import logging
import math
import statistics
import time

import torch

logger = logging.getLogger(__name__)

REPLAY_S = 5e-3  # target device time of one timed replay (or eager batch)
MIN_BATCH, MAX_BATCH = 20, 1000
LAUNCH_KERNELS = 200  # tiny kernels in the graph that measures the device gap per kernel


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_samples(fn, device: torch.device, repeats: int, *, barrier: bool = False) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn``, each timed by the host clock from a synchronised device (and,
    with ``barrier``, after a barrier of the process group, so that ranks start together) to its end."""
    samples = []
    for _ in range(repeats):
        if barrier:
            torch.distributed.barrier()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - t0)
    return samples


def fastest_host_s(fn, device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` host-clock calls after a warm-up (module docstring)."""
    fn()
    return min(host_samples(fn, device, repeats))


def batch_size(call_s: float) -> int:
    """Calls per timed replay: ~REPLAY_S of device time at ``call_s`` per call, within [MIN_BATCH, MAX_BATCH]."""
    return int(min(MAX_BATCH, max(MIN_BATCH, math.ceil(REPLAY_S / max(call_s, 1e-9)))))


def events_s(fn, reps: int, repeats: int = 3) -> float:
    """Per-call device seconds of ``reps`` eager calls between two CUDA events, the median of ``repeats``
    batches after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(times)


def capture(fn, calls: int, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` back-to-back calls of ``fn`` (warmed up on a side stream, as capture requires)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def _replay_s(graph: torch.cuda.CUDAGraph, calls: int, repeats: int) -> float:
    graph.replay()
    best = math.inf
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / calls)
    return best


def device_time_s(fn, device: torch.device, repeats: int) -> float:
    """Seconds of one call of ``fn`` as the sweeps count it: on CPU the fastest host-clock call, on CUDA
    the device time of a captured batch ([Note: timing a kernel on the device])."""
    if device.type != "cuda":
        return fastest_host_s(fn, device, repeats)
    calls = batch_size(events_s(fn, 1, repeats=1))
    try:
        graph = capture(fn, calls)
    except RuntimeError as e:  # an op that cannot be captured: time it eagerly
        torch.cuda.synchronize(device)
        logger.warning("calibrate: could not capture a CUDA graph (%s); timing eager calls", str(e).splitlines()[0])
        return events_s(fn, calls, repeats=max(1, repeats))
    return _replay_s(graph, calls, max(1, repeats))


def tiny_kernel_graph(device: torch.device, kernels: int = LAUNCH_KERNELS) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``kernels`` one-element adds."""
    x = torch.zeros(1, device=device)
    return capture(lambda: x.add_(1), kernels)


def measure_launch_s(device: torch.device) -> float:
    """Device gap between back-to-back kernels (CUDA graph replay of tiny kernels); 0 on CPU, where
    ``per_op_overhead_s`` (calibrate.py) measures each op's whole fixed cost, dispatch and kernel entry included."""
    if device.type != "cuda":
        return 0.0
    return _replay_s(tiny_kernel_graph(device), LAUNCH_KERNELS, 10)
