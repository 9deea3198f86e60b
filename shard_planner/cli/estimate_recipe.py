"""``shard-planner estimate model.py --recipe NAME --gpus N [--mem SIZE]``: a named recipe
(shard_planner/plan/recipes.py) built on the model and priced as ``estimate --plan`` prices a plan file, without
one: the recipe's units, reshard, checkpointing, offload and prefetch; the planner's knobs as given (the
micro-batch; plain FSDP over every GPU, no accumulation, no tensor parallelism)."""

from __future__ import annotations

import argparse
import os

from shard_planner.cli.args import hf_options, param_dtype
from shard_planner.errors import UserError


def recipe_plan_for(args: argparse.Namespace):
    """(plan, trace, profile) of ``estimate --recipe``: the model traced, the recipe's plan built on it (no
    prediction), the profile it is priced on; cli/estimate.py prices and prints it as a plan file's."""
    from shard_planner.cli.plan_degrees import load_and_trace
    from shard_planner.model.hf import as_planned
    from shard_planner.hardware.profile import DEFAULT_PROFILE, load_priced_profile
    from shard_planner.solve.alternatives import recipe_plan

    if args.gpus is None:
        raise UserError("estimate --recipe needs --gpus N: a recipe fixes the units, not the cluster")
    if args.write:
        raise UserError("estimate --recipe writes no plan file: --write is for --plan")
    profile = load_priced_profile(args.profile or DEFAULT_PROFILE, args.timings or None)
    dtype = param_dtype(args)
    profile.check_compute_dtype(dtype)
    trace, defaults, finetune = _traced(args, dtype, load_and_trace)
    request = _request(args, profile, defaults, dtype)
    return as_planned(recipe_plan(trace, request, args.recipe), args.hf_task, finetune), trace, profile


def _traced(args: argparse.Namespace, dtype: str, load_and_trace):
    """(trace, TRAINING defaults or None, fine-tune or None) of the model argument: a trace.json is read."""
    from shard_planner.trace.files import is_trace_file, trace_or_load

    if is_trace_file(args.model):
        return trace_or_load(args.model, dtype=dtype), None, None
    return load_and_trace(args.model, hf_options(args), dtype)


def _request(args: argparse.Namespace, profile, defaults, dtype: str):
    """The PlanRequest the recipe's plan is built for: --gpus, --mem (the device's memory when not given),
    the micro-batch (--micro-batch, the model file's, else 1) and its optimizer."""
    from shard_planner.hardware.allocator_conf import planned_expandable
    from shard_planner.hardware.profile import DEFAULT_PROFILE
    from shard_planner.solve import PlanRequest

    micro_batch = args.micro_batch or (defaults.micro_batch if defaults is not None else None) or 1
    extra = dict(optimizer=defaults.optimizer, lr=defaults.lr) if defaults is not None else {}
    return PlanRequest(gpus=args.gpus, mem_budget_bytes=args.mem or profile.memory_bytes, profile=profile,
                       gpus_per_node=profile.interconnect.gpus_per_node, micro_batch=micro_batch, param_dtype=dtype,
                       model_path=args.model, profile_name=args.profile or DEFAULT_PROFILE,
                       timings_path=args.timings or None, expandable_segments=planned_expandable(os.environ),
                       engine=args.engine, optimizer_in_backward=args.optimizer_in_backward, **extra)
