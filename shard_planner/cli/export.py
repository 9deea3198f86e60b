"""``shard-planner export plan.json --to fsdp2|accelerate|torchtitan|deepspeed [-o FILE]``."""

from __future__ import annotations

import argparse
import sys
from shard_planner.fileio import check_output_file, write_atomic
from shard_planner.report.export import TARGETS, export_plan, model_info_from_model, model_info_from_trace


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export", help="write the plan for a training stack: FSDP2 code, Accelerate, torchtitan or DeepSpeed config",
        description="Export a plan for a training stack. fsdp2 writes a Python function apply_sharding(model, mesh) "
                    "that needs only torch; accelerate (YAML), torchtitan (a torchtitan 0.3 config module for "
                    "--module/--config) and deepspeed (JSON) write configs and list what the plan decides that the "
                    "stack cannot express, with the nearest setting used.")
    p.add_argument("plan", help="plan.json written by shard-planner plan")
    p.add_argument("--to", required=True, choices=TARGETS, help="the training stack")
    p.add_argument("-o", "--output", help="file to write (default: standard output)")
    p.add_argument("--trace", metavar="TRACE_JSON",
                   help="the plan's trace.json, for module classes and sizes (default: build the plan's model on "
                        "the meta device)")
    return p


def run(args) -> int:
    from shard_planner.checked_plan import load_checked_plan, plan_model

    if args.output:
        check_output_file(args.output, "export")
    if args.trace:  # the plan's trace stands for its model (which need not be here)
        from shard_planner.trace import load_trace

        trace = load_trace(args.trace)
        plan = load_checked_plan(args.plan, trace=trace, source=args.trace)
        info = model_info_from_trace(trace)
    else:  # its model built on the meta device (once: plan_model is memoized), checked
        plan = load_checked_plan(args.plan)
        info = model_info_from_model(plan_model(plan.model))
    result = export_plan(plan, args.to, info)
    if args.output:
        write_atomic(args.output, result.text)
        print(f"wrote {args.output} ({args.to})")
    else:
        sys.stdout.write(result.text)
    if result.notes:
        print(f"{len(result.notes)} decision(s) of the plan cannot be expressed exactly for {args.to} "
              "(nearest setting used; also written in the file):", file=sys.stderr)
        for note in result.notes:
            print(f"  - {note}", file=sys.stderr)
    return 0
