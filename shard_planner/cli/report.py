"""``shard-planner report plan.json [measurement.json] [-o DIR]``: the plots and tables of a plan (default
folder: beside the plan, ``<plan name>.report/``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shard_planner.errors import PlanError, UserError
from shard_planner.fileio import check_output_dir
from shard_planner.plan import load_plan, report_dir_for, resolve_model_file
from shard_planner.progress import progress


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report", help="write report.html (self-contained) and report.md with plots of a plan",
        description="Write a report of a plan: memory vs throughput frontier, memory timeline, per-unit bars, "
                    "and predicted vs measured when a measurement is given. report.html embeds its images and "
                    "opens offline; report.md has the PNGs beside it.")
    p.add_argument("plan", help="plan.json written by shard-planner plan")
    p.add_argument("measurement", nargs="?", help="measurement.json written by shard-planner run (optional)")
    p.add_argument("-o", "--output", help="output folder (default: beside the plan, <plan name>.report/)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", metavar="TRACE_OR_MODEL",
                     help="trace.json or model file for the timeline and per-unit figures (default: trace the "
                          "plan's model file)")
    src.add_argument("--no-trace", action="store_true",
                     help="do not trace: draw only what the plan file holds (no timeline, no per-unit figures)")
    p.add_argument("--profile", help="hardware profile for the estimate (default: the plan's)")
    return p


def run(args) -> int:
    out = Path(args.output) if args.output else report_dir_for(args.plan)
    check_output_dir(out, "report")
    plan = load_plan(args.plan)
    measurement = None
    if args.measurement:
        from shard_planner.measurement import load_measurement

        measurement = load_measurement(args.measurement)
    trace = None
    if not args.no_trace:
        source = args.trace or resolve_model_file(plan.model, args.plan)
        if not args.trace and not Path(source).exists() and not source.replace(".", "").isidentifier():
            raise UserError(f"the plan's model file {source} is not here: give --trace TRACE_OR_MODEL or --no-trace")
        from shard_planner.hf import model_options
        from shard_planner.modelfile import load_unless_trace
        from shard_planner.trace import trace_for_plan, trace_or_load

        # the plan's own model (or --trace's model file): a transformers config as planned (sequence length,
        # task, fine-tune), traced at the plan's degree (report/__init__.py [Note: One rank's trace])
        model_file = load_unless_trace(source, model_options(plan.model, source))
        with progress(f"tracing {source}"):
            trace = (trace_for_plan(model_file, plan) if model_file is not None  # one rank at the plan's tp
                     else trace_or_load(source, dtype=plan.training.param_dtype))
        if trace.fingerprint != plan.model.fingerprint:
            raise PlanError(f"{source} is not the model the plan was made for (fingerprint {trace.fingerprint}, plan "
                            f"{plan.model.fingerprint}; another SHARD_PLANNER_SIZE?): give the right --trace or "
                            "--no-trace")
    profile = None
    if args.profile:
        from shard_planner.profile import load_priced_profile

        profile = load_priced_profile(args.profile, plan.cluster.timings)
    from shard_planner.report import write_report

    with progress("writing the report"):
        html = write_report(plan, out, trace=trace, profile=profile, measurement=measurement)
    print(f"report: {html}")
    print(f"        {html.with_name('report.md')} (PNGs beside it)")
    sys.stdout.flush()
    return 0
