"""``shard-planner plan model.py --gpus 8 --mem 40GB``: the fastest FSDP2 plan that fits, written to
plan.json (with the frontier and the recipes, shard_planner/plan/recipes.py), a terminal summary, and a report."""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from shard_planner.hardware.allocator_conf import planned_expandable
from shard_planner.cli.args import (add_batch_search, add_dtype, add_engine, add_gpus, add_gpus_per_node, add_hf_arguments, add_mem,
                                    add_model_argument, add_output, add_profile, add_report_arguments, add_time_limit,
                                    add_timings, add_tp_arguments, hf_options, param_dtype, report_dir)
from shard_planner.cli.background import Helper, HelperDied, helper_process
from shard_planner.cli.collector import command_collector, without_collections
from shard_planner.cli.plan_degrees import DegreeWork, degrees_to_search, load_and_trace, model_cache_key
from shard_planner.errors import ModelFileError, UserError
from shard_planner.fileio import check_output_dir, check_output_file
from shard_planner.model.hf import as_planned
from shard_planner.plan import Plan, save_plan, with_paths_located
from shard_planner.plan.loss import DESCRIPTIONS as LOSS_DESCRIPTIONS, MODEL
from shard_planner.plan.points import layout_lines
from shard_planner.plan.engine import DESCRIPTIONS, PARAMETERS, SINGLE
from shard_planner.hardware.profile import DEFAULT_PROFILE, load_priced_profile, ranks_text
from shard_planner.units import format_bytes

if TYPE_CHECKING:  # the planner (torch, CP-SAT) is imported when the command runs, not to build the parser
    from shard_planner.solve.request import PlanResult

logger = logging.getLogger(__name__)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="find the fastest FSDP2 plan that fits a per-GPU memory budget",
        description="Trace the model, search wrap boundaries, reshard and checkpointing per unit, prefetch "
        "depth, mesh and micro-batch with CP-SAT, check every answer with the cost model's simulators, and "
        "write plan.json with the memory-vs-time frontier and the recipes people run (torchtitan, torchtune, "
        "Accelerate, ZeRO-2-like, full AC) beside it; the answer is never slower than a recipe that fits.",
    )
    add_model_argument(p)
    add_hf_arguments(p)
    add_gpus(p)
    add_mem(p)
    add_profile(p, default=DEFAULT_PROFILE, default_text=DEFAULT_PROFILE)
    add_timings(p)
    add_gpus_per_node(p)
    add_batch_search(p)
    add_tp_arguments(p, tp_default=None, tp_help="default: on a GPU profile each of 1, 2, 4, 8 that divides the "
                     "GPUs per node is screened and the promising ones searched; on a CPU profile 1 (gloo's timing "
                     "says nothing of tensor parallelism)")
    add_dtype(p)
    add_engine(p)
    add_output(p, what="plan", default="plan.json")
    add_time_limit(p)
    add_report_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    # The helper process traces beside the planner's imports and renders figures beside the command's
    # (see cli/background.py); it ends with the command.
    # A second helper derives and traces the tensor-parallel degrees (cli/plan_degrees.py [Note: Two helpers
    # for the degrees]). For the collector, see [Note: the collector during a command].
    t0 = time.perf_counter()
    with command_collector():
        imported = _traced_before(args)
        if imported:  # [Note: Importing before the helpers fork]
            with without_collections():
                _import_planner()
        with helper_process() as helper, helper_process() as second:
            return _run(args, helper, second, t0, imported)


# [Note: Importing before the helpers fork]
# The helpers are forked before anything is imported so that the trace (torch, ~2 s) runs beside this
# process's imports (cli/background.py). When the trace cache holds the model's trace there is no trace to
# overlap: the helpers only screen, search and render, and each would import the planner itself (CP-SAT,
# numpy, pandas: ~0.5 CPU-s each, three processes on two cores). Then this process imports the planner once,
# before forking, and the helpers inherit it (README's 8B plan, warm, idle 2 cores: 5.29 -> 3.89 s, 8.89 ->
# 6.21 CPU-s). The report (matplotlib and a first figure: ~0.35 s) is not imported before the fork: the
# helper that renders half the figures imports it as its first call, beside the screens, and this process
# imports it while it waits for the searches beside its own (solve/layout_search.py ``while_waiting``), a
# time it otherwise sits idle (warm, 2 cores: 8B 3.44 -> 3.13 s, 70B 6.14 -> 5.94 s; benchmarks/
# bench_planner_speed.py, reports/benchmarks/planner_speed.md). What is imported must not import torch
# (cli/background.py forks no helper from a process that has; tests/cli/test_plan_trace_cache.py checks it);
# numpy starts OpenBLAS's thread pool, which OpenBLAS itself shuts down and restarts around a fork (its
# pthread_atfork handlers).
def _traced_before(args: argparse.Namespace) -> bool:
    """Whether the trace cache holds the model's trace at degree 1 (cli/plan_degrees.py ``load_and_trace``)."""
    from shard_planner.trace.trace_cache import holds

    try:
        return holds(model_cache_key(args.model, hf_options(args), param_dtype(args)))
    except Exception:  # noqa: BLE001 (a bad argument, an unreadable folder: _run says so in one line, or traces)
        return False


