"""``shard-planner run plan.json``: run a plan with real FSDP2, measure it, compare with the prediction.

Launches the ranks on this machine (one process each; under ``torchrun`` this command is one rank),
trains on the model file's synthetic batches and writes ``measurement.json`` beside the plan.
"""

from __future__ import annotations

import argparse
import os

from shard_planner.cli.args import add_device, non_negative_int, positive_float, positive_int
from shard_planner.units import format_bytes


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run", help="run a plan with real FSDP2 and measure peak memory and step time",
        description="Run a plan with real FSDP2 on this machine: one process per rank (GPUs with NCCL, or CPU "
                    "with gloo when there are none), synthetic batches from the model file, the planned "
                    "optimizer. Measures peak memory per rank and step time after warm-up, writes "
                    "measurement.json beside the plan and prints predicted vs measured. Under torchrun "
                    "(several nodes) this command runs as one rank.")
    p.add_argument("plan", help="plan.json written by shard-planner plan")
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps after warm-up (default 5)")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--world-size", type=positive_int,
                   help="ranks to run (default: the plan's GPUs); fewer re-derive the plan for that size")
    p.add_argument("--timeout", type=positive_float, default=300.0,
                   help="seconds the whole run may take before it is ended as hung (default 300)")
    add_device(p)
    p.add_argument("-o", "--output", help="measurement file (default: measurement.json beside the plan)")
    c = p.add_argument_group("checkpoint", "after the measured steps, save a distributed checkpoint (DCP: sharded "
                             "model, optimizer state, progress), train on, restore it into the model built afresh "
                             "and compare every tensor and the next steps' losses")
    c.add_argument("--checkpoint", action=argparse.BooleanOptionalAction, default=True,
                   help="save and restore a checkpoint (default; --no-checkpoint skips it)")
    c.add_argument("--checkpoint-dir", metavar="DIR", help="keep the checkpoint in DIR, a new or empty folder "
                   "(default: a temporary folder, removed)")
    c.add_argument("--checkpoint-steps", type=positive_int, default=2,
                   help="steps compared after the restore (default 2)")
    c.add_argument("--checkpoint-reshard-to", type=positive_int, metavar="N",
                   help="also restore it on N ranks (a second launch reading the folder: DCP reshards on load)")
    c.add_argument("--resume-from", metavar="DIR", help="only restore the checkpoint in DIR (kept by an earlier run "
                   "with --checkpoint-dir) on --world-size ranks and compare; writes nothing")
    return p


