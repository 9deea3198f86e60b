"""``run_plan``: run a plan with real FSDP2 on local ranks and return what was measured."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from shard_planner.plan.checkpointing import check_checkpointing_allowed, is_selective
from shard_planner.errors import ModelFileError, RunError
from shard_planner.execute.checkpoint_dir import check_new_directory, read_side_file
from shard_planner.execute.launch import LaunchResult, launch_local, resolve_device, resolve_model_path
from shard_planner.fileio import check_output_file
from shard_planner.plan.measurement import Measurement, RestoreCheck, measurement_path_for, save_measurement
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


def _check_selective_supported(plans: list[Plan]) -> None:
    """Selective checkpointing's policy reads ``SelectiveCheckpointContext.op_output`` (execute/selective.py),
    which torch before 2.13 lacks (seen on torch 2.11: every rank failed with an AttributeError)."""
    import torch
    from torch.torch_version import TorchVersion

    if TorchVersion(torch.__version__) < (2, 13) and any(
            is_selective(u.activation_checkpoint) for p in plans for u in p.units):
        raise RunError(f"selective activation checkpointing needs torch >= 2.13 (this is {torch.__version__}): "
                       "install torch 2.13, or plan with full checkpointing only")


def _check_model_file(path: str) -> None:
    """A plan's model file given as a path (not ``package.module``) must be here: resolve_model_path
    looked in the current folder and beside the plan."""
    if path.endswith(".py") and not Path(path).is_file():
        where = "is a folder" if Path(path).is_dir() else "no such file here or beside the plan"
        raise ModelFileError(f"{path}: the plan's model file: {where}")


def _check_checkpointing_allowed(plans: list[Plan]) -> None:
    """A plan that checkpoints a model whose forward builds a cache fails in backward (selective) or
    runs what was not priced (full): refused here, in one line, before the ranks start. Only plans that
    checkpoint are asked, each model once, by one forward under fake tensors (trace/cache.py; seconds
    at 8B). See [Note: No checkpointing of a forward that builds a cache] in shard_planner/plan/checkpointing.py."""
    probed: dict[tuple, str | None] = {}
    for plan in plans:
        if not any(u.activation_checkpoint for u in plan.units):
            continue
        key = (plan.model.path, plan.model.hf_task, plan.model.seq_len, plan.model.finetune)
        if key not in probed:
            probed[key] = _probe_forward_cache(plan)
        check_checkpointing_allowed(plan.units, plan.model.path, probed[key])


def _probe_forward_cache(plan: Plan) -> str | None:
    """trace/cache.py's probe of ``plan``'s model; None (logged) when the probe itself fails: the run
    then goes on, as it did before the probe."""
    from shard_planner.model.hf import model_options
    from shard_planner.model.modelfile import load_model_file
    from shard_planner.trace.cache import probe_forward_cache

    path = plan.model.path
    model_file = load_model_file(path, model_options(plan.model))
    try:
        return probe_forward_cache(model_file)
    except Exception as exc:  # a check, not the run: the ranks report the model's own errors
        logger.warning("%s: could not check whether its forward builds a cache (%s: %s); running the plan as "
                       "given", path, type(exc).__name__, exc)
        return None


def with_prediction(measurement: Measurement, predicted: Prediction | None) -> Measurement:
    """``measurement`` with the prediction it is compared against (None: nothing to compare)."""
    return replace(
        measurement,
        predicted_peak_bytes=predicted.peak_bytes if predicted else None,
        predicted_step_time_s=predicted.step_time_s if predicted else None,
        predicted_overhead_bytes=int(predicted.memory_at_peak.get("overhead", 0)) if predicted else 0,
    )


def reestimate(plan: Plan, model_path: str, trace=None) -> Prediction | None:
    """The cost model's prediction for ``plan`` (e.g. re-derived for fewer ranks), or None when the cost
    model is not available or cannot estimate it (logged). ``trace``: the plan's one-rank trace
    (:func:`one_rank_trace`), traced here when not given."""
    try:
        from shard_planner.cost import estimate
        from shard_planner.hardware.profile import load_priced_profile
    except ImportError:
        return None
    trace = trace if trace is not None else one_rank_trace(plan, model_path)
    if trace is None:
        return None
    try:
        return estimate(trace, plan, load_priced_profile(plan.cluster.profile, plan.cluster.timings)).prediction()
    except Exception as exc:  # an estimate is a bonus: the run goes on without it
        logger.warning("could not re-estimate the plan for %d ranks: %s: %s", plan.mesh.world_size,
                       type(exc).__name__, exc)
        return None


def one_rank_trace(plan: Plan, model_path: str):
    """``plan``'s model traced as the plan computes it, one rank at its tensor-parallel degree with its styles
    (the model file's options, e.g. a transformers config's sequence length, from the plan), or None when
    the tracer is not available or fails (logged: the run's figures do not need it)."""
    try:
        from shard_planner.model.hf import model_options
        from shard_planner.model.modelfile import load_model_file
        from shard_planner.trace import trace_for_plan
    except ImportError:
        return None
    try:
        return trace_for_plan(load_model_file(model_path, model_options(plan.model, model_path)), plan)
    except Exception as exc:  # a prediction is a bonus: the run goes on without it
        logger.warning("could not trace %s for the prediction: %s: %s", model_path, type(exc).__name__, exc)
        return None


def with_run_predictions(m: Measurement, ran: Plan, model_path: str, reestimate_rederived: bool) -> Measurement:
    """``m`` (a run of ``ran``, the plan as the ranks ran it) with what the cost model predicts that needs a
    trace: a re-derived plan's prediction (when ``reestimate_rederived``) and, with tensor parallelism, its
    collectives per step (``comm_tp_predicted``, cost ``tp_collectives_per_step``). One trace serves both."""
    rederive = m.rederived and reestimate_rederived
    if not (rederive or ran.mesh.is_tp):
        return m
    trace = one_rank_trace(ran, model_path)
    if rederive:  # the prediction of the plan as the ranks re-derived it
        m = with_prediction(m, reestimate(ran, model_path, trace))
    if ran.mesh.is_tp and trace is not None:
        from shard_planner.cost import tp_collectives_per_step

        m = replace(m, comm_tp_predicted=tp_collectives_per_step(trace, ran))
    return m


def launch_plans(plans: list[Plan], *, world_size: int | None = None, steps: int = 5, warmup: int = 2,
                 timeout_s: float = 300.0, device: str = "auto",
                 plan_paths: list[str | os.PathLike | None] | None = None,
                 reestimate_rederived: bool = False, checkpoint_dir: str | None = None, checkpoint_steps: int = 2,
                 resume_from: str | None = None) -> LaunchResult:
    """Run several plans in turn in one world (one launch: faster than one world each); returns their
    measurements and the ranks' process ids (all ended when it returns). ``plan_paths``: where each plan
    was read from, to find a model file given relative to it. The ranks re-derive a plan for another
    world size (``Plan.at_world_size`` in :func:`~shard_planner.execute.worker.train_and_measure`,
    recorded in ``rederived_from_world_size``); its prediction is dropped, or re-estimated here with the
    cost model when ``reestimate_rederived``. ``checkpoint_dir``, ``checkpoint_steps``, ``resume_from``
    (one plan): see :func:`~shard_planner.execute.launch.launch_local`."""
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
    # The ranks read the model file by an absolute path (the plans they read are in a temporary folder).
    runs = [replace(plan, model=replace(plan.model, path=resolve_model_path(plan, source), relative_path=None))
            for plan, source in zip(plans, plan_paths)]
    for run in runs:  # before the ranks start (10-20 s on CPU) rather than in every rank
        _check_model_file(run.model.path)
    _check_selective_supported(runs)
    _check_checkpointing_allowed(runs)
    with tempfile.TemporaryDirectory(prefix="shard-planner-plan-") as tmp:
        paths = []
        for i, run in enumerate(runs):
            paths.append(Path(tmp) / f"plan-{i}.json")
            save_plan(run, paths[-1])
        result = launch_local(paths, world_size=world_size, steps=steps, warmup=warmup, device=device,
                              timeout_s=timeout_s, checkpoint_dir=checkpoint_dir, checkpoint_steps=checkpoint_steps,
                              resume_from=resume_from)
    measurements = []
    for m, plan, run in zip(result.measurements, plans, runs):
        m = replace(m, model_path=plan.model.path)  # the plan's own path, as given
        measurements.append(with_run_predictions(m, run.at_world_size(world_size)[0], run.model.path,
                                                 reestimate_rederived))
    return replace(result, measurements=tuple(measurements))


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
                  checkpoint: CheckpointOptions | None = None, **kwargs) -> tuple[Measurement, Path]:
    """Run the plan in ``plan_path`` and write the measurement (default: measurement.json beside the
    plan), atomically; nothing is written when the run fails or is interrupted. The output place (and
    the checkpoint folder) are checked before the ranks start. ``checkpoint``: save and restore one
    after the measured steps (:func:`_run_with_checkpoint`)."""
    plan = load_plan(plan_path)
    out_path = check_output_file(out if out is not None else measurement_path_for(plan_path), "measurement")
    if checkpoint is None:
        measurement = launch_plans([plan], plan_paths=[plan_path], **kwargs).measurements[0]
    else:
        measurement = _run_with_checkpoint(plan, plan_path, checkpoint, **kwargs)
    save_measurement(measurement, out_path)
    return measurement, out_path