def _import_planner() -> None:
    """Import what planning imports (the planner and CP-SAT)."""
    import shard_planner.solve.layout_search  # noqa: F401


def _run(args: argparse.Namespace, helper: Helper, second: Helper, t0: float, imported: bool) -> int:
    """The command, with the helpers forked; ``t0`` when it started, ``imported``: whether the planner was
    imported before the helpers forked ([Note: Importing before the helpers fork])."""
    check_output_file(args.output, "plan")
    if args.report:
        check_output_dir(report_dir(args), "report")
    dtype = param_dtype(args)
    tracing = helper.submit(_load_and_trace, args.model, hf_options(args), dtype)
    profile = load_priced_profile(args.profile, args.timings)  # light; which degrees to search depends on it
    profile.check_compute_dtype(dtype)  # before the trace's result is waited for
    degrees = degrees_to_search(args, args.gpus_per_node or profile.interconnect.gpus_per_node, profile.device)
    degree_work = DegreeWork.start(args, hf_options(args), dtype, degrees, second)
    if args.report:  # after the trace if there is one, while the styles are derived or this process plans
        helper.submit(_import_report)
    with without_collections():
        from shard_planner.solve import PlanRequest
        from shard_planner.solve.request import requested_micro_batch
        from shard_planner.trace.files import trace_model_file

        if args.report and not imported:
            _import_report()
        import_s = time.perf_counter() - t0
        try:
            trace, defaults, finetune, trace_s = tracing.result()
        except HelperDied as exc:
            raise ModelFileError(f"{args.model}: the process tracing it {exc.ended}: does the model file call exit() "
                                 "or crash?") from exc
    # A plan made from a trace.json records the trace's model file (never the trace), and uses the TRAINING
    # defaults the trace carries from it.
    model_path = args.model if defaults is not None else trace_model_file(trace, args.model)
    defaults = defaults if defaults is not None else _trace_defaults(trace)
    global_batch = args.global_batch or args.global_batch_tokens
    req = PlanRequest(gpus=args.gpus, mem_budget_bytes=args.mem, profile=profile,
                      gpus_per_node=args.gpus_per_node or profile.interconnect.gpus_per_node,
                      micro_batch=requested_micro_batch(args.micro_batch, defaults.micro_batch, search_batch=args.search_batch,
                                                        global_batch=global_batch is not None),
                      search_batch=args.search_batch, optimizer=defaults.optimizer, lr=defaults.lr, param_dtype=dtype,
                      time_limit_s=args.time_limit, model_path=model_path, profile_name=args.profile,
                      timings_path=args.timings, global_batch_samples=args.global_batch,
                      global_batch_tokens=args.global_batch_tokens, expandable_segments=planned_expandable(os.environ),
                      engine=args.engine, optimizer_in_backward=args.optimizer_in_backward)
    while_waiting = _import_report if args.report else None  # [Note: Importing before the helpers fork]
    with without_collections():  # the search's memos stay until the report ([Note: the collector during a command])
        result = degree_work.plan(trace, req, helper, while_waiting)
    result = replace(result, plan=with_paths_located(result.plan, args.output))
    result = replace(result, plan=as_planned(result.plan, args.hf_task, finetune))  # run and export rebuild it so
    save_plan(result.plan, args.output)
    print(summary(result, profile))
    print(f"wrote {args.output}")
    report_s = None
    if args.report:
        t1 = time.perf_counter()
        with without_collections():
            out = _write_report(result, report_dir(args), degree_work.trace_of(result.plan), profile, helper)
        report_s = time.perf_counter() - t1
        if out is not None:
            print(f"report: {out}")
    print(f"time: {time_line(result, trace_s, report_s, import_s, helper.forked, imported)}")
    return 0


