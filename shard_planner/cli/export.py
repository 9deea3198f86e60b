"""``shard-planner export plan.json --to fsdp2|accelerate|torchtitan|deepspeed [-o FILE]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shard_planner.errors import UserError
from shard_planner.fileio import check_output_file, write_atomic


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export", help="write the plan for a training stack: FSDP2 code, Accelerate, torchtitan or DeepSpeed config",
        description="Export a plan for a training stack. fsdp2 writes a Python function apply_sharding(model, mesh) "
                    "that needs only torch; accelerate (YAML), torchtitan (a torchtitan 0.3 config module for "
                    "--module/--config) and deepspeed (JSON) write configs and list what the plan decides that the "
                    "stack cannot express, with the nearest setting used.")
    p.add_argument("plan", help="plan.json written by shard-planner plan")
    p.add_argument("--to", required=True, choices=tuple(KINDS), help="the training stack")
    p.add_argument("-o", "--output", help="file to write (default: standard output)")
    p.add_argument("--trace", metavar="TRACE_OR_MODEL",
                   help="the plan's trace.json, or its model file or transformers config, for module classes and sizes "
                        "(default: build the plan's own model on the meta device)")
    return p


# What each export is (the targets of report/export's TARGETS, named here so that building the parser imports no
# report: the report package imports matplotlib and pandas, a second of every command's start; tests/cli/
# test_cli_args.py checks both lists agree), and the names its file may have by its suffix (report/export:
# Export.suffix): `-o x.toml` for torchtitan wrote a Python config module into a .toml file.
KINDS = {"fsdp2": "Python code", "accelerate": "a YAML config",
         "torchtitan": "a Python config module (for torchtitan's --module/--config)", "deepspeed": "a JSON config"}
SUFFIXES = {".py": (".py",), ".yaml": (".yaml", ".yml"), ".json": (".json",)}


def run(args) -> int:
    from shard_planner.report.export import export_plan

    if args.output:
        check_output_file(args.output, "export")
    plan, info = _plan_and_model_info(args.plan, args.trace)
    result = export_plan(plan, args.to, info)
    if args.output and Path(args.output).suffix not in ("", *SUFFIXES[result.suffix]):  # a name without one: as given
        raise UserError(f"-o {args.output}: the {args.to} export is {KINDS[args.to]}; name the file *{result.suffix}")
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


def _plan_and_model_info(plan_path: str, source: str | None):
    """The plan, checked against its model ([Note: A plan checked against its model]), and the module classes and
    sizes the export names: from ``--trace`` (a trace.json, or a model file or transformers config as planned, as
    ``report --trace`` takes it), else from the plan's own model built on the meta device."""
    from shard_planner.load.checked_plan import check_plan, checked_plan_file, load_checked_plan, plan_model
    from shard_planner.report.export import model_info_from_model, model_info_from_trace

    if source is None:
        plan = load_checked_plan(plan_path)
        return plan, model_info_from_model(plan_model(plan.model))  # plan_model is memoized: built once
    from shard_planner.model.hf import model_options
    from shard_planner.model.modelfile import load_unless_trace
    from shard_planner.plan import load_plan
    from shard_planner.trace import load_trace

    plan = load_plan(plan_path)
    model_file = load_unless_trace(source, model_options(plan.model, source))
    with checked_plan_file(plan_path):
        if model_file is None:  # a trace.json stands for a model that need not be here
            trace = load_trace(source)
            check_plan(plan, trace=trace, source=source)
            return plan, model_info_from_trace(trace)
        return plan, model_info_from_model(check_plan(plan, model_file=model_file))
