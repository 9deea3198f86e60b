"""``shard-planner export plan.json --to fsdp2|accelerate|torchtitan|deepspeed [-o FILE]``."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from shard_planner.errors import UserError
from shard_planner.fileio import check_output_file, write_atomic
from shard_planner.plan import load_plan, resolve_model_file
from shard_planner.report.export import TARGETS, export_plan, model_info_from_trace


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
    p.add_argument("--trace", metavar="TRACE_OR_MODEL",
                   help="the plan's trace.json or model file (traced), for module classes and sizes (default: build "
                        "the plan's model on the meta device)")
    return p


# What each export is, and the names its file may have by its suffix (report/export: Export.suffix): `-o x.toml`
# for torchtitan wrote a Python config module into a .toml file.
KINDS = {"fsdp2": "Python code", "torchtitan": "a Python config module (for torchtitan's --module/--config)",
         "accelerate": "a YAML config", "deepspeed": "a JSON config"}
SUFFIXES = {".py": (".py",), ".yaml": (".yaml", ".yml"), ".json": (".json",)}


def run(args) -> int:
    if args.output:
        check_output_file(args.output, "export")
    plan = load_plan(args.plan)
    # the model file is found beside the plan too, wherever the command runs
    plan = replace(plan, model=replace(plan.model, path=resolve_model_file(plan.model, args.plan)))
    info = None
    if args.trace and args.to in ("accelerate", "deepspeed"):
        info = model_info_from_trace(_trace(args.trace, plan))
    result = export_plan(plan, args.to, info)
    if args.output and Path(args.output).suffix not in SUFFIXES[result.suffix]:
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


def _trace(source: str, plan):
    """--trace: a trace.json read, or a model file (or transformers config, as planned) traced at the plan's
    degree and dtype, as ``report --trace`` takes it."""
    from shard_planner.hf import model_options
    from shard_planner.modelfile import load_unless_trace
    from shard_planner.trace import load_trace, trace_for_plan

    model_file = load_unless_trace(source, model_options(plan.model, source))
    return load_trace(source) if model_file is None else trace_for_plan(model_file, plan)
