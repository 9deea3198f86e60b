"""``shard-planner report plan.json [measurement.json] [-o DIR]``: the plots and tables of a plan (default
folder: beside the plan, ``<plan name>.report/``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shard_planner.load.checked_plan import check_plan, check_tp_degree, checked_plan_file
from shard_planner.errors import UserError
from shard_planner.fileio import check_output_dir
from shard_planner.plan import load_plan, report_dir_for
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
        from shard_planner.plan.measurement import load_measurement

        measurement = load_measurement(args.measurement)
    profile = None
    if args.profile or not args.no_trace:
        # the timeline is priced with the profile and the module timings the plan records (resolved beside it):
        # one missing here is one line, not a report without its timeline (--no-trace draws the file alone)
        from shard_planner.hardware.profile import load_priced_profile

        with checked_plan_file(args.plan):
            profile = load_priced_profile(args.profile or plan.cluster.profile, plan.cluster.timings)
    if args.no_trace:
        trace = None
        with checked_plan_file(args.plan):  # what can be checked without the model
            check_tp_degree(plan)
    else:
        trace = _checked_trace(args, plan)
    from shard_planner.report import write_report

    with progress("writing the report"):
        html = write_report(plan, out, trace=trace, profile=profile, measurement=measurement)
    print(f"report: {html}")
    print(f"        {html.with_name('report.md')} (PNGs beside it)")
    sys.stdout.flush()
    return 0


def _checked_trace(args, plan):
    """The trace the report draws: ``--trace`` (a trace.json, or a model file traced as the plan runs it) or
    the plan's own model traced so; the plan checked against it first (load/checked_plan.py [Note: A plan checked
    against its model]): nothing is traced for a model the plan was not made for."""
    from shard_planner.model.hf import model_options
    from shard_planner.model.modelfile import load_unless_trace
    from shard_planner.trace import trace_for_plan, trace_or_load

    source = args.trace or plan.model.path
    if not args.trace and not Path(source).exists() and not source.replace(".", "").isidentifier():
        raise UserError(f"the plan's model file {source} is not here: give --trace TRACE_OR_MODEL or --no-trace")
    model_file = load_unless_trace(source, model_options(plan.model, source))  # a config as planned
    with checked_plan_file(args.plan):
        if model_file is None:  # a trace.json: it stands for the model
            trace = trace_or_load(source, dtype=plan.training.numerics.compute_dtype)
            check_plan(plan, trace=trace, source=source)
            return trace
        check_plan(plan, model_file=model_file)
    with progress(f"tracing {source}"):
        return trace_for_plan(model_file, plan)  # one rank at the plan's tensor-parallel degree