def time_line(result: PlanResult, trace_s: float | None, report_s: float | None, import_s: float | None = None,
              traced_beside: bool = False, imported_before: bool = False) -> str:
    """Where the time went, in one line: importing the planner (torch, CP-SAT; matplotlib too when there
    is a report), trace, the planner's stages, the report. ``traced_beside``: the helper process was forked,
    so the trace ran there, at the same time as the imports (cli/background.py; its time then includes its
    own imports) unless the planner was imported before the fork (``imported_before``: the trace was in the
    trace cache, [Note: Importing before the helpers fork])."""
    t = result.timings
    where = (" (in the helper process, beside the imports)" if not imported_before
             else " (from the trace cache, in the helper process)") if traced_beside else ""
    parts = ([f"imports {import_s:.2f} s"] if import_s is not None else []) + (
        [f"trace {trace_s:.2f} s{where}"] if trace_s is not None else []) + [
        f"screen {t.screen_s:.2f} s", f"solve {t.solve_s:.2f} s", f"frontier {t.frontier_s:.2f} s",
        f"baselines {t.baselines_s:.2f} s", f"polish {t.polish_s:.2f} s", f"simplify {t.simplify_s:.2f} s",
    ] + ([f"report {report_s:.2f} s"] if report_s is not None else [])
    degrees = (f"; tensor-parallel degrees: {t.layouts_screened} screened ({t.layout_screen_s:.2f} s of it in this "
               f"process), {t.layouts_searched} searched in full (the stages above: the chosen one's search"
               + (", the others beside it in the helper process)" if traced_beside and t.layouts_searched > 1
                  else ")")) if t.layouts_screened else ""
    return (", ".join(parts) + f" (CP-SAT {t.cpsat_s:.2f} s in {t.cpsat_solves} solves, simulators "
            f"{t.simulate_s:.2f} s for {t.simulated_plans} plans, hints {t.hints_s:.2f} s)" + degrees)


def _load_and_trace(model: str, hf, dtype: str):
    """(trace, the model file's TRAINING defaults or None for a trace.json, a transformers config's fine-tune
    with its LoRA targets named or None, seconds): the model argument loaded (imports included) and traced, or
    a trace.json read."""
    t0 = time.perf_counter()
    with without_collections():
        from shard_planner.model.modelfile import is_trace_file

        if is_trace_file(model):
            from shard_planner.trace import trace_or_load

            return trace_or_load(model, dtype=dtype), None, None, time.perf_counter() - t0
        trace, defaults, finetune = load_and_trace(model, hf, dtype)  # the trace cache's when it holds it
    return trace, defaults, finetune, time.perf_counter() - t0


_report_imported = False  # whether _import_report ran in this process (a forked helper inherits it)


def _import_report() -> None:
    """Import the report (matplotlib) ahead of time and render one small figure (font caches), while
    something else runs (once per process); :func:`_write_report` says when the report is missing."""
    global _report_imported
    if _report_imported:
        return
    _report_imported = True
    try:
        from matplotlib.figure import Figure

        from shard_planner.report.plots import figure_png
    except ImportError:
        return
    fig = Figure(figsize=(1, 1))
    fig.subplots().set_title("0.5 GiB")
    figure_png(fig, dpi=20)


def _write_report(result: PlanResult, out_dir: Path, trace, profile, helper: Helper):
    """The report of the plan as saved, drawn by the code ``shard-planner report plan.json`` runs (write_report)
    from the planner's trace at the chosen degree (``trace``: report/__init__.py [Note: One rank's trace]) and
    estimate, half its figures rendered in the helper."""
    _import_report()  # here unless it was while the searches ran
    try:
        from shard_planner.report import write_report
        from shard_planner.report.plots import figures_png
    except ImportError:
        logger.warning("the report module is not available: skipping the report")
        return None

    def render(figures: dict) -> dict[str, bytes]:
        """The first half of the figures here, the rest in the helper at the same time."""
        names = list(figures)
        half = (len(names) + 1) // 2
        t0 = time.perf_counter()
        theirs = helper.submit(figures_png, {n: figures[n] for n in names[half:]})
        mine = figures_png({n: figures[n] for n in names[:half]})
        t1 = time.perf_counter()
        pngs = {**mine, **theirs.result()}
        logger.debug("figures: %s rendered here in %.2f s, %s in the %s (%.2f s more)", names[:half], t1 - t0,
                     names[half:], "helper" if helper.forked else "same process", time.perf_counter() - t1)
        return pngs

    return write_report(result.plan, out_dir, trace=trace, profile=profile, estimate=result.estimate,
                        render=render)


def _trace_defaults(trace):
    """The TRAINING defaults a trace.json carries (ModelTrace.training), as a model file's."""
    from shard_planner.model.modelfile import TrainingDefaults

    return TrainingDefaults.of(trace.training)


