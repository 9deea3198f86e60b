"""HTML and Markdown for the report: a summary of the plan, then one section per plot/table."""

from __future__ import annotations

import base64
from collections import Counter
import html
from dataclasses import dataclass
from typing import Any

import pandas as pd

from shard_planner import __version__
from shard_planner.cost.fits import allocator_figures_text
from shard_planner.plan import Plan
from shard_planner.plan.loss import DESCRIPTIONS as LOSS_DESCRIPTIONS, MODEL
from shard_planner.plan.points import layout_reason
from shard_planner.report.budget import ReportBudget
from shard_planner.report.engine_words import EngineWords, engine_words
from shard_planner.report.plots import MeasuredFigures, plan_throughput, relative_error
from shard_planner.report.tables import md_escape, to_html, to_markdown
from shard_planner.trace.types import ModelTrace
from shard_planner.units import format_bytes, format_duration


@dataclass(frozen=True)
class ReportSection:
    title: str
    image: str | None  # PNG file name in the report folder; None: no picture for this section
    figure: Any  # matplotlib Figure or None
    caption: str
    table: pd.DataFrame | None = None


def _reshard_text(r: bool | int) -> str:
    return f"to {r} ranks" if not isinstance(r, bool) else ("yes" if r else "no")


def summary_lines(plan: Plan, budget: ReportBudget, measured: tuple[MeasuredFigures, tuple[int, float]] | None = None,
                  trace: ModelTrace | None = None) -> list[tuple[str, str]]:
    """(field, value) pairs that say what the plan is and what it is predicted (and measured) to do; the
    peak and the recipes judged against the usable budget (``budget``); what trains (a
    fine-tune's kind) from the plan's fine-tune or, for a model file that freezes its own, ``trace``."""
    c, t = plan.cluster, plan.training
    words = engine_words(plan)
    setup = _sharded_lines(plan, budget) if words.shards else _single_device_lines(plan, budget, words)
    lines = [
        ("model", f"{plan.model.path} (fingerprint {plan.model.fingerprint})"),
        ("cluster", f"{budget.ranks(c.gpus)}, {c.gpus_per_node} per node, profile {c.profile}; "
                    f"budget {budget.describe()}"),
        setup[0],  # the mesh
        *_trains_line(plan, trace),
        *([("loss", LOSS_DESCRIPTIONS[plan.model.loss])] if plan.model.loss not in (None, MODEL) else []),
        *_layouts_line(plan),
        *setup[1:],
    ]
    p = plan.predicted
    if p is not None:
        tp = plan_throughput(plan)
        extra = f", MFU {p.mfu:.1%}" if p.mfu is not None else ""
        lines += [
            ("predicted peak", f"{format_bytes(p.peak_bytes)} per {budget.rank_word} ({p.peak_bytes / budget.usable_bytes:.0%} of "
                               f"the {'usable ' if budget.has_usable else ''}budget, "
                               f"{format_bytes(budget.usable_bytes)})"
                               + ("" if budget.fits(p.peak_bytes) else ": DOES NOT FIT")),
            *_allocator_line(plan),
            ("predicted optimizer step" if t.accumulation_steps > 1 else "predicted step", f"{format_duration(p.step_time_s)}, {tp.of(p.step_time_s):,.0f} {tp.unit} (whole "
                               f"cluster)" + (f", exposed communication {format_duration(p.exposed_comm_s)}"
                                              if words.shards else "") + extra),
        ]
        fits = [b for b in plan.baselines if b.fits and budget.fits(b.peak_bytes)]
        if fits:
            best = min(fits, key=lambda b: b.step_time_s)
            lines.append(("vs recipes", f"{best.step_time_s / p.step_time_s:.2f}x the throughput of the best "
                                        f"recipe that fits ({best.description})"))
        elif plan.baselines:
            lines.append(("vs recipes", "no recipe fits the "
                                             f"{'usable ' if budget.has_usable else ''}budget"))
    if plan.solver is not None:
        s = plan.solver
        lines.append(("found by", f"{s.method}, {s.status}, in {s.seconds:.2f} s"))
    if measured is not None:
        m, (peak_bytes, step_time_s) = measured
        lines += [
            ("measured peak", f"{format_bytes(m.peak_bytes)} (max over {len(m.peak_bytes_per_rank)} ranks); "
                              f"prediction error {relative_error(peak_bytes, m.peak_bytes):+.1%}"),
            ("measured step", f"{format_duration(m.step_time_s)} (median of {len(m.step_time_samples_s)}); "
                              f"prediction error {relative_error(step_time_s, m.step_time_s):+.1%}"),
        ]
    return lines


