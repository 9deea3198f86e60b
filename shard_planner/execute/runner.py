"""``run_plan``: run a plan with real FSDP2 on local ranks and return what was measured."""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import replace
from pathlib import Path

from shard_planner.errors import RunError
from shard_planner.execute.launch import LaunchResult, launch_local, resolve_device, resolve_model_path
from shard_planner.measurement import Measurement, measurement_path_for, save_measurement
from shard_planner.plan import Plan, load_plan, save_plan

logger = logging.getLogger(__name__)


def _check_world(world_size: int, device: str) -> None:
    if world_size < 1:
        raise RunError(f"--world-size must be at least 1, got {world_size}")
    if device == "cuda":
        import torch

        available = torch.cuda.device_count()
        if world_size > available:
            raise RunError(f"the run needs {world_size} GPUs on this machine but it has {available}; "
                           "use --world-size, --device cpu, or torchrun across nodes")


def launch_plans(plans: list[Plan], *, world_size: int | None = None, steps: int = 5, warmup: int = 2,
                 timeout_s: float = 300.0, device: str = "auto",
                 plan_paths: list[str | os.PathLike | None] | None = None) -> LaunchResult:
    """Run several plans in turn in one world (one launch: faster than one world each); returns their
    measurements and the ranks' process ids (all ended when it returns). ``plan_paths``: where each plan
    was read from, to find a model file given relative to it."""
    if not plans:
        raise RunError("no plan to run")
    if steps < 1 or warmup < 0:
        raise RunError(f"--steps must be >= 1 and --warmup >= 0, got {steps} and {warmup}")
    if timeout_s <= 0:
        raise RunError(f"--timeout must be positive, got {timeout_s:g}")
    device = resolve_device(device)
    world_size = plans[0].mesh.world_size if world_size is None else world_size
    _check_world(world_size, device)
    plan_paths = plan_paths or [None] * len(plans)
    with tempfile.TemporaryDirectory(prefix="shard-planner-plan-") as tmp:
        paths = []
        for i, (plan, source) in enumerate(zip(plans, plan_paths)):
            model = replace(plan.model, path=resolve_model_path(plan, source))
            paths.append(Path(tmp) / f"plan-{i}.json")
            save_plan(replace(plan, model=model), paths[-1])
        result = launch_local(paths, world_size=world_size, steps=steps, warmup=warmup, device=device,
                              timeout_s=timeout_s)
    # The ranks read an absolute model path; record the plan's own.
    return replace(result, measurements=tuple(
        replace(m, model_path=p.model.path) for m, p in zip(result.measurements, plans)))


def run_plan(plan: Plan, *, world_size: int | None = None, steps: int = 5, warmup: int = 2,
             timeout_s: float = 300.0, device: str = "auto") -> Measurement:
    """Train ``plan`` for ``warmup + steps`` steps on ``world_size`` local ranks (default: the plan's;
    another size re-derives the plan with ``Plan.with_world_size``) and measure peak memory per rank and
    step time. ``device``: "cpu" (gloo), "cuda" (NCCL) or "auto". Raises :class:`RunError` naming the
    rank and the cause when a rank fails, runs out of memory or hangs past ``timeout_s``."""
    return launch_plans([plan], world_size=world_size, steps=steps, warmup=warmup, timeout_s=timeout_s,
                        device=device).measurements[0]


def run_plans(plans: list[Plan], **kwargs) -> list[Measurement]:
    """:func:`run_plan` for several plans of the same world size, in one launch."""
    return list(launch_plans(plans, **kwargs).measurements)


def run_plan_file(plan_path: str | os.PathLike, *, out: str | os.PathLike | None = None,
                  **kwargs) -> tuple[Measurement, Path]:
    """Run the plan in ``plan_path`` and write the measurement (default: measurement.json beside the
    plan), atomically; nothing is written when the run fails."""
    plan = load_plan(plan_path)
    measurement = launch_plans([plan], plan_paths=[plan_path], **kwargs).measurements[0]
    out_path = Path(out) if out is not None else measurement_path_for(plan_path)
    save_measurement(measurement, out_path)
    return measurement, out_path