def summary(result: PlanResult | Plan, profile) -> str:
    """The chosen plan in a few lines, predicted peak vs budget, step time and throughput, and how it
    compares with the best recipe that fits (shard_planner/plan/recipes.py; and, when the planner preferred a simpler
    plan, what that costs against the fastest it found)."""
    from shard_planner.solve import summarize_units

    plan = result if isinstance(result, Plan) else result.plan
    pr = plan.predicted
    budget = profile.tensor_budget_bytes(plan.cluster.mem_budget_bytes)
    tr = plan.training
    finetune = f" ({plan.model.finetune.text})" if plan.model.finetune is not None else ""
    rank = profile.rank_word  # "GPU", "CPU rank" on a CPU profile
    single = plan.engine == SINGLE
    if single:  # plan/engine.py: no sharding, no prefetch; the units are only checkpointed regions or not
        checkpointed = sum(1 for u in plan.units if u.activation_checkpoint)
        lines = [f"plan for {plan.model.path}{finetune}: {DESCRIPTIONS[SINGLE]} on one {rank}, every parameter in "
                 f"{tr.stored_dtype}, {checkpointed} of {len(plan.units) - 1} regions checkpointed, "
                 f"micro-batch {tr.micro_batch}{', optimizer stepped in backward' if tr.optimizer_in_backward else ''}"]
    else:
        lines = [f"plan for {plan.model.path}{finetune}: {len(plan.units)} FSDP units, {plan.mesh.describe(rank)}, "
                 f"micro-batch {tr.micro_batch}, "
                 f"prefetch forward {plan.prefetch.forward} / backward {plan.prefetch.backward}"
                 f"{', CPU offload' if tr.cpu_offload else ''}"]
        if plan.cluster.gpus == 1:
            compute = tr.numerics.compute_dtype
            why = ("for its CPU offload: no plan fits the device without it" if tr.cpu_offload else
                   f"the parameters train as the model builds them, gathered in {compute} (MixedPrecisionPolicy: "
                   f"master weights where they are stored wider); --engine single trains plain PyTorch instead, "
                   f"every parameter cast to {compute}")
            lines.append(f"  FSDP2 on one {rank}: {why}")
    if plan.model.loss not in (None, MODEL):  # model/loss.py
        lines.append(f"  loss: {LOSS_DESCRIPTIONS[plan.model.loss]}")
    accumulation = plan.accumulation_words(rank)
    if accumulation:
        lines.append(f"  {accumulation}")
    lines += [f"  {line}" for line in summarize_units(plan.units, sharded=not single)]
    lines.append(f"predicted peak {format_bytes(pr.peak_bytes)} per {rank} of {format_bytes(budget)} usable "
                 f"({100 * pr.peak_bytes / budget:.0f}%; {profile.usable_reason(plan.cluster.mem_budget_bytes)}), "
                 "at the peak: " + ", ".join(
                     f"{PARAMETERS[plan.engine] if k == 'sharded_params' else k.replace('_', ' ')} {format_bytes(v)}"
                     for k, v in sorted(
                         pr.memory_at_peak.items(), key=lambda kv: -kv[1])[:3]))
    device_line = _device_line(getattr(result, "fit", None), plan)  # a Plan has none
    if device_line:
        lines.append(device_line)
    mfu = f", MFU {100 * pr.mfu:.0f}%" if pr.mfu else ""
    priced = f" (compute from measured module times, {plan.cluster.timings})" if plan.cluster.timings else ""
    step = "optimizer step" if tr.accumulation_steps > 1 else "step"
    ranks = ranks_text(profile.device, plan.cluster.gpus)  # "8 GPUs", "1 CPU rank"
    lines.append(f"predicted {step} {pr.step_time_s * 1e3:.1f} ms, {pr.throughput_text} on {ranks}{mfu}{priced}")
    if plan.layouts:
        lines.append("layouts searched (the fastest plan of each):")
        lines += [f"  {line}" for line in layout_lines(plan.mesh.split, plan.layouts)]
    fitting = [b for b in plan.baselines if b.fits]
    if fitting:
        best = min(fitting, key=lambda b: b.step_time_s)
        gain = best.step_time_s / pr.step_time_s - 1
        lines.append(f"vs best recipe that fits ({best.description}: {best.step_time_s * 1e3:.1f} ms, "
                     f"{format_bytes(best.peak_bytes)}): {100 * gain:+.1f}% throughput")
    elif plan.baselines:
        lines.append("no recipe fits this budget: " + ", ".join(
            f"{b.description} needs {format_bytes(b.peak_bytes)}" for b in plan.baselines[:3]))
    s = plan.solver
    lines.append(f"solver: {s.method}, {s.status}, {s.seconds:.1f} s; frontier of {len(plan.frontier)} plans in the file")
    return "\n".join(lines)


def _device_line(fit, plan: Plan) -> str | None:
    """On a GPU: the plan's fit through the simulated caching allocator (cost/fits.py), from the planner's
    verdict, else from the figures the plan file keeps (None: a CPU plan, or one written before them)."""
    from shard_planner.cost.fits import allocator_figures_text

    if fit is not None:
        return f"on the GPU: {fit.describe()}"
    pr = plan.predicted
    if pr.reserved_peak_bytes is None:
        return None
    return (f"on the GPU (CUDA caching allocator, simulated): {pr.retries_text()}; " + allocator_figures_text(
        pr.reserved_peak_bytes, pr.no_retry_bytes, plan.cluster.expandable_segments))
