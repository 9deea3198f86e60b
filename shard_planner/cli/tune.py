"""``shard-planner tune model.py --gpus N --mem M [--trials K]``: plan, run the best K plans for real, fit
the profile to what was measured, and keep the measured best."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shard_planner.cli.args import (add_batch_search, add_device, add_dtype, add_engine, add_gpus, add_gpus_per_node, add_hf_arguments,
                                    add_mem, add_model_argument, add_output, add_profile, add_report_arguments,
                                    add_time_limit, add_timings, add_tp_arguments, hf_options, non_negative_int, param_dtype,
                                    positive_float, positive_int, report_dir)
from shard_planner.errors import UserError
from shard_planner.fileio import check_output_dir, check_output_file
from shard_planner.progress import progress
from shard_planner.units import format_bytes

CPU_DEFAULT_WORLD_SIZE = 2  # gloo ranks on a CPU machine (DESIGN.md: 2-4 on two cores)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tune", help="run the best few plans for real, fit the profile, keep the measured best",
        description="Plan the model, run the top-K distinct plans for a few steps each with real FSDP2, fit the "
                    "profile's compute efficiency and collective bandwidth/latency to the measured step times, "
                    "re-rank, stop early when no remaining plan can beat the measured best, and write the "
                    "measured best (with every measurement) as the plan, the fitted profile and a report.")
    add_model_argument(p, trace_json=False)
    add_hf_arguments(p)
    add_gpus(p)
    add_mem(p)
    p.add_argument("--trials", type=positive_int, default=3, help="most plans to run for real (default 3)")
    add_profile(p, default=None, default_text="cpu-gloo on a machine without CUDA; required with CUDA")
    add_timings(p)
    p.add_argument("--world-size", type=positive_int,
                   help=f"ranks to run on (default: --gpus; {CPU_DEFAULT_WORLD_SIZE} on CPU): the plans are "
                        "re-derived for it when it differs from --gpus")
    add_gpus_per_node(p)
    add_batch_search(p)
    add_time_limit(p)
    add_tp_arguments(p, tp_default=1, tp_help="every candidate keeps it (default 1), its styles derived as plan "
                     "derives them; it must divide --world-size too")
    add_dtype(p)
    add_engine(p)
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps per plan (default 5)")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="warm-up steps per plan (default 2)")
    p.add_argument("--per-launch", type=positive_int,
                   help="plans run per launch (default: half of --trials, rounded up; a launch costs 10-20 s on CPU)")
    p.add_argument("--timeout", type=positive_float, default=600.0, help="seconds one launch may take (default 600)")
    add_device(p)
    add_output(p, what="plan", default="plan.json")
    p.add_argument("--profile-out", help="fitted profile to write (default: <plan>-fitted.toml beside the plan)")
    add_report_arguments(p)
    return p


def _resolve(args) -> tuple[str, int, str, int]:
    """(profile, world size, device, GPUs per node) from the arguments, the profile and the machine."""
    from shard_planner.execute.launch import resolve_device
    from shard_planner.hardware.profile import load_profile

    device = resolve_device(args.device)
    profile = args.profile
    if profile is None:
        if device == "cuda":
            raise UserError("give --profile (e.g. h100-80gb) for a CUDA machine")
        profile = "cpu-gloo"
    world_size = args.world_size
    if world_size is None:
        world_size = args.gpus if device == "cuda" else min(args.gpus, CPU_DEFAULT_WORLD_SIZE)
    return profile, world_size, device, args.gpus_per_node or load_profile(profile).interconnect.gpus_per_node


def _plan_options(args) -> dict:
    """The plan search's options (:class:`~shard_planner.solve.PlanRequest` fields) the command line sets,
    as ``plan`` sets them."""
    options = {"time_limit_s": args.time_limit, "search_batch": args.search_batch}
    if args.engine is not None:
        options["engine"] = args.engine
    if args.optimizer_in_backward:
        options["optimizer_in_backward"] = True
    if args.global_batch is not None:
        options["global_batch_samples"] = args.global_batch
    if args.global_batch_tokens is not None:
        options["global_batch_tokens"] = args.global_batch_tokens
    return options


def run(args) -> int:
    from shard_planner.plan import save_plan
    from shard_planner.tune import check_degree, tune_model

    budget = args.mem
    profile, world_size, device, gpus_per_node = _resolve(args)
    check_degree(args.tp, gpus=args.gpus, gpus_per_node=gpus_per_node, world_size=world_size)
    out = Path(args.output)
    profile_out = Path(args.profile_out) if args.profile_out else out.with_name(f"{out.stem}-fitted.toml")
    report = report_dir(args)
    check_output_file(out, "plan")
    check_output_file(profile_out, "fitted profile")
    if report is not None:
        check_output_dir(report, "report")
    if world_size != args.gpus:
        print(f"tune: running at world size {world_size} on {device}: each plan for {args.gpus} GPUs is re-derived "
              f"for {world_size} ranks to run; the returned plan is for {args.gpus} GPUs")
    sys.stdout.flush()
    with progress(f"tuning {args.model}"):
        result = tune_model(
            args.model, gpus=args.gpus, mem_budget_bytes=budget, profile=profile, trials=args.trials,
            world_size=world_size, gpus_per_node=gpus_per_node, micro_batch=args.micro_batch,
            dtype=param_dtype(args), per_launch=args.per_launch, steps=args.steps, warmup=args.warmup,
            timeout_s=args.timeout, device=device, profile_out=profile_out, report_dir=report,
            timings=args.timings, tp=args.tp, sequence_parallel=args.sequence_parallel,
            loss_parallel=args.loss_parallel, plan_options=_plan_options(args), hf_options=hf_options(args))
    save_plan(result.plan, out)  # its files located from there (plan.with_paths_located)

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
    if report is not None:
        print(f"report: {report / 'report.html'}")
    return 0
