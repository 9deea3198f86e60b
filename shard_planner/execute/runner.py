"""``run_plan``: run a plan with real FSDP2 on local ranks and return what was measured."""

from __future__ import annotations

import logging
import os
import tempfile
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


def launch_plan(plan: Plan, *, world_size: int | None = None, steps: int = 5, warmup: int = 2,
                timeout_s: float = 300.0, device: str = "auto",
                plan_path: str | os.PathLike | None = None) -> LaunchResult:
    """Like :func:`run_plan`, also returning the ranks' process ids (all ended when it returns)."""
    if steps < 1 or warmup < 0:
        raise RunError(f"--steps must be >= 1 and --warmup >= 0, got {steps} and {warmup}")
    if timeout_s <= 0:
        raise RunError(f"--timeout must be positive, got {timeout_s:g}")
    device = resolve_device(device)
    world_size = plan.mesh.world_size if world_size is None else world_size
    _check_world(world_size, device)
    model_path = resolve_model_path(plan, plan_path)
    with tempfile.TemporaryDirectory(prefix="shard-planner-plan-") as tmp:
        path = Path(tmp) / "plan.json"
        save_plan(plan, path)
        return launch_local(path, world_size=world_size, steps=steps, warmup=warmup, device=device,
                            timeout_s=timeout_s, model_path=model_path)


def run_plan(plan: Plan, *, world_size: int | None = None, steps: int = 5, warmup: int = 2,
             timeout_s: float = 300.0, device: str = "auto") -> Measurement:
    """Train ``plan`` for ``warmup + steps`` steps on ``world_size`` local ranks (default: the plan's;
    fewer re-derive the plan with ``Plan.with_world_size``) and measure peak memory per rank and step
    time. ``device``: "cpu" (gloo), "cuda" (NCCL) or "auto". Raises :class:`RunError` naming the rank
    and the cause when a rank fails, runs out of memory or hangs past ``timeout_s``."""
    return launch_plan(plan, world_size=world_size, steps=steps, warmup=warmup, timeout_s=timeout_s,
                       device=device).measurement


def run_plan_file(plan_path: str | os.PathLike, *, out: str | os.PathLike | None = None,
                  **kwargs) -> tuple[Measurement, Path]:
    """Run the plan in ``plan_path`` and write the measurement (default: measurement.json beside the
    plan), atomically; nothing is written when the run fails."""
    plan = load_plan(plan_path)
    result = launch_plan(plan, plan_path=plan_path, **kwargs)
    out_path = Path(out) if out is not None else measurement_path_for(plan_path)
    save_measurement(result.measurement, out_path)
    return result.measurement, out_path
