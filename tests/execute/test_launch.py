"""The worker entry point under torchrun: two node agents on loopback (c10d rendezvous on 127.0.0.1),
one rank each, running an HSDP plan (replicate 2 x shard 1); rank 0 writes the measurement. And the
launcher's pure parts: classifying a rank's failure, reading a stack dump."""

import os
import shutil
import subprocess
import sys

import pytest

from shard_planner.errors import PlanError
from shard_planner.execute.launch import COMMUNICATION, _in_collective, _main_thread_frames, free_port
from shard_planner.execute.worker import _classify
from shard_planner.plan.measurement import load_measurement
from shard_planner.plan import Unit, save_plan

from tests.execute.test_run import MODEL, make_plan, reference_losses  # noqa: E402

TORCHRUN = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")


@pytest.mark.multiprocess
def test_torchrun_two_nodes_hsdp(tmp_path):
    units = [Unit(("",), True), Unit(("blocks.0", "blocks.1", "blocks.2")), Unit(("blocks.3", "blocks.4", "blocks.5"))]
    plan = make_plan(units, 2, model=os.path.abspath(MODEL), replicate=2)
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    port = free_port()
    cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "shard-planner-test", "--max-restarts", "0",
           "-m", "shard_planner.execute.worker", str(path), "--steps", "1", "--warmup", "1", "--device", "cpu",
           "--timeout", "120"]
    agents = [subprocess.Popen(cmd, stdout=open(tmp_path / f"node{i}.log", "w"), stderr=subprocess.STDOUT,
                               start_new_session=True) for i in range(2)]
    try:
        codes = [a.wait(timeout=240) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, 9)
                a.wait()
    # whole logs: a failure's first frames (the exception's text) come long before its last 2,000 characters
    logs = "\n".join(f"--- node {i} ---\n" + (tmp_path / f"node{i}.log").read_text() for i in range(2))
    assert codes == [0, 0], logs
    m = load_measurement(tmp_path / "measurement.json")  # beside the plan, by default
    assert (m.world_size, m.mesh_replicate, m.mesh_shard) == (2, 2, 1)
    assert m.rederived_from_world_size is None and m.backend == "gloo"
    assert m.losses == pytest.approx(reference_losses(plan, 2, 3), rel=1e-5)
    for a in agents:
        with pytest.raises(ProcessLookupError):
            os.kill(a.pid, 0)


DUMP = """Thread 0x00007f1 (most recent call first):
  File "/venv/lib/python3.11/threading.py", line 320 in wait
  File "/venv/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 4394 in all_gather_single
  File "/work/model.py", line 12 in forward
  File "<frozen runpy>", line 88 in _run_code
  File "/work/shard_planner/execute/worker.py", line 330 in <module>
"""


def test_stack_dump_main_thread_and_collective():
    frames = _main_thread_frames(DUMP)
    assert frames[0] == ("/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", 4394,
                         "all_gather_single")
    assert frames[-1][2] == "<module>" and _in_collective(frames)
    assert not _in_collective(_main_thread_frames(DUMP.replace("torch/distributed", "torch/nn")))
    assert _main_thread_frames("") == []


def test_failure_kinds():
    import torch.distributed as dist

    assert _classify(MemoryError("x")) == "out of memory"
    assert _classify(type("OutOfMemoryError", (RuntimeError,), {})("CUDA out of memory")) == "out of memory"
    assert _classify(RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")) == COMMUNICATION
    assert _classify(dist.DistBackendError("NCCL communicator was aborted")) == COMMUNICATION
    assert _classify(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) == "raised RuntimeError"
    assert _classify(ValueError("timeout must be positive")) == "raised ValueError"  # not a runtime comm error
    assert _classify(PlanError("x")) == "PlanError"
