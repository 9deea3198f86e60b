"""How calibrate times one kernel (execute/kernel_timing.py): the host clock on CPU, the device's clock
over a captured batch on CUDA ([Note: timing a kernel on the device])."""

import time

import pytest
import torch

from shard_planner.execute import kernel_timing as kt
from shard_planner.execute.calibrate_kernels import measure_dispatch_floor_s

CPU = torch.device("cpu")


def test_batch_size_targets_one_replay_of_a_few_milliseconds():
    assert kt.batch_size(1e-4) == 50  # 5 ms / 100 us
    assert kt.batch_size(1e-3) == kt.MIN_BATCH  # a long kernel still runs enough calls to hide the replay's launch
    assert kt.batch_size(1e-7) == kt.MAX_BATCH
    assert kt.batch_size(0.0) == kt.MAX_BATCH


def test_cpu_times_one_call_by_the_host_clock_fastest_of_the_repeats():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002 if len(calls) % 2 else 0.02)  # every other call slowed, as a loaded machine would

    t = kt.device_time_s(fn, CPU, repeats=4)
    assert 0.002 <= t < 0.015
    assert len(calls) == 5  # one warm-up, then the repeats


def test_cpu_pays_no_device_launch_gap_and_its_floor_is_the_dispatch_cost():
    assert kt.measure_launch_s(CPU) == 0.0
    floor = measure_dispatch_floor_s(CPU, repeats=3)
    assert 0 < floor < 1e-3


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_cuda_device_time_leaves_the_host_out():
    dev = torch.device("cuda")
    host_per_op = kt.fastest_host_s(lambda: torch.zeros(1, device=dev).add_(1), dev, 20)
    x = torch.zeros(1, device=dev)
    tiny = kt.device_time_s(lambda: x.add_(1), dev, 5)
    assert tiny < host_per_op  # the host's per-op cost is not in the sample
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    graph = kt.device_time_s(lambda: a @ a, dev, 5)
    eager = kt.events_s(lambda: a @ a, 20)  # long enough that the host keeps up: the two agree
    assert graph == pytest.approx(eager, rel=0.15)
    assert 0 < kt.measure_launch_s(dev) < 2e-5
