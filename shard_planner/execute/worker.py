"""One rank of ``shard-planner run``: build, shard, train on synthetic batches, measure.

The same entry point runs under the local launcher (shard_planner/execute/launch.py) and under
``torchrun`` for several nodes; it reads the standard environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m shard_planner.execute.worker plan.json --steps 10 --warmup 3

(``shard-planner run plan.json`` under torchrun, e.g. ``torchrun ... --no-python shard-planner run
plan.json``, runs this too.) Several plans may be given: they run in turn in one process group, which
saves a launch per plan (``run_plans``, ``tune``).

Each rank seeds identically, builds the model from the plan's model file directly on its device,
applies the plan and trains ``warmup + steps`` steps (execute/stepper.py); the batch of step s on
data-parallel rank d is drawn with seed ``SEED + 1000 * s + d`` so that a single process can replay the same
global batch (the tests do; stepper.py [Note: the micro-batch of a data-parallel rank]). Rank
0 gathers every rank's numbers and writes the measurement atomically (``--out``, default
measurement.json beside the plan; ``--out-dir`` with several plans); a failing run writes none. When
WORLD_SIZE differs from the plan's GPUs the plan is re-derived (``Plan.with_world_size``) and the
measurement says so.

Measurement (DESIGN.md, "Executor"):
- step time: the timed steps after warm-up, each started after a barrier; wall clock on CPU, CUDA
  events on GPU; per step the slowest rank's time;
- peak memory: GPU: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the timed steps
  (stats reset after warm-up). CPU: the allocator has no peak, so one more steady-state step runs under
  the :class:`StorageTracker` (not timed: the tracker slows every operator down).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import gc
import json
import logging
import os
import platform
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shard_planner.hardware.allocator_conf import effective_conf
from shard_planner.argtypes import non_negative_int, positive_float, positive_int
from shard_planner.errors import RunError, UserError, first_line
from shard_planner.cost.comm_bytes import collective_bytes_per_step
from shard_planner.execute.apply import apply_plan, apply_tensor_parallel, build_mesh, data_rank
from shard_planner.execute.checkpoint import (differing_entries, frozen_numel, load_checkpoint, loss_tolerance,
                                              regrouped_batch, save_checkpoint, state_digests)
from shard_planner.execute.checkpoint_dir import directory_bytes, read_side_file, write_side_file
from shard_planner.execute.comm_count import (CommCounter, FunctionalCollectiveCounter, by_group_size,
                                               unit_param_shapes, units_with_backward)
from shard_planner.execute.memtrack import StorageTracker
from shard_planner.execute.runner import with_prediction
from shard_planner.fileio import write_atomic
from shard_planner.plan.measurement import (CheckpointResult, Measurement, RankMemory, RestoreCheck, plan_fingerprint,
                                       save_measurement)
from shard_planner.model.hf import HfOptions, model_options
from shard_planner.execute.stepper import (SEED, Stepper, build_on_device, make_optimizer,  # noqa: F401
                                           make_step_batch)
from shard_planner.model.modelfile import load_model_file
from shard_planner.plan import Plan, load_plan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunOptions:
    steps: int = 5
    warmup: int = 2
    device: str = "cpu"  # "cpu" or "cuda" (resolved by the launcher)
    timeout_s: float = 300.0  # for every collective (the process group's timeout)
    # run --checkpoint (execute/checkpoint.py): after the measured steps, save to checkpoint_dir (empty),
    # train checkpoint_steps more, restore into a model built afresh and compare. resume_from: only
    # restore that checkpoint (written by such a run, at any world size) and compare.
    checkpoint_dir: str | None = None
    checkpoint_steps: int = 2
    resume_from: str | None = None


def _hf_options(plan: Plan, model_path: str) -> HfOptions | None:
    """For a transformers config: the plan's task, sequence length and fine-tune, so the run builds the planned
    model and batch."""
    return model_options(plan.model, model_path)


# ---- one rank ----
class _Status:
    """Per-rank progress and error files for the local launcher (none under torchrun)."""

    def __init__(self, status_dir: str | None, rank: int):
        self.dir = Path(status_dir) if status_dir else None
        self.rank = rank
        self.label = ""  # "plan 2/3: " when a world runs several plans

    def progress(self, text: str) -> None:
        if self.dir is not None:
            (self.dir / f"rank{self.rank}.status").write_text(self.label + text)

    def error(self, kind: str, message: str, tb: str) -> None:
        if self.dir is not None:
            tmp = self.dir / f".rank{self.rank}.error.tmp"
            tmp.write_text(json.dumps({"rank": self.rank, "kind": kind, "message": message, "traceback": tb}))
            os.replace(tmp, self.dir / f"rank{self.rank}.error.json")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:  # Linux: the CPU's model name
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


@dataclass(frozen=True)
class Job:
    """One plan to run in a world: the plan, its model file, where rank 0 writes the measurement."""

    plan: Plan
    model_path: str
    out_path: str | None


def run_rank(jobs: list[Job], options: RunOptions, status: _Status) -> None:
    """Join the world from the environment and run each job in turn, in one process group."""
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if options.device == "cuda":
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    status.progress("init_process_group")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=options.timeout_s),
                            **({"device_id": device} if device.type == "cuda" else {}))
    # Everything imported so far lives for the whole process: keep it out of the cyclic collector, so that
    # the gc.collect() calls between and inside jobs scan only what the steps made (0.21 s each -> ~0 s with
    # torch imported; measured by the plan-quality benchmark's author).
    gc.freeze()
    try:
        if options.resume_from:
            check = restore_and_compare(jobs[0].plan, jobs[0].model_path, options.resume_from, device, status)
            if rank == 0 and jobs[0].out_path:
                write_atomic(jobs[0].out_path, json.dumps(asdict(check), indent=1) + "\n")
            status.progress("done")
            return
        for i, job in enumerate(jobs):
            status.label = f"plan {i + 1}/{len(jobs)}: " if len(jobs) > 1 else ""
            measurement = train_and_measure(job.plan, job.model_path, options, device, status)
            if rank == 0 and job.out_path:
                save_measurement(measurement, job.out_path)
            gc.collect()  # free this plan's model before the next one is measured
            if device.type == "cuda":
                torch.cuda.empty_cache()
        status.progress("done")
    finally:
        dist.destroy_process_group()


def train_and_measure(plan: Plan, model_path: str, options: RunOptions, device: torch.device,
                      status: _Status) -> Measurement | None:
    """Run one plan in the initialised world; rank 0 returns the Measurement, the others None."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    plan, rederived_from = plan.at_world_size(world_size)  # the one place a run's plan is re-derived
    model_file = load_model_file(model_path, _hf_options(plan, model_path))
    mesh = build_mesh(plan, device.type)
    status.progress("build")
    # split by tensor parallelism first (nothing without it): FSDP2 shards and gathers the local tensors
    model = apply_tensor_parallel(build_on_device(model_file, device), plan, mesh)
    comm_predicted = collective_bytes_per_step(plan, *unit_param_shapes(model, plan),
                                               has_backward=units_with_backward(model, plan))
    model = apply_plan(model, plan, mesh)
    optimizer = make_optimizer(plan, model.parameters())
    loss_parallel = plan.tensor_parallel is not None and plan.tensor_parallel.loss_parallel
    data = data_rank(mesh, plan)
    step = Stepper(model_file, model, optimizer, plan.training, data, device, loss_parallel)

    losses = []
    for s in range(options.warmup):
        status.progress(f"warm-up step {s}")
        losses.append(step(s))
    times_s, comm = _timed_steps(step, options, status, device, losses, mesh if plan.mesh.is_tp else None)
    memory = _peak_memory(step, options, status, device, losses)

    status.progress("gather")
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (memory, times_s, comm, data, [float(v) for v in losses]))
    checkpoint = None
    if options.checkpoint_dir:
        saved = _save_and_continue(step, plan, options, len(losses), status)
        del model, optimizer, step
        gc.collect()  # the run that saved is done: free it before the restore builds the model again
        check = restore_and_compare(plan, model_path, options.checkpoint_dir, device, status)
        checkpoint = CheckpointResult(**saved, restores=(check,))
    else:
        del model, optimizer, step
    if rank != 0:
        return None
    return with_prediction(_measurement(plan, options, device, gathered, rederived_from, comm_predicted, checkpoint),
                           plan.predicted)  # a re-derived plan has none: the plan's was for its own world size