def _sharded_lines(plan: Plan, budget: ReportBudget) -> list[tuple[str, str]]:
    """The summary's mesh, training, units and prefetch lines of a plan that shards (FSDP2)."""
    t, m = plan.training, plan.mesh
    mesh = f"{m.shard_group_size}-way sharding" + (f" x {m.replicate_group_size} replicas (HSDP)" if m.is_hsdp else "")
    mesh += f" x TP {m.tp} (tensor parallelism)" if m.is_tp else ""
    inner = list(plan.inner_units)
    grouped = sum(1 for u in inner if len(u.modules) > 1)
    checkpointed = sum(1 for u in inner if u.activation_checkpoint)
    reshard = [f"{_reshard_text(r)} for {n}" for r, n in Counter(u.reshard_after_forward for u in inner).most_common()]
    return [
        ("mesh", mesh),
        ("training", f"micro-batch {t.micro_batch} per {budget.rank_word}, {t.optimizer}, params in {t.numerics.compute_dtype}, "
                     f"gradients reduced in {t.numerics.reduce_scatter_dtype}" + (", CPU offload" if t.cpu_offload else "")
                     + (f"; {plan.accumulation_text}" if plan.accumulation_text else "")),
        ("units", f"{len(inner)} units + root ({grouped} grouped, {checkpointed} checkpointed); "
                  f"reshard after forward: {', '.join(reshard) or '-'}; root: {_reshard_text(plan.root.reshard_after_forward)}"),
        ("prefetch", f"forward {plan.prefetch.forward}, backward {plan.prefetch.backward} unit(s) ahead"),
    ]


def _single_device_lines(plan: Plan, budget: ReportBudget, words: EngineWords) -> list[tuple[str, str]]:
    """The summary's mesh, training and regions lines of a single-device plan (cost/engines/single.py [Note: The
    single-device step]): nothing sharded, reduced, resharded or prefetched."""
    t = plan.training
    stored = t.stored_dtype or t.numerics.compute_dtype
    regions = plan.inner_units
    checkpointed = sum(1 for u in regions if u.activation_checkpoint)
    steps = plan.accumulation_words(budget.rank_word)  # one device: "gradients added into .grad"
    return [
        ("mesh", words.description),
        ("training", f"micro-batch {t.micro_batch} per {budget.rank_word}, {t.optimizer}, every floating parameter "
                     f"cast to {stored} and trained in it, gradients and optimizer states too; no gradient "
                     "reduction" + (", CPU offload" if t.cpu_offload else "")
                     + ("; each parameter stepped in the backward as its gradient is ready, the gradient then freed"
                        if t.optimizer_in_backward else "") + (f"; {steps}" if steps else "")),
        ("regions", f"{len(regions)} regions, {checkpointed} checkpointed"),
    ]


