"""``shard-planner tune model.py --gpus N --mem M [--trials K]``: plan, run the best K plans for real, fit
the profile to what was measured, and keep the measured best."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shard_planner.cli.args import byte_size, non_negative_int, positive_float, positive_int
from shard_planner.errors import UserError
from shard_planner.fileio import check_output_dir, check_output_file
from shard_planner.progress import progress
from shard_planner.units import DTYPE_NAMES, format_bytes

CPU_DEFAULT_WORLD_SIZE = 2  # gloo ranks on a CPU machine (DESIGN.md: 2-4 on two cores)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tune", help="run the best few plans for real, fit the profile, keep the measured best",
        description="Plan the model, run the top-K distinct plans for a few steps each with real FSDP2, fit the "
                    "profile's compute efficiency and collective bandwidth/latency to the measured step times, "
                    "re-rank, stop early when no remaining plan can beat the measured best, and write the "
                    "measured best (with every measurement) as the plan, the fitted profile and a report.")
    p.add_argument("model", help="model file (build_model, make_batch, loss_fn, TRAINING)")
    p.add_argument("--gpus", type=positive_int, required=True, help="GPUs to plan for")
    p.add_argument("--mem", type=byte_size, required=True, help="memory budget per GPU, e.g. 40GB")
    p.add_argument("--trials", type=positive_int, default=3, help="most plans to run for real (default 3)")
    p.add_argument("--profile", help="hardware profile name or TOML path (default: cpu-gloo on a machine "
                                     "without CUDA; required with CUDA)")
    p.add_argument("--timings", metavar="FILE",
                   help="measured module times (shard-planner calibrate --model, same model, device and --dtype) "
                        "to price compute from instead of FLOPs")
    p.add_argument("--world-size", type=positive_int,
                   help=f"ranks to run on (default: --gpus; {CPU_DEFAULT_WORLD_SIZE} on CPU): the plans are "
                        "re-derived for it when it differs from --gpus")
    p.add_argument("--gpus-per-node", type=positive_int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--micro-batch", type=positive_int, help="micro-batch per GPU (default: the model file's)")
    tp = p.add_argument_group("tensor parallelism")
    tp.add_argument("--tp", type=positive_int, default=1, metavar="N",
                    help="tensor-parallel degree every candidate keeps (default 1): N GPUs of a node split every "
                    "block, styles derived as plan --tp derives them; it must divide the GPUs per node, --gpus, "
                    "--world-size and the model's heads, MLP width and vocabulary")
    tp.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                    help="with --tp, keep the norms and the block inputs whole on every rank")
    tp.add_argument("--no-loss-parallel", dest="loss_parallel", action="store_false",
                    help="with --tp, gather the logits before the loss")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_NAMES),
                   help="mixed-precision param dtype the model is traced, planned and run in (default bf16)")
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps per plan (default 5)")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="warm-up steps per plan (default 2)")
    p.add_argument("--per-launch", type=positive_int,
                   help="plans run per launch (default: half of --trials, rounded up; a launch costs 10-20 s on CPU)")
    p.add_argument("--timeout", type=positive_float, default=600.0, help="seconds one launch may take (default 600)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("-o", "--output", default="plan.json", help="plan file to write (default plan.json)")
    p.add_argument("--profile-out", help="fitted profile to write (default: <plan>-fitted.toml beside the plan)")
    p.add_argument("--report-dir", "--report", dest="report", metavar="DIR",
                   help="report folder (default: beside the plan, <plan name>.report/)")
    p.add_argument("--no-report", action="store_true", help="do not write a report")
    return p


def _resolve(args) -> tuple[str, int, str]:
    """(profile, world size, device) from the arguments and the machine."""
    from shard_planner.execute.launch import resolve_device

    device = resolve_device(args.device)
    profile = args.profile
    if profile is None:
        if device == "cuda":
            raise UserError("give --profile (e.g. h100-80gb) for a CUDA machine")
        profile = "cpu-gloo"
    world_size = args.world_size
    if world_size is None:
        world_size = args.gpus if device == "cuda" else min(args.gpus, CPU_DEFAULT_WORLD_SIZE)
    return profile, world_size, device


def run(args) -> int:
    from shard_planner.plan import report_dir_for, save_plan
    from shard_planner.tune import check_degree, tune_model

    budget = args.mem
    profile, world_size, device = _resolve(args)
    check_degree(args.tp, gpus=args.gpus, gpus_per_node=args.gpus_per_node, world_size=world_size)
    out = Path(args.output)
    profile_out = Path(args.profile_out) if args.profile_out else out.with_name(f"{out.stem}-fitted.toml")
    report_dir = None if args.no_report else Path(args.report) if args.report else report_dir_for(out)
    check_output_file(out, "plan")
    check_output_file(profile_out, "fitted profile")
    if report_dir is not None:
        check_output_dir(report_dir, "report")
    if world_size != args.gpus:
        print(f"tune: running at world size {world_size} on {device}: each plan for {args.gpus} GPUs is re-derived "
              f"for {world_size} ranks to run; the returned plan is for {args.gpus} GPUs")
    sys.stdout.flush()
    with progress(f"tuning {args.model}"):
        result = tune_model(
            args.model, gpus=args.gpus, mem_budget_bytes=budget, profile=profile, trials=args.trials,
            world_size=world_size, gpus_per_node=args.gpus_per_node, micro_batch=args.micro_batch,
            dtype=DTYPE_NAMES[args.dtype], per_launch=args.per_launch, steps=args.steps, warmup=args.warmup,
            timeout_s=args.timeout, device=device, profile_out=profile_out, report_dir=report_dir,
            timings=args.timings, tp=args.tp, sequence_parallel=args.sequence_parallel,
            loss_parallel=args.loss_parallel)
    save_plan(result.plan, out)

    print(f"{'#':>2}  {'launch':>6}  {'measured s':>10}  {'prior s':>9}  {'fitted s':>9}  {'peak':>11}  "
          f"{'pred. peak':>11}  plan")
    for i, t in enumerate(result.trials):
        mark = "*" if i == result.chosen else " "
        print(f"{i + 1:>2}{mark} {t.round:>6}  {t.measured_s:>10.4g}  {t.predicted_prior_s:>9.4g}  "
              f"{result.fit.predicted_after_s[i]:>9.4g}  {format_bytes(t.measurement.peak_bytes):>11}  "
              f"{format_bytes(t.predicted_peak_bytes):>11}  {t.candidate.description}")
    for s in result.skipped:
        print(f" -  {'skipped':>6}  {'':>10}  {s.predicted_prior_s:>9.4g}  "
              f"{s.predicted_fitted_s:>9.4g}  {'':>11}  {'':>11}  {s.candidate.description}: {s.reason}")
    fit = result.fit
    print(f"fit: {', '.join(f'{k} x{v:.3g}' for k, v in fit.factors.items())}; step-time error "
          f"max {max(abs(e) for e in fit.errors_before):.1%} before, {fit.max_abs_error_after:.1%} after")
    where = f" (at world size {result.world_size}; the ranking for {args.gpus} GPUs may differ)" if result.rederived else ""
    print(f"chosen: run {result.chosen + 1}, {result.best.measured_s:.4g} s measured{where}; "
          f"{result.launches} launch(es), {result.seconds:.1f} s")
    print(f"plan: {out}")
    print(f"fitted profile: {profile_out}")
    if report_dir is not None:
        print(f"report: {report_dir / 'report.html'}")
    return 0
