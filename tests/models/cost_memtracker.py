"""FSDPMemTracker (torch.distributed._tools.fsdp2_mem_tracker), the peer estimator, on a plan: the model
built under FakeTensorMode (no real memory), the executor's apply_plan on a mesh of the "fake"
process group (torch.testing._internal.distributed.fake_pg.FakeStore), the plan's optimizer, and the
tracker's peak over a steady-state step (the first step runs tracked too — it creates the optimizer
states — but the peak is reset when the tracker is entered again; DESIGN.md: in fake mode the first
step over-counts optimizer temporaries).

Run in its own process per world size (the default process group is global):
    peaks = memtracker_peaks(model_path, [plan1, plan2])   # world size from the plans (all equal)
"""

from __future__ import annotations

import os
import warnings

import torch


def _peaks_here(model_path: str, plan_jsons: list[str]) -> list[int]:
    import json

    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shard_planner.execute.apply import apply_plan, build_mesh
    from shard_planner.execute.worker import make_optimizer
    from shard_planner.model.modelfile import load_model_file
    from shard_planner.plan import Plan

    plans = [Plan.from_dict(json.loads(t)) for t in plan_jsons]
    ws = plans[0].mesh.world_size
    dist.init_process_group("fake", rank=0, world_size=ws, store=FakeStore())
    mesh = build_mesh(plans[0], "cpu")  # outside FakeTensorMode (DESIGN.md)
    mf = load_model_file(model_path)
    peaks = []
    for plan in plans:
        with FakeTensorMode(allow_non_fake_inputs=True):
            torch.manual_seed(0)
            model = mf.build()
            apply_plan(model, plan, mesh)
            opt = make_optimizer(plan, model.parameters())
            inputs, targets = mf.batch(plan.training.micro_batch)
            tracker = FSDPMemTracker(model, opt)
            tracker.track_inputs(inputs)

            def step():
                opt.zero_grad(set_to_none=True)
                loss = mf.loss(model(*inputs), targets)
                loss.backward()
                opt.step()

            with tracker:
                step()
            tracker.reset_mod_stats()  # it refuses a second iteration otherwise
            with tracker:  # the peak restarts from what is live now
                step()
            snap = tracker.get_tracker_snapshot("peak")
            peaks.append(int(sum(dev["Total"] for dev in snap.values())))
            del model, opt, tracker
    dist.destroy_process_group()
    return peaks


def _child(model_path, plan_jsons, env, out):
    os.environ.update(env)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    try:
        out.put(_peaks_here(model_path, plan_jsons))
    except BaseException as exc:  # report it to the parent instead of leaving it waiting
        import traceback

        out.put(RuntimeError(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def memtracker_peaks(model_path: str, plans, env: dict | None = None, timeout_s: float = 1800) -> list[int]:
    """FSDPMemTracker's peak per plan, computed in a spawned process (all plans: one world size).

    Raises RuntimeError when the child dies without an answer (killed, segfault: its exit code is in
    the message) and TimeoutError when it runs past ``timeout_s``, instead of waiting forever."""
    import queue
    import time

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(model_path, [x.to_json() for x in plans], env or {}, q))
    p.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                result = q.get(timeout=1.0)
                break
            except queue.Empty:
                pass
            if not p.is_alive():
                try:  # it may have answered just before exiting
                    result = q.get(timeout=5.0)
                    break
                except queue.Empty:
                    raise RuntimeError(f"the FSDPMemTracker process for {model_path} died without an answer "
                                       f"(exit code {p.exitcode})") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"the FSDPMemTracker process for {model_path} gave no answer within "
                                   f"{timeout_s:.0f} s")
    finally:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=10)
    if isinstance(result, BaseException):
        raise result
    return result
