"""The planner's words: plans in one line or a few (:func:`describe_choice`, :func:`summarize_units`),
the budget in words, and the infeasibility answer (:func:`infeasible_error`)."""

from __future__ import annotations

import re

from shard_planner.plan.checkpointing import USE_CACHE_FIX
from shard_planner.errors import InfeasibleError
from shard_planner.plan import Unit
from shard_planner.plan.engine import SINGLE
from shard_planner.hardware.profile import HardwareProfile
from shard_planner.solve.choice import GlobalChoice
from shard_planner.solve.space import checkpointing_allowed
from shard_planner.units import format_bytes


def describe_choice(units: tuple[Unit, ...], choice: GlobalChoice) -> str:
    """One line: units in compressed form and the global choices."""
    return f"{summarize_units(units, max_lines=3, sep='; ', sharded=choice.engine != SINGLE)}; {choice.label}"


def summarize_units(units: tuple[Unit, ...], *, max_lines: int = 8, sep: str | None = None, sharded: bool = True):
    """Units compressed: runs of consecutive units with the same decisions and the same shape of name
    become one line, e.g. ``layers.0..31: 32 units, reshard True, no AC``. A list of lines, or one
    string joined by ``sep``. ``sharded`` False: a single-device plan's (plan/engine.py), whose units are only
    regions checkpointed or not (``layers.0..31: 32 regions, AC``), the root's reshard unsaid."""
    word = "unit" if sharded else "region"

    def key(u: Unit):
        shape = tuple(re.sub(r"\d+", "#", m) for m in u.modules)
        return shape, u.reshard_after_forward, u.activation_checkpoint

    runs: list[list[Unit]] = []
    for u in units:
        if u.is_root:
            continue
        if runs and key(runs[-1][-1]) == key(u):
            runs[-1].append(u)
        else:
            runs.append([u])
    lines = []
    for run in runs:
        first, last = run[0], run[-1]
        name = first.name if len(run) == 1 else f"{first.modules[0]}..{last.modules[-1]}"
        size = f"{len(run)} {word}{'s' if len(run) > 1 else ''}"
        if len(first.modules) > 1:
            size += f" of {len(first.modules)} modules"
        r = first.reshard_after_forward
        ac = {"selective": "selective AC", True: "AC"}.get(first.activation_checkpoint, "no AC")
        lines.append(f"{name}: {size}, reshard {r}, {ac}" if sharded else f"{name}: {size}, {ac}")
    root = next((u for u in units if u.is_root), None)
    if root is not None and sharded:
        lines.append(f"<root>: reshard {root.reshard_after_forward}")
    if len(lines) > max_lines:
        lines = lines[:max_lines - 1] + [f"... {len(lines) - max_lines + 1} more runs"]
    return sep.join(lines) if sep is not None else lines


def infeasible_error(ctx, micro_batch: int, smallest: list) -> InfeasibleError:
    """The smallest budget any plan in the space needs (by the simulators; larger than the asked
    budget, else that plan would have been returned), that plan, and what dominates memory there."""
    fits = budget_text(ctx.profile, ctx.cluster.mem_budget_bytes)
    best = min(smallest, key=lambda c: c.peak_bytes, default=None)
    if best is None:
        return InfeasibleError(f"no plan fits {fits} and the solver found no plan at all")
    at_peak = best.estimate.memory.memory_at_peak
    # What dominates among what a plan can change; the profile's fixed overhead (CUDA context, NCCL,
    # allocator reserve) only when it alone fills the budget, since no plan can shrink it.
    changeable = [k for k in at_peak if k != "overhead"]
    fixed_bytes = at_peak.get("overhead", 0)
    top = "overhead" if fixed_bytes >= ctx.budget_bytes or not changeable else max(changeable, key=at_peak.get)
    advice = {
        "activations": (f"try --batch-size {max(1, micro_batch // 2)}" if micro_batch > 1 else "add GPUs") + (
            "" if any(u.activation_checkpoint for u in best.units) else
            " or allow checkpointing" if checkpointing_allowed(ctx.trace) else f" or {USE_CACHE_FIX} to allow checkpointing"),
        "temporaries": f"try --batch-size {max(1, micro_batch // 2)}" if micro_batch > 1 else "add GPUs",
        "sharded_params": "add GPUs (sharded state divides by the shard group)",
        "optimizer_states": "add GPUs or use a lighter optimizer (sgd keeps no states)",
        "grads": "add GPUs",
        "unsharded_params": "add GPUs or split the largest unit",
        "comm_buffers": "lower the prefetch depth or split the largest unit",
        "overhead": "the profile's fixed overhead (context, NCCL, allocator reserve) alone exceeds the budget: "
                    "raise --mem or use a profile that matches your device",
    }.get(top, "add GPUs")
    if ctx.engine == SINGLE and ctx.profile.device != "cpu":  # FSDP2's CPU offload holds state on the host
        advice += "; or --engine fsdp2, whose CPU offload holds the parameters and optimizer states on the host"
    need = ctx.mem_needed(best)
    over = (f", more than the {format_bytes(ctx.profile.memory_bytes)} of a {ctx.profile.name} device"
            if need > ctx.profile.memory_bytes else "")
    return InfeasibleError(
        f"no plan fits {fits}; the smallest budget any plan needs is {format_bytes(need)} (peak "
        f"{format_bytes(best.peak_bytes)}{over}; {describe_choice(best.units, best.choice)}); at its peak "
        f"{top.replace('_', ' ')} take {format_bytes(at_peak[top])} at micro-batch {micro_batch}: {advice}"
    )


def budget_text(profile: HardwareProfile, mem_budget_bytes: int) -> str:
    """The budget in words, both numbers: '40.00 GiB per GPU (37.88 GiB of allocated peak at most: --mem less
    the 5.3% margin of the allocator simulation, profile h100-80gb)'."""
    given = min(mem_budget_bytes, profile.memory_bytes)
    usable = profile.tensor_budget_bytes(mem_budget_bytes)
    if usable == given:
        return f"{format_bytes(given)} per GPU"
    return (f"{format_bytes(given)} per GPU ({format_bytes(usable)} of allocated peak at most: "
            f"{profile.usable_reason(mem_budget_bytes)}, profile {profile.name})")