"""``shard-planner tune``: plan, run the best few plans for real, fit the profile, return the measured best.

    result = tune_model("examples/gpt2.py", gpus=8, mem_budget_bytes=40 * 2**30, profile="cpu-gloo",
                        trials=3, world_size=2, profile_out="fitted.toml")
    result.plan            # the measured best, with plan.measurements (every run)
    result.fit.profile     # the fitted profile (also written to profile_out)

The stages: :mod:`.candidates` (top-K distinct plans), :mod:`.tuner` (rounds of runs, early stop,
choice), :mod:`.fit` (least squares of the profile's time parameters), :mod:`.profile_file` (the fitted
profile as TOML).
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import replace
from pathlib import Path

from shard_planner.errors import UserError
from shard_planner.parallel.mesh import degree_divides
from shard_planner.hardware.profile import HardwareProfile, load_profile
from shard_planner.hardware.timings import load_timings
from shard_planner.trace.tp_degrees import check_node_degree
from shard_planner.tune.candidates import Candidate, describe_plan, top_candidates
from shard_planner.tune.fit import ProfileFit, fit_profile, scale_profile
from shard_planner.tune.profile_file import write_profile
from shard_planner.tune.tuner import Skipped, Trial, TuneResult, measurement_for_report, tune

logger = logging.getLogger(__name__)

__all__ = ["Candidate", "ProfileFit", "Skipped", "Trial", "TuneResult", "check_degree", "describe_plan",
           "fit_profile", "scale_profile", "top_candidates", "tune", "tune_model", "write_fitted_profile"]


def write_fitted_profile(result: TuneResult, prior: HardwareProfile, path: str | os.PathLike,
                         model_path: str) -> None:
    """Write ``result.fit.profile`` to ``path`` (atomically) with comments saying how it was fitted."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = [
        f"Fitted by `shard-planner tune` on {stamp} from {len(result.trials)} real run(s) of {model_path} at world "
        f"size {result.world_size} ({result.best.measurement.device}, {result.best.measurement.backend}, "
        f"{result.best.measurement.device_name}).",
        "Runs: " + "; ".join(f"{i + 1}: {t.candidate.description}" for i, t in enumerate(result.trials)),
        "Factors (1 = the prior): " + ", ".join(f"{k} x{v:.4g}" for k, v in result.fit.factors.items()),
    ]
    write_profile(path, result.fit, prior, header)


def tune_model(model_path: str, *, gpus: int, mem_budget_bytes: int, profile: str | HardwareProfile = "cpu-gloo",
               trials: int = 3, world_size: int | None = None, gpus_per_node: int = 8,
               micro_batch: int | None = None, dtype: str = "bfloat16", per_launch: int | None = None,
               steps: int = 5, warmup: int = 2, timeout_s: float = 600.0, device: str = "auto", trace=None,
               profile_out: str | os.PathLike | None = None, report_dir: str | os.PathLike | None = None,
               plan_options: dict | None = None, timings: str | None = None, tp: int = 1,
               sequence_parallel: bool = True, loss_parallel: bool = True, run_plans=None,
               hf_options=None) -> TuneResult:
    """Plan ``model_path`` for ``gpus`` GPUs within ``mem_budget_bytes`` each, run the top ``trials``
    distinct plans for real (re-derived for ``world_size`` ranks when given), fit ``profile`` to what was
    measured and return the measured best (see :mod:`shard_planner.tune.tuner`). Writes the fitted profile
    to ``profile_out`` and a report into ``report_dir`` when given; the returned plan names the fitted
    profile when it was written. ``dtype`` is the mixed-precision param dtype the model is traced and
    planned in (``trace``, when given, must have been traced in it, at degree ``tp``). ``timings``: a
    module-timings file (``shard-planner calibrate --model``) that prices compute instead of FLOPs; the fit
    then moves only what the timings leave to the profile (its compute factor stays at the prior for timed
    modules). ``tp``: the tensor-parallel degree every candidate keeps, its styles derived as ``plan --tp``
    derives them (:func:`_degree_trace`). ``plan_options``: further :class:`~shard_planner.solve.PlanRequest`
    fields (``time_limit_s``, ...). ``run_plans``: runs a launch's plans (default
    :func:`shard_planner.execute.run_plans`). ``hf_options``: for a transformers config, its task, sequence
    length and fine-tune (:class:`~shard_planner.model.hf.HfOptions`), which every candidate records to be run as."""
    from shard_planner.cost import estimate
    from shard_planner.model.modelfile import load_model_file
    from shard_planner.model.hf import as_planned
    from shard_planner.solve import PlanRequest, plan_model
    from shard_planner.solve.request import requested_micro_batch
    from shard_planner.units import compute_dtype_name

    if trials < 1:
        raise UserError(f"--trials must be at least 1, got {trials}")
    prior = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
    if timings is not None:
        prior = prior.with_timings(load_timings(timings))
    model_file = load_model_file(model_path, hf_options)
    param_dtype = compute_dtype_name(dtype)
    check_degree(tp, gpus=gpus, gpus_per_node=gpus_per_node, world_size=world_size)
    trace, styles = _degree_trace(model_file, param_dtype, tp, trace, sequence_parallel=sequence_parallel,
                                  loss_parallel=loss_parallel)
    defaults, options = model_file.defaults, plan_options or {}
    global_batch = options.get("global_batch_samples") or options.get("global_batch_tokens")
    request = PlanRequest(gpus=gpus, mem_budget_bytes=mem_budget_bytes, profile=prior, gpus_per_node=gpus_per_node,
                          micro_batch=requested_micro_batch(micro_batch, defaults.micro_batch, global_batch=bool(global_batch),
                                                            search_batch=options.get("search_batch", False)),
                          optimizer=defaults.optimizer, lr=defaults.lr, param_dtype=param_dtype, model_path=model_path,
                          profile_name=profile if isinstance(profile, str) else None, timings_path=timings,
                          tensor_parallel=styles, run_ranks=world_size, **options)
    plan = plan_model(trace, request).plan
    candidates = top_candidates(trace, plan, prior, trials, estimate=estimate,
                                solve=lambda budget: plan_model(trace, replace(request, mem_budget_bytes=budget)).plan,
                                extra=recipe_plans(trace, plan))
    task = hf_options.task if hf_options is not None else None
    candidates = [replace(c, plan=as_planned(c.plan, task, model_file.finetune)) for c in candidates]
    if run_plans is None:
        from shard_planner.execute import run_plans
    result = tune(trace, candidates, prior, estimate=estimate, run_plans=run_plans, world_size=world_size,
                  per_launch=per_launch, steps=steps, warmup=warmup, timeout_s=timeout_s, device=device)
    if profile_out is not None:
        write_fitted_profile(result, prior, profile_out, model_path)
        result = _with_profile(result, str(profile_out))
    if report_dir is not None:
        from shard_planner.report import write_report

        write_report(result.plan, Path(report_dir), trace=trace, profile=result.fit.profile,
                     measurement=measurement_for_report(result))
    return result


