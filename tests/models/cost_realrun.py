"""Measure the peak memory of several plans in ONE spawned gloo world (test helper for the cost model).

Each rank, for each plan in turn: builds the model from its model file (seeded), applies the plan with
the executor's ``apply_plan``, trains warm-up steps, then one step under the executor's
``StorageTracker`` — the same loop as shard_planner/execute/worker.py (zero_grad, forward, loss,
backward, optimizer step) — and reports its peak. One launch serves many plans because a spawned world
costs 10-20 s on two cores.

    peaks = measure_peaks([plan1, plan2], world_size=2)   # -> [max over ranks of the peak, per plan]
"""

from __future__ import annotations

import gc
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, plan_jsons: list[str], out_dir: str, warmup: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from shard_planner.execute.apply import apply_plan, build_mesh
    from shard_planner.execute.memtrack import StorageTracker
    from shard_planner.execute.worker import build_on_device, make_optimizer, make_step_batch
    from shard_planner.modelfile import load_model_file
    from shard_planner.plan import Plan

    import json

    results = []
    meshes = {}
    for text in plan_jsons:
        plan = Plan.from_dict(json.loads(text))
        key = (plan.mesh.shard, plan.mesh.replicate)
        if key not in meshes:
            meshes[key] = build_mesh(plan, "cpu")
        model_file = load_model_file(plan.model.path)
        model = build_on_device(model_file, torch.device("cpu"))
        apply_plan(model, plan, meshes[key])
        optimizer = make_optimizer(plan, model.parameters())
        tracker = None

        def step(s: int) -> None:
            inputs, targets = make_step_batch(model_file, plan.training.micro_batch, s, rank, torch.device("cpu"))
            optimizer.zero_grad(set_to_none=True)
            if tracker is not None:
                tracker.phase = "forward"
            loss = model_file.loss(model(*inputs), targets)
            if tracker is not None:
                tracker.phase = "backward"
            loss.backward()
            if tracker is not None:
                tracker.phase = "optimizer"
            optimizer.step()

        for s in range(warmup):
            step(s)
        # Reference cycles (autograd graph <-> FSDP hooks) are otherwise freed whenever the collector
        # happens to run, which moves the measured peak by one activation from run to run.
        gc.collect()
        tracker = StorageTracker(track=(model, optimizer), device_type="cpu")
        with tracker:
            step(warmup)
        results.append((tracker.peak_bytes, tracker.peak_phase))
        tracker = None
        del model, optimizer
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        for peak, phase in results:
            f.write(f"{peak} {phase}\n")
    dist.destroy_process_group()


def measure_peaks(plans, world_size: int = 2, warmup: int = 2) -> list[tuple[int, str]]:
    """Per plan: (max over ranks of the storage-tracked peak bytes of one steady-state step, its phase)."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank_main, args=(world_size, _free_port(), [p.to_json() for p in plans], out_dir, warmup),
                           nprocs=world_size, join=True, start_method="spawn")
        per_rank = []
        for r in range(world_size):
            with open(os.path.join(out_dir, f"rank{r}.txt")) as f:
                per_rank.append([(int(a), b) for a, b in (line.split() for line in f)])
    return [max(col, key=lambda x: x[0]) for col in zip(*per_rank)]