@dataclass(frozen=True)
class CheckpointOptions:
    """``run --checkpoint``: where (None: a temporary folder, removed after), how many steps are compared
    after the restore, and another world size to restore at too (a second launch reading the folder)."""

    directory: str | None = None
    steps: int = 2
    reshard_to: int | None = None


def _run_with_checkpoint(plan: Plan, plan_path, options: CheckpointOptions, **kwargs) -> Measurement:
    """Run the plan; its world saves a checkpoint after the measured steps and restores it at its own size;
    then, with ``reshard_to``, a second world of that size restores the same folder. A kept folder that
    the run fails to fill is emptied again (it was new or empty); a temporary one is always removed."""
    if options.reshard_to is not None:
        ran = plan.at_world_size(kwargs["world_size"])[0] if kwargs.get("world_size") else plan
        samples = ran.mesh.dp_size * ran.training.micro_batch
        if options.reshard_to < 1 or samples % options.reshard_to:
            raise RunError(f"--checkpoint-reshard-to {options.reshard_to}: the restored run replays the global batch "
                           f"of {samples} samples cut into equal parts per rank; give a world size that divides it")
    created = options.directory is not None and not Path(options.directory).exists()
    directory = (check_new_directory(options.directory) if options.directory is not None
                 else Path(tempfile.mkdtemp(prefix="shard-planner-checkpoint-")))
    done = False
    try:
        m = launch_plans([plan], plan_paths=[plan_path], checkpoint_dir=str(directory.resolve()),
                         checkpoint_steps=options.steps, **kwargs).measurements[0]
        restores = m.checkpoint.restores
        if options.reshard_to is not None:
            other = dict(kwargs, world_size=options.reshard_to)
            restores += (launch_plans([plan], plan_paths=[plan_path], resume_from=str(directory.resolve()),
                                      **other).restore,)
        done = True
        return replace(m, checkpoint=replace(m.checkpoint, restores=restores,
                                             directory=str(directory) if options.directory is not None else None))
    finally:
        if options.directory is None or created and not done:
            shutil.rmtree(directory, ignore_errors=True)
        elif not done:  # an empty folder given: empty again
            for f in directory.iterdir():
                shutil.rmtree(f, ignore_errors=True) if f.is_dir() else f.unlink(missing_ok=True)


def restore_plan_file(plan_path: str | os.PathLike, directory: str | os.PathLike, **kwargs) -> RestoreCheck:
    """Restore the checkpoint in ``directory`` (written by ``run`` with a kept checkpoint folder) into the
    plan's model built afresh on ``world_size`` ranks (any size: DCP reshards on load), and compare every
    tensor and the next steps' losses with the run that saved it. Reads the folder, writes nothing; a
    folder that is not a complete checkpoint is refused before the ranks start."""
    plan = load_plan(plan_path)
    read_side_file(directory)
    return launch_plans([plan], plan_paths=[plan_path], resume_from=str(Path(directory).resolve()),
                        **kwargs).restore