def _trains_line(plan: Plan, trace: ModelTrace | None) -> list[tuple[str, str]]:
    """What trains: the plan's fine-tune (LoRA, QLoRA, frozen modules) with, given the trace, how many
    parameters train; for a model file that freezes its own, the count alone; every parameter otherwise
    (nothing without a trace or a fine-tune)."""
    counts = ""
    if trace is not None:
        counts = f"{trace.trainable_param_count:,} of {trace.param_count:,} parameters train" + (
            f" ({trace.trainable_param_count / trace.param_count:.2%})" if trace.param_count else "")
    if plan.model.finetune is not None:
        return [("trains", f"fine-tune, {plan.model.finetune.text}" + (f": {counts}" if counts else ""))]
    if trace is None:
        return []
    if trace.has_frozen_params:
        return [("trains", f"fine-tune, the model file freezes the rest: {counts}")]
    return [("trains", f"every parameter ({trace.param_count:,}): full training or full fine-tuning")]


def _layouts_line(plan: Plan) -> list[tuple[str, str]]:
    """Why the chosen layout beat the others (plan/points.py ``layout_reason``), when the planner searched
    more than one."""
    if not plan.layouts:
        return []
    return [("layouts", layout_reason(plan.mesh.split, plan.layouts))]


def _allocator_line(plan: Plan) -> list[tuple[str, str]]:
    """On a GPU, the simulated CUDA caching allocator's figures the plan file keeps, each named
    (cost/fits.py ``allocator_figures_text``): what it does on --mem, then what it would hold unlimited."""
    p = plan.predicted
    if p.reserved_peak_bytes is None:
        return []
    return [("on the GPU", f"{p.retries_text()}; CUDA caching allocator, simulated per GPU: "
             + allocator_figures_text(p.reserved_peak_bytes, p.no_retry_bytes, plan.cluster.expandable_segments))]


def _title(plan: Plan, budget: ReportBudget) -> str:
    return f"shard-planner report: {plan.model.path.rsplit('/', 1)[-1]} on {budget.ranks(plan.cluster.gpus)}"


def render_markdown(plan: Plan, summary: list[tuple[str, str]], sections: list[ReportSection],
                    budget: ReportBudget) -> str:
    out = [f"# {_title(plan, budget)}", "", "| | |", "|---|---|"]
    out += [f"| {k} | {md_escape(v)} |" for k, v in summary]
    for s in sections:
        out += ["", f"## {s.title}", ""]
        if s.image:
            out += [f"![{s.title}]({s.image})", ""]
        out.append(s.caption)
        if s.table is not None and len(s.table):
            out += ["", to_markdown(s.table)]
    out += ["", f"_Generated by shard-planner {__version__}._", ""]
    return "\n".join(out)


_CSS = """
body { font-family: -apple-system, Segoe UI, Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1200px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.8em 0; display: block; overflow-x: auto; }
th, td { padding: 0.25em 0.7em; border-bottom: 1px solid #e4e4e4; text-align: left; vertical-align: top; }
th { background: #f5f5f5; } th.num, td.num { text-align: right; }
table.summary td { text-align: left; } table.summary td:first-child { font-weight: 600; white-space: nowrap; }
img { max-width: 100%; border: 1px solid #eee; }
p.caption { color: #555; font-size: 0.9em; max-width: 60em; }
"""


def render_html(plan: Plan, summary: list[tuple[str, str]], sections: list[ReportSection],
                pngs: dict[str, bytes], budget: ReportBudget) -> str:
    """One self-contained page: the PNGs inlined as base64 data URIs, the CSS inline, no scripts."""
    title = html.escape(_title(plan, budget))
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{title}</title>",
           f"<style>{_CSS}</style></head><body>", f"<h1>{title}</h1>", '<table class="summary">']
    out += [f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in summary]
    out.append("</table>")
    for s in sections:
        out.append(f"<h2>{html.escape(s.title)}</h2>")
        if s.image:
            data = base64.b64encode(pngs[s.image]).decode("ascii")
            out.append(f'<img alt="{html.escape(s.title)}" src="data:image/png;base64,{data}">')
        out.append(f'<p class="caption">{html.escape(s.caption)}</p>')
        if s.table is not None and len(s.table):
            out.append(to_html(s.table))
    out.append(f'<p class="caption">Generated by shard-planner {__version__}.</p></body></html>')
    return "\n".join(out)
