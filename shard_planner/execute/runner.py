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
from shard_planner.plan import Plan, Prediction, load_plan, save_plan

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


def reestimate(plan: Plan, model_path: str) -> Prediction | None:
    """The cost model's prediction for ``plan`` (e.g. re-derived for fewer ranks), or None when the cost
    model is not available or cannot estimate it (logged)."""
    try:
        from shard_planner.cost import estimate
        from shard_planner.profile import load_profile
        from shard_planner.trace import trace_model
    except ImportError:
        return None
    try:
        return estimate(trace_model(model_path), plan, load_profile(plan.cluster.profile)).prediction()
    except Exception as exc:  # an estimate is a bonus: the run goes on without it
        logger.warning("could not re-estimate the plan for %d ranks: %s: %s", plan.mesh.world_size,
                       type(exc).__name__, exc)
        return None


def launch_plans(plans: list[Plan], *, world_size: int | None = None, steps: int = 5, warmup: int = 2,
                 timeout_s: float = 300.0, device: str = "auto",
                 plan_paths: list[str | os.PathLike | None] | None = None,
                 reestimate_rederived: bool = False) -> LaunchResult:
    """Run several plans in turn in one world (one launch: faster than one world each); returns their
    measurements and the ranks' process ids (all ended when it returns). ``plan_paths``: where each plan
    was read from, to find a model file given relative to it. A plan for another world size is
    re-derived (``Plan.with_world_size``, recorded in ``rederived_from_world_size``); its prediction is
    dropped, or re-estimated with the cost model when ``reestimate_rederived``."""
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
    runs = []  # (plan as run, the world size it was re-derived from or None)
    for plan, source in zip(plans, plan_paths):
        run = replace(plan, model=replace(plan.model, path=resolve_model_path(plan, source)))
        if run.mesh.world_size != world_size:
            run = run.with_world_size(world_size)
            if reestimate_rederived:
                run = replace(run, predicted=reestimate(run, run.model.path))
        runs.append((run, plan.mesh.world_size if plan.mesh.world_size != world_size else None))
    with tempfile.TemporaryDirectory(prefix="shard-planner-plan-") as tmp:
        paths = []
        for i, (run, _) in enumerate(runs):
            paths.append(Path(tmp) / f"plan-{i}.json")
            save_plan(run, paths[-1])
        result = launch_local(paths, world_size=world_size, steps=steps, warmup=warmup, device=device,
                              timeout_s=timeout_s)
    # The ranks read an absolute model path and the re-derived plan; record the plan's own path and size.
    return replace(result, measurements=tuple(
        replace(m, model_path=p.model.path, rederived_from_world_size=r[1])
        for m, p, r in zip(result.measurements, plans, runs)))


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