def _measurement(plan: Plan, options: RunOptions, device: torch.device, gathered: list, rederived_from: int | None,
                 comm_predicted, checkpoint: CheckpointResult | None) -> Measurement:
    """Rank 0's record from every rank's (memory, step times, per-step collectives, data rank, losses)."""
    cuda, world_size = device.type == "cuda", len(gathered)
    n_times, first_comm = len(gathered[0][1]), gathered[0][2][0]
    rank_losses = [g[4] for g in gathered]
    return Measurement(
        plan_fingerprint=plan_fingerprint(plan),
        model_path=plan.model.path,
        world_size=world_size,
        mesh_shard=plan.mesh.shard_group_size,
        mesh_replicate=plan.mesh.replicate_group_size,
        mesh_tp=plan.mesh.tp_size,
        micro_batch=plan.training.micro_batch,
        samples_per_step=plan.global_batch_samples,
        device=device.type,
        device_name=_device_name(device),
        backend=dist.get_backend(),
        torch_version=torch.__version__,
        memory_method="cuda max_memory_allocated" if cuda else "storage-tracker",
        memory=tuple(g[0] for g in gathered),
        step_time_s=tuple(max(g[1][i] for g in gathered) for i in range(n_times)),
        timing_method="cuda events" if cuda else "wall clock",
        warmup_steps=options.warmup,
        losses=tuple(sum(r[i] for r in rank_losses) / world_size for i in range(len(rank_losses[0]))),
        rederived_from_world_size=rederived_from,
        comm_measured=first_comm[0],
        comm_by_group=first_comm[1],
        comm_same_every_step=all(g[2] == [first_comm] * len(g[2]) for g in gathered),
        comm_predicted=comm_predicted,
        checkpoint=checkpoint,
        allocator_conf=effective_conf(os.environ) if cuda else None,
        data_ranks=tuple(g[3] for g in gathered),
        rank_losses=tuple(tuple(r) for r in rank_losses),
    )


