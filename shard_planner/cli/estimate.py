"""``shard-planner estimate model.py --plan plan.json`` (or ``--recipe NAME --gpus N``): predicted peak memory
(with its breakdown) and step time of a plan, or of a named recipe (shard_planner/plan/recipes.py) built on the
model without a plan file, from the cost model."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from shard_planner.hardware.allocator_conf import mode_name
from shard_planner.load.checked_plan import check_plan, checked_plan_file
from shard_planner.cli.args import (add_dtype, add_engine, add_gpus, add_hf_arguments, add_mem, add_micro_batch, add_model_argument,
                                    add_profile, add_recipe, add_timings, hf_options)
from shard_planner.errors import UserError
from shard_planner.fileio import check_output_file
from shard_planner.plan import MEMORY_CATEGORIES, Plan, load_plan, save_plan
from shard_planner.plan.estimate import asked_again, with_prediction
from shard_planner.units import format_bytes, format_duration


@dataclass(frozen=True)
class EstimateRequest:
    model: str  # a model file, or a trace.json
    plan: str | None  # None: ``recipe``
    profile: str | None  # None: the plan's cluster.profile
    timings: str | None  # None: the plan's cluster.timings; "": price compute from FLOPs
    gpus: int | None  # None: the plan's
    micro_batch: int | None
    write: bool  # store the prediction in the plan file


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "estimate",
        help="predict a plan's per-GPU peak memory (by category) and step time",
        description="Simulate one FSDP2 training step of the plan on the model (traced now, or read from a "
        "trace.json) and print the predicted per-GPU peak memory, its breakdown by category, and the "
        "step time with its compute, communication and optimizer parts. With --recipe NAME instead of --plan, the "
        "recipe (shard_planner/plan/recipes.py) is built on the model for --gpus, --mem (default: the profile's device "
        "memory), --micro-batch and --dtype, and priced the same way.",
    )
    add_model_argument(p, more=" (a config's --seq-len defaults to the plan's)")
    add_hf_arguments(p)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--plan", help="plan.json")
    add_recipe(which)
    add_profile(p, default=None, default_text="the plan's cluster.profile; with --recipe h100-80gb")
    add_gpus(p, required=False, default_text="the plan's; another N estimates the plan's decisions on N GPUs, plain "
             "FSDP over N ranks; required with --recipe")
    add_mem(p, required=False)  # with --recipe (default: the profile's device memory)
    add_timings(p, default_text="the plan's cluster.timings; --timings '' prices from FLOPs")
    add_micro_batch(p, default="the plan's; with --recipe the model file's, else 1")
    add_dtype(p)  # with --recipe: a plan file has its own
    add_engine(p)  # the same
    p.add_argument("--write", action="store_true", help="store the prediction in the plan file's 'predicted'")
    return p


def run(args: argparse.Namespace) -> int:
    from shard_planner.cost import CostModel, estimate
    from shard_planner.cost.fits import device_fit
    from shard_planner.hardware.profile import load_priced_profile
    from shard_planner.model.hf import HfOptions, config_file
    from shard_planner.plan.loss import MODEL
    from shard_planner.model.modelfile import load_unless_trace
    from shard_planner.trace import trace_for_plan, trace_or_load

    if args.recipe is not None:
        return _run_recipe(args)
    if args.mem is not None or args.dtype is not None or args.engine is not None or args.optimizer_in_backward:
        raise UserError("--mem, --dtype, --engine and --optimizer-in-backward are for --recipe: a plan file has its "
                        "own (cluster.mem_budget_bytes, training.param_dtype, engine, training.optimizer_in_backward)")
    req = EstimateRequest(args.model, args.plan, args.profile, args.timings, args.gpus, args.micro_batch, args.write)
    found = load_plan(req.plan)
    if req.write:
        check_output_file(req.plan, "plan")
    # the plan as asked here; its cluster says what it was asked (plan/estimate.py [Note: A plan file never
    # contradicts itself])
    plan = asked_again(found, profile=req.profile, timings=req.timings, gpus=req.gpus, micro_batch=req.micro_batch)
    profile = load_priced_profile(plan.cluster.profile, plan.cluster.timings)
    options = hf_options(args)
    loss = args.loss or plan.model.loss or MODEL  # the loss the plan was made with, unless given
    if config_file(req.model) is not None:  # the sequence length and fine-tune the plan was made for, unless given
        options = HfOptions(args.hf_task or plan.model.hf_task, args.seq_len or plan.model.seq_len,
                            (options.finetune if options is not None else None) or plan.model.finetune, loss)
    else:
        options = HfOptions(loss=loss) if options is None else replace(options, loss=loss)
    model_file = load_unless_trace(req.model, options)
    # a trace.json stands for the model; a model file is checked before it is traced (load/checked_plan.py)
    trace = trace_or_load(req.model, dtype=plan.training.numerics.compute_dtype) if model_file is None else None
    with checked_plan_file(req.plan):
        check_plan(plan, model_file=model_file, trace=trace, source=req.model)
    trace = trace if trace is not None else trace_for_plan(model_file, plan)  # one rank at the plan's tp degree
    est = estimate(trace, plan, profile)
    cm = CostModel(trace, profile)
    fit = device_fit(cm, plan)  # None on a CPU profile
    print(report(plan, profile, est, fit))
    if fit is not None:
        print(reserved_report(plan, cm, fit))
    if req.write:
        save_plan(with_prediction(found, plan, fit.priced(est.prediction()) if fit else est.prediction()), req.plan)
        print(f"wrote the prediction into {req.plan}")
    return 0


def _run_recipe(args: argparse.Namespace) -> int:
    """``estimate --recipe NAME``: the recipe's plan (cli/estimate_recipe.py), priced and printed as a plan file's,
    after the line that says what the recipe fixes and what it leaves to the planner."""
    from shard_planner.cli.estimate_recipe import recipe_plan_for
    from shard_planner.cost import CostModel, estimate
    from shard_planner.cost.fits import device_fit
    from shard_planner.plan.recipes import recipe_named

    plan, trace, profile = recipe_plan_for(args)
    est = estimate(trace, plan, profile)
    cm = CostModel(trace, profile)
    fit = device_fit(cm, plan)  # None on a CPU profile
    print(f"recipe {recipe_named(args.recipe).describe()}")
    print(report(plan, profile, est, fit))
    if fit is not None:
        print(reserved_report(plan, cm, fit))
    return 0


def _ms(seconds: float) -> str:
    return format_duration(seconds)


def _time_lines(t, step: str) -> list[str]:
    """Where the step goes, in parts that add up: compute + exposed communication + optimizer, the exposed part
    by what it is (cost/types.py [Note: The parts of exposed communication]), and FSDP's collectives on their
    own stream, exposed (waited for) or hidden under compute."""
    from shard_planner.cost.types import ExposedParts

    parts = t.exposed_parts()
    named = [f"{name} {_ms(getattr(parts, field))}" for field, name in ExposedParts.NAMES
             if field == "wait_s" or getattr(parts, field) > 0]
    return [f"{step} time: {_ms(t.step_time_s)} = compute {_ms(t.compute_s)} + exposed communication "
            f"{_ms(t.exposed_comm_s)} + optimizer {_ms(t.optimizer_s)}",
            f"  exposed communication = {' + '.join(named)}",
            f"  FSDP collectives: {_ms(t.fsdp_comm_s)} on their stream, {_ms(min(parts.wait_s, t.fsdp_comm_s))} of it "
            f"waited for (above), {_ms(max(0.0, t.fsdp_comm_s - parts.wait_s))} hidden under compute"]


def report(plan: Plan, profile, est, fit=None) -> str:
    """The estimate in words. ``fit``: the plan on a GPU (cost/fits.py ``FitVerdict``), which decides whether it
    fits there; None on a CPU profile, where the allocated peak against the usable budget does."""
    mem, t = est.memory, est.time
    tr = plan.training
    rank = profile.rank_word  # "GPU", "CPU rank" on a CPU profile
    accumulation = plan.accumulation_words(rank)
    budget = profile.tensor_budget_bytes(plan.cluster.mem_budget_bytes)
    within = mem.peak_bytes <= budget
    if fit is not None:  # on a GPU the allocated peak is the search's filter; what fits is the allocator's verdict
        fits = f"{'within' if within else 'OVER'} the search's budget, allocated, of"
    else:
        fits = "fits in" if within else "DOES NOT FIT in"
    lines = [
        f"plan: {len(plan.units)} units, {plan.mesh.describe(rank)}, "
        f"micro-batch {tr.micro_batch}, {tr.optimizer}, params {tr.numerics.compute_dtype} / reduce {tr.numerics.reduce_scatter_dtype}"
        f"{', CPU offload' if tr.cpu_offload else ''}; profile {profile.name}"
        f"{'; compute from measured module times' if profile.module_timings is not None else ''}"
        f"{'; ' + accumulation if accumulation else ''}",
        f"peak memory per {rank}: {format_bytes(mem.peak_bytes)} at \"{mem.peak_event}\" — {fits} "
        f"{format_bytes(budget)} ({profile.usable_reason(plan.cluster.mem_budget_bytes)})",
    ]
    for cat in MEMORY_CATEGORIES:
        v = mem.memory_at_peak.get(cat, 0)
        share = 100 * v / mem.peak_bytes if mem.peak_bytes else 0.0
        lines.append(f"  {cat:18s} {format_bytes(v):>12s}  {share:5.1f}%")
    lines += _time_lines(t, "optimizer step" if tr.accumulation_steps > 1 else "step")
    predicted = fit.priced(est.prediction()) if fit is not None else est.prediction()  # retries priced in
    if fit is not None and fit.retry_s > 0:
        lines.append(f"  + the CUDA caching allocator's {fit.retries_per_step} retries per step on --mem: "
                     f"{fit.retry_price.describe()}: {_ms(predicted.step_time_s)} per step")
    lines.append(f"throughput: {predicted.throughput_text} over {plan.mesh.world_size} {rank}s, "
                 f"MFU {100 * (predicted.mfu or 0.0):.1f}%")
    return "\n".join(lines)


def reserved_report(plan: Plan, cm, fit) -> str:
    """What the CUDA caching allocator would reserve for the plan's first two steps (cost/reserved.py), whether
    the step survives a GPU of ``--mem`` in the plan's allocator mode (``fit``: cost/fits.py, the margin
    included), and the same figures in the other mode."""
    from shard_planner.cost.fits import allocator_figures_text, device_fit

    other = not fit.expandable_segments
    alt = device_fit(cm, plan, expandable_segments=other)
    return "\n".join([
        f"on the GPU, as planned: {fit.describe()}",
        f"  with {mode_name(other)} instead: {alt.verdict()}; " + allocator_figures_text(
            alt.reserved_peak_total_bytes, alt.no_retry_total_bytes, other)])