def losses_line(m) -> str:
    """The mean loss of every step the ranks ran, and which steps they were: on CPU one more step than
    --warmup + --steps runs after the timed ones, under the storage tracker that measures peak memory
    (execute/worker.py _peak_memory), and its loss is listed too."""
    timed = len(m.step_time_s)
    extra = len(m.losses) - m.warmup_steps - timed
    steps = [f"{m.warmup_steps} warm-up", f"{timed} timed"] + (
        [f"{extra} more measuring peak memory [{m.memory_method}]"] if extra > 0 else [])
    return f"losses ({', '.join(steps)}): " + " ".join(f"{v:.4f}" for v in m.losses)


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def run(args) -> int:
    if _under_torchrun():  # one rank of a torchrun job: the worker entry point does the work
        from shard_planner.execute.worker import main as worker_main

        argv = [args.plan, "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
                "--timeout", str(args.timeout), "--checkpoint-steps", str(args.checkpoint_steps)]
        if args.checkpoint and args.checkpoint_dir:  # a folder every node sees; no temporary one under torchrun
            argv += ["--checkpoint-dir", args.checkpoint_dir]
        argv += ["--resume-from", args.resume_from] if args.resume_from else []
        return worker_main(argv + (["--out", args.output] if args.output else []))

    from shard_planner.execute.checkpoint_dir import check_new_directory
    from shard_planner.execute.launch import resolve_device
    from shard_planner.execute.runner import CheckpointOptions, run_plan_file
    from shard_planner.fileio import check_output_file
    from shard_planner.load.checked_plan import load_checked_plan
    from shard_planner.plan.measurement import measurement_path_for

    plan = load_checked_plan(args.plan)  # checked against its model before any rank starts
    if args.resume_from:
        return _resume(args, plan)
    check_output_file(args.output or measurement_path_for(args.plan), "measurement")
    if args.checkpoint and args.checkpoint_dir:
        check_new_directory(args.checkpoint_dir, create=False)
    device = resolve_device(args.device)
    world_size = args.world_size if args.world_size is not None else plan.mesh.world_size
    where = ("CUDA/NCCL" if device == "cuda" else
             "CPU/gloo (no GPU used: peak memory by the storage tracker, step time by wall clock)")
    print(f"running {args.plan} on {world_size} rank{'s' if world_size > 1 else ''}, {where}")
    rederived = world_size != plan.mesh.world_size
    if rederived:
        print(f"re-derived: the plan is for {plan.mesh.world_size} GPUs "
              f"(mesh {plan.mesh.shape_text}); running the same units on {world_size} "
              f"rank{'s' if world_size > 1 else ''} (plain FSDP, Plan.with_world_size); its predictions do not "
              "apply: re-estimating with the cost model where it is available")
    checkpoint = (CheckpointOptions(args.checkpoint_dir, args.checkpoint_steps, args.checkpoint_reshard_to)
                  if args.checkpoint else None)
    m, out = run_plan_file(args.plan, out=args.output, world_size=world_size, steps=args.steps,
                           warmup=args.warmup, timeout_s=args.timeout, device=device, reestimate_rederived=True,
                           checkpoint=checkpoint)
    if rederived:
        print("predictions re-estimated for this world size" if m.predicted_peak_bytes is not None
              else "no prediction for this world size (the cost model is missing or could not estimate it)")
    per_rank = ", ".join(f"rank {r.rank} {format_bytes(r.peak_bytes)}" + (f" ({r.peak_phase})" if r.peak_phase else "")
                         for r in m.memory)
    print(f"peak memory: {format_bytes(m.peak_bytes)} max over ranks [{m.memory_method}]: {per_rank}")
    if m.reserved_bytes is not None:
        print(f"reserved by the allocator: {format_bytes(m.reserved_bytes)} (max_memory_reserved)")
    print(f"step time: median {m.step_time_median_s:.4f} s, spread {m.step_time_spread_s:.4f} s over "
          f"{len(m.step_time_s)} steps after {m.warmup_steps} warm-up [{m.timing_method}]")
    if m.samples_per_s is not None:
        print(f"throughput: {m.samples_per_s:,.1f} samples/s ({m.samples_per_step} samples a step over "
              f"{m.mesh.dp_size} data-parallel rank{'s' if m.mesh.dp_size > 1 else ''})")
    print(losses_line(m))
    rows = m.comparison()
    if rows:
        print(f"{'':14}{'predicted':>14}{'measured':>14}{'error':>9}")
        for name, predicted, measured, err_pct in rows:
            if name == "peak_bytes":
                print(f"{'peak memory':14}{format_bytes(predicted):>14}{format_bytes(measured):>14}{err_pct:+8.1f}%")
            else:
                print(f"{'step time':14}{predicted:>12.4f} s{measured:>12.4f} s{err_pct:+8.1f}%")
        if m.predicted_overhead_bytes:
            print(f"(predicted peak memory without the {format_bytes(m.predicted_overhead_bytes)} of overhead "
                  "- CUDA context, NCCL buffers - that the allocator does not see; with it: "
                  f"{format_bytes(m.predicted_peak_bytes)})")
        if device == "cpu" and "cpu" not in plan.cluster.profile.lower():
            print(f"note: the predicted step time is for profile {plan.cluster.profile!r}, not this CPU")
    elif plan.predicted is None:
        print("the plan holds no prediction to compare with")
    _print_comm(m)
    ok = _print_checkpoint(m.checkpoint, plan) if m.checkpoint is not None else True
    print(f"wrote {out}")
    return 0 if ok else 1


def _print_comm(m) -> None:
    """FSDP2's collectives per step, predicted beside measured (nothing when the run had none), then
    :func:`_print_comm_tp`'s."""
    rows = m.comm_comparison()
    if rows:
        print(f"{'communication per step':30}{'predicted':>14}{'measured':>14}")
        for collective, group, predicted, measured in rows:
            p = format_bytes(predicted) if predicted is not None else "-"
            print(f"  {collective.replace('_', '-') + f' over {group} ranks':28}{p:>14}"
                  f"{format_bytes(measured) if measured is not None else '-':>14}")
        if m.comm_matches:
            print("  measured bytes equal the predicted bytes exactly")
        elif m.comm_predicted is not None:
            print("  measured bytes differ from the prediction" + (
                "" if m.comm_same_every_step else " (and differ between ranks or timed steps)"))
    _print_comm_tp(m)