def _timed_steps(step: Stepper, options: RunOptions, status: _Status, device: torch.device,
                 losses: list, tp_mesh: DeviceMesh | None) -> tuple[list[float], list]:
    """The measured steps after warm-up, each started together on every rank: CUDA events on a GPU
    (the peak-memory statistics are reset first), wall clock on CPU. Appends their losses. Returns their
    times and, per step, the collectives this rank issued (execute/comm_count.py): (FSDP2's per collective
    and group size, every one per group). ``tp_mesh``: the mesh of a run with tensor parallelism, whose
    DTensor collectives are counted too ([Note: counting tensor parallelism's collectives])."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times_s, comm = [], []
    counter = CommCounter(tp_mesh)
    functional = FunctionalCollectiveCounter(tp_mesh) if tp_mesh is not None else contextlib.nullcontext()
    for s in range(options.warmup, options.warmup + options.steps):
        dist.barrier()
        status.progress(f"step {s}")
        with counter, functional:
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                losses.append(step(s))
                end.record()
                end.synchronize()
                times_s.append(start.elapsed_time(end) / 1000.0)
            else:
                t0 = time.perf_counter()
                losses.append(step(s))
                times_s.append(time.perf_counter() - t0)
        fsdp = counter.take_by_group()
        tp = functional.take() if tp_mesh is not None else ()
        comm.append((by_group_size(fsdp), fsdp + tp))
    return times_s, comm


def _peak_memory(step: Stepper, options: RunOptions, status: _Status, device: torch.device,
                 losses: list) -> RankMemory:
    """This rank's peak: the CUDA allocator's over the timed steps on a GPU; on CPU one more step under
    the storage tracker (its loss is appended)."""
    rank = dist.get_rank()
    if device.type == "cuda":
        return RankMemory(rank, torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device),
                          num_alloc_retries=int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)))
    s = options.warmup + options.steps
    # Tensors held by reference cycles of earlier steps (autograd graph <-> FSDP2 hooks) are freed
    # whenever the cyclic collector happens to run: without this, the measured peak moved by one to
    # four activations from run to run (cost-model real-run tests). Collect them first.
    gc.collect()
    dist.barrier()
    status.progress(f"memory step {s}")
    step.tracker = StorageTracker(track=(step.model, step.optimizer), device_type="cpu")
    with step.tracker:
        losses.append(step(s))
    memory = RankMemory(rank, step.tracker.peak_bytes, None, step.tracker.peak_phase)
    step.tracker = None
    return memory


# ---- run --checkpoint ----
def _mean_over_ranks(losses: list) -> list[float]:
    total = torch.stack(losses).float() if losses else torch.zeros(0)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def _save_and_continue(step: Stepper, plan: Plan, options: RunOptions, next_step: int, status: _Status) -> dict:
    """Save a checkpoint before step ``next_step``, record digests of what was saved, train
    ``checkpoint_steps`` more steps (the uninterrupted run the restore is compared with) and, on rank 0,
    write the side file. Returns the save's figures (CheckpointResult's fields but ``restores``)."""
    directory, rank = options.checkpoint_dir, dist.get_rank()
    progress = {"step": next_step, "data_ranks": plan.mesh.dp_size, "micro_batch": plan.training.micro_batch}
    status.progress("checkpoint save")
    save_s, extra_bytes = save_checkpoint(step.model, step.optimizer, progress, directory, step.device)
    status.progress("checkpoint digests")
    digests = state_digests(step.model, step.optimizer)
    after = []
    for s in range(next_step, next_step + options.checkpoint_steps):
        status.progress(f"step {s} after the checkpoint")
        after.append(step(s))
    losses_after = _mean_over_ranks(after)
    extras: list = [None] * dist.get_world_size()
    dist.all_gather_object(extras, extra_bytes)
    if rank == 0:
        write_side_file(directory, {**progress, "plan_fingerprint": plan_fingerprint(plan),
                                    "losses_after": losses_after, "digests": digests})
    dist.barrier()  # the side file is there before anyone reads it
    return dict(saved_at_step=next_step, world_size=dist.get_world_size(), save_s=save_s,
                size_bytes=directory_bytes(directory), save_extra_peak_bytes=max(extras),
                frozen_params_left_out=frozen_numel(step.model),
                save_memory_method="cuda max_memory_allocated" if step.device.type == "cuda" else "storage-tracker",
                directory=directory)


def restore_and_compare(plan: Plan, model_path: str, directory: str, device: torch.device,
                        status: _Status) -> RestoreCheck:
    """Build the model afresh in this world (any size), restore ``directory``, compare every tensor with the
    saved digests and the next steps' losses with the uninterrupted run's (execute/checkpoint.py)."""
    record = read_side_file(directory)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    plan, _ = plan.at_world_size(world_size)
    model_file = load_model_file(model_path, _hf_options(plan, model_path))
    status.progress("checkpoint restore: build")
    mesh = build_mesh(plan, device.type)
    model = apply_plan(build_on_device(model_file, device), plan, mesh)
    optimizer = make_optimizer(plan, model.parameters())
    status.progress("checkpoint restore: load")
    progress, load_s = load_checkpoint(model, optimizer, directory, device)
    status.progress("checkpoint restore: digests")
    digests = state_digests(model, optimizer)
    data, dp_size = data_rank(mesh, plan), plan.mesh.dp_size
    step = Stepper(model_file, model, optimizer, plan.training, data, device,
                   plan.tensor_parallel is not None and plan.tensor_parallel.loss_parallel)
    data_ranks, micro_batch = int(progress["data_ranks"]), int(progress["micro_batch"])
    if data_ranks != dp_size or micro_batch != plan.training.micro_batch:
        step.batch_fn = lambda s: regrouped_batch(
            [make_step_batch(model_file, micro_batch, s, r, device) for r in range(data_ranks)], dp_size, data)
    losses = []
    for s in range(int(progress["step"]), int(progress["step"]) + len(record["losses_after"])):
        status.progress(f"step {s} after the restore")
        losses.append(step(s))
    tolerance, reason = loss_tolerance(data_ranks, dp_size, device)
    return RestoreCheck(world_size=world_size, load_s=load_s, tensors_checked=len(record["digests"]),
                        tensors_differing=differing_entries(record["digests"], digests) if rank == 0 else (),
                        losses_uninterrupted=tuple(record["losses_after"]), losses_restored=tuple(_mean_over_ranks(losses)),
                        loss_tolerance_rel=tolerance, loss_tolerance_reason=reason)


_COMMUNICATION_SIGNS = ("connection closed by peer", "connection reset by peer", "timed out", "timeout",
                        "broken pipe", "socket", "nccl")


def _classify(exc: BaseException) -> str:
    """A short kind for the launcher: "out of memory", "communication error" (a consequence of another
    rank's failure, see [Note: naming the failing rank] in launch.py), or what was raised."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return "out of memory"
    text = str(exc).lower()
    if isinstance(exc, dist.DistError) or (
            type(exc) is RuntimeError and any(sign in text for sign in _COMMUNICATION_SIGNS)):
        from shard_planner.execute.launch import COMMUNICATION

        return COMMUNICATION
    if isinstance(exc, UserError):
        return type(exc).__name__
    return "raised " + type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shard_planner.execute.worker",
                                     description="One rank of shard-planner run (also under torchrun).")
    parser.add_argument("plans", nargs="+", metavar="PLAN", help="plan files, run in turn in one world")
    parser.add_argument("--steps", type=positive_int, default=5)
    parser.add_argument("--warmup", type=non_negative_int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    parser.add_argument("--timeout", type=positive_float, default=300.0, help="seconds any collective may wait")
    parser.add_argument("--out", help="measurement file rank 0 writes, for one plan "
                        "(default: measurement.json beside the plan)")
    parser.add_argument("--out-dir", help="folder for measurement-<i>.json, one per plan (i from 0)")
    parser.add_argument("--checkpoint-dir", help="after the measured steps, save a distributed checkpoint here "
                        "(a new or empty folder), restore it into a model built afresh and compare")
    parser.add_argument("--checkpoint-steps", type=positive_int, default=2,
                        help="steps compared after the restore (default 2)")
    parser.add_argument("--resume-from", help="only restore this checkpoint (written with --checkpoint-dir, at any "
                        "world size) and compare; rank 0 writes the comparison to --out")
    parser.add_argument("--status-dir", help=argparse.SUPPRESS)  # the local launcher's
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    if hasattr(signal, "SIGUSR1"):  # the launcher asks a rank that seems hung where it is
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    logging.basicConfig(format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    status = _Status(args.status_dir, rank)
    try:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RunError("RANK and WORLD_SIZE are not set: start this under torchrun or use shard-planner run")
        if args.out and len(args.plans) > 1:
            raise RunError("--out names one file: use --out-dir with several plans")
        if (args.checkpoint_dir or args.resume_from) and len(args.plans) > 1:
            raise RunError("--checkpoint-dir and --resume-from take one plan")
        from shard_planner.execute.launch import resolve_device, resolve_model_path

        jobs = []
        for i, path in enumerate(args.plans):
            plan = load_plan(path)
            if args.out_dir:
                out = str(Path(args.out_dir) / f"measurement-{i}.json")
            elif len(args.plans) == 1:  # --resume-from writes the restore's comparison, not a measurement
                out = args.out or str(Path(path).with_name("restore.json" if args.resume_from else "measurement.json"))
            else:
                out = str(Path(path).with_name(Path(path).stem + ".measurement.json"))
            jobs.append(Job(plan, resolve_model_path(plan, path), out))
        run_rank(jobs, RunOptions(args.steps, args.warmup, resolve_device(args.device), args.timeout,
                                  args.checkpoint_dir, args.checkpoint_steps, args.resume_from), status)
        return 0
    except BaseException as exc:  # report every failure, including KeyboardInterrupt/SystemExit
        kind = _classify(exc)
        message = first_line(exc)
        status.error(kind, status.label + message, traceback.format_exc())
        print(f"[rank{rank}] shard-planner worker: {kind}: {message}", file=sys.stderr)
        if not isinstance(exc, UserError):
            traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