def check_degree(tp: int, *, gpus: int, gpus_per_node: int, world_size: int | None) -> None:
    """``tp`` must divide the GPUs per node and the GPUs (tensor parallelism stays inside a node, as ``plan
    --tp`` requires), and the ranks the candidates run on, so that every run keeps the degree the trace is
    at (``Plan.with_world_size`` drops a degree that does not divide). UserError, one line, otherwise."""
    if tp < 1:
        raise UserError(f"--tp must be a positive integer, got {tp}")
    check_node_degree(tp, gpus, gpus_per_node)
    if world_size is not None and not degree_divides(tp, world_size):
        raise UserError(f"--tp {tp} must divide --world-size ({world_size}): every run keeps the plan's "
                        "tensor-parallel degree")


def _degree_trace(model_file, param_dtype: str, tp: int, trace, *, sequence_parallel: bool, loss_parallel: bool):
    """(one rank of the model traced at degree ``tp``, its styles; None at degree 1): the styles derived as
    ``plan --tp`` derives them (trace/tp_degrees.py ``degree_styles``); a degree the model's dimensions refuse is a
    UserError naming the dimension. ``trace``: given (checked to be at ``param_dtype`` and ``tp``) or None."""
    from shard_planner.trace.tp_degrees import degree_styles
    from shard_planner.trace import trace_model

    if trace is not None:
        if trace.compute_dtype != param_dtype:
            raise UserError(f"the trace given was made in {trace.compute_dtype}, but tune was asked for {param_dtype}")
        if trace.tp_size != tp:
            raise UserError(f"the trace given is one rank at tensor-parallel degree {trace.tp_size}, but tune was "
                            f"asked for --tp {tp}")
    styles = None
    if tp > 1:
        found = degree_styles(model_file, [tp], sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                              seq_len=model_file.training.get("seq_len"))
        if tp not in found.styles:
            raise UserError(f"--tp {tp}: {found.refused[0].refused}")
        styles = found.styles[tp]
    if trace is None:
        trace = trace_model(model_file, dtype=param_dtype, tensor_parallel=styles, tp_size=tp)
    return trace, styles


def recipe_plans(trace, plan) -> list[tuple]:
    """The recipes (shard_planner/plan/recipes.py) with ``plan``'s global choices and each recipe's CPU offload: its mesh
    (the tensor-parallel degree and styles too) and its shard group's ranks per node, as the solver's space
    has them (solve/context.py ``space``: a shard group's ranks are tp apart)."""
    from shard_planner.plan.recipes import recipes_for
    from shard_planner.solve.space import build_space

    space = build_space(trace, shard_group=plan.mesh.shard_group_size,
                        gpus_per_node=plan.mesh.shard_ranks_per_node(plan.cluster.gpus_per_node))
    return [(replace(plan, units=units, training=replace(plan.training, cpu_offload=r.cpu_offload)), f"recipe: {r.title}")
            for r, units in recipes_for(space, trace) if not r.cpu_offload or plan.training.cpu_offload]


def _with_profile(result: TuneResult, profile_path: str) -> TuneResult:
    plan = result.plan
    return replace(result, plan=replace(plan, cluster=replace(plan.cluster, profile=profile_path)))