def _print_comm_tp(m) -> None:
    """Tensor parallelism's collectives per step (DTensor's), predicted beside measured, and whether they are
    equal call for call and byte for byte (Measurement.comm_tp_matches)."""
    rows = m.comm_tp_comparison()
    if not rows:
        return
    print(f"{'tensor parallelism per step (DTensor)':40}{'predicted':>25}{'measured':>25}")
    for collective, group, size, predicted, measured in rows:
        what = f"{collective.replace('_', '-')} over {group} ({size} ranks)"
        print(f"  {what:38}{_calls_bytes(predicted):>25}{_calls_bytes(measured):>25}")
    if m.comm_tp_matches:
        print("  measured calls and bytes equal the predicted ones exactly")
    elif m.comm_tp_predicted is not None:
        print("  measured calls or bytes differ from the prediction" + (
            "" if m.comm_same_every_step else " (and differ between ranks or timed steps)"))
    else:
        print("  (no prediction: the model could not be traced at the plan's degree, see the log)")


def _calls_bytes(entry: tuple[int, int] | None) -> str:
    """``N calls, SIZE`` of a (calls, bytes) pair; "-" for none."""
    if entry is None:
        return "-"
    calls, nbytes = entry
    return f"{calls} call{'s' if calls != 1 else ''}, {format_bytes(nbytes)}"


def _print_checkpoint(c, plan) -> bool:
    """Print the checkpoint's figures and each restore's comparison; True when every restore matched."""
    where = c.directory if c.directory else "a temporary folder, removed"
    print(f"checkpoint at step {c.saved_at_step} ({where}): {format_bytes(c.size_bytes)} on disk, saved in "
          f"{c.save_s:.3f} s, {format_bytes(c.save_extra_peak_bytes)} extra peak memory while saving "
          f"[{c.save_memory_method}]")
    if c.frozen_params_left_out:
        print(f"  it holds what training changes, the trainable parameters and their optimizer state; the "
              f"{c.frozen_params_left_out:,} frozen parameters are left out ({frozen_source(plan)})")
    for r in c.restores:
        print(f"  {_restore_line(r)}")
    return c.ok


def frozen_source(plan) -> str:
    """Where a checkpoint's left-out frozen parameters come from when training resumes: a model file builds
    them; a transformers config's are the pretrained weights the training script loads."""
    from shard_planner.model.hf import config_file

    if config_file(plan.model.path) is not None:
        return "a transformers config's are its pretrained weights, which the training script loads"
    return "the model file builds them"


def _restore_line(r) -> str:
    tensors = (f"all {r.tensors_checked} state entries equal" if not r.tensors_differing else
               f"{len(r.tensors_differing)} of {r.tensors_checked} state entries differ (first: {r.tensors_differing[0]})")
    exact = "exactly" if r.loss_tolerance_rel == 0 else f"within {r.loss_tolerance_rel:g} relative"
    losses = (f"next {len(r.losses_restored)} losses equal {exact}" if r.losses_match else
              f"next losses differ: {' '.join(f'{v:.6f}' for v in r.losses_restored)} after the restore vs "
              f"{' '.join(f'{v:.6f}' for v in r.losses_uninterrupted)} uninterrupted")
    verdict = "restore verified" if r.ok else "restore FAILED"
    return f"{verdict} on {r.world_size} rank{'s' if r.world_size > 1 else ''}: loaded in {r.load_s:.3f} s; {tensors}; {losses}"


def _resume(args, plan) -> int:
    """``--resume-from DIR``: restore a kept checkpoint on --world-size ranks and compare; writes nothing."""
    from shard_planner.execute.runner import restore_plan_file

    world_size = args.world_size if args.world_size is not None else plan.mesh.world_size
    print(f"restoring {args.resume_from} on {world_size} rank{'s' if world_size > 1 else ''}")
    check = restore_plan_file(args.plan, args.resume_from, world_size=world_size, timeout_s=args.timeout,
                              device=args.device)
    print(_restore_line(check))
    return 0 if check.ok else 1
