"""The report's tables as pandas DataFrames, and their HTML and Markdown forms.

Column names carry their units (``peak (GiB)``, ``step time (s)``). Markdown is written here rather than
with ``DataFrame.to_markdown`` because that needs the optional ``tabulate`` package.
"""

from __future__ import annotations

import html
from typing import Sequence

import pandas as pd

from shard_planner.cost.types import ExposedParts
from shard_planner.plan import Plan
from shard_planner.report.budget import ReportBudget
from shard_planner.report.engine_words import FSDP2_WORDS, EngineWords
from shard_planner.report.plots import GIB, byte_scale, plan_throughput
from shard_planner.report.rows import UnitRow, exposed_columns

MIB = 2**20
NUM = ' class="num"'  # a numeric column's cells: right-aligned (render.py's CSS)


def units_table(rows: Sequence[UnitRow], words: EngineWords = FSDP2_WORDS) -> pd.DataFrame:
    """One line per row of :func:`~shard_planner.report.rows.unit_rows` (folded units: figures per unit);
    a column of trainable parameters when some are frozen (a fine-tune); where the plan's engine shards
    (``words``), reshard, exposed communication and a column per part of it some row has
    (:func:`exposed_parts_text` says what each is); on one device the parameters it holds and compute alone."""
    records = []
    frozen = any(r.param_count is not None and r.trainable_param_count != r.param_count for r in rows)
    parts = exposed_columns(rows)
    unit = words.unit
    for r in rows:
        rec = {unit: r.label, "count": r.count, f"modules per {unit}": len(r.modules)}
        if words.shards:
            rec["reshard after forward"] = r.reshard_text
        rec["activation checkpoint"] = ("selective" if r.activation_checkpoint == "selective"
                                        else "yes" if r.activation_checkpoint else "no")
        if r.param_count is not None:
            rec.update({
                "params": r.param_count,
                **({"trainable params": r.trainable_param_count} if frozen else {}),
                **{column: getattr(r, field) / MIB for field, column, _ in words.param_columns},
                "activations kept (MiB)": r.activation_bytes / MIB,
            })
        if r.compute_s is not None:
            rec["compute (ms)"] = r.compute_s * 1e3
        if r.compute_s is not None and words.shards:
            rec.update({
                "FSDP collectives (ms)": r.comm_s * 1e3,
                "exposed comm. (ms)": r.exposed_comm_s * 1e3,
                **{f"of it {ExposedParts.SHORT_NAMES[field]} (ms)": getattr(r.exposed_parts, field) * 1e3
                   for field, _ in parts},
            })
        records.append(rec)
    return pd.DataFrame.from_records(records)


def exposed_parts_text(rows: Sequence[UnitRow]) -> str:
    """What the units table's exposed columns are, for its caption ("" without times)."""
    parts = exposed_columns(rows)
    if not parts:
        return ""
    named = "; ".join(f"{ExposedParts.SHORT_NAMES[field]}: {name}" for field, name in parts)
    return ("Exposed comm. is what communication adds to the step; its parts, which add up to it: "
            f"{named}. FSDP collectives is their time on the communication stream, hidden under compute where "
            "it is not waited for.")


def frontier_table(plan: Plan, budget: ReportBudget) -> pd.DataFrame:
    """The chosen plan, the Pareto frontier and the recipes, with throughput; fits: the
    peak within the usable budget (``budget.fits``, what the solver fills) and, for the frontier and the
    policies, the solver's own ``fits`` flag."""
    tp = plan_throughput(plan)
    records = []
    if plan.predicted is not None:
        p = plan.predicted
        records.append(dict(kind="chosen", plan="chosen plan", peak_bytes=p.peak_bytes, step=p.step_time_s,
                            fits=budget.fits(p.peak_bytes)))
    for q in sorted(plan.frontier, key=lambda q: q.peak_bytes):
        records.append(dict(kind="frontier", plan=q.description, peak_bytes=q.peak_bytes, step=q.step_time_s,
                            fits=q.fits and budget.fits(q.peak_bytes)))
    for q in plan.baselines:
        records.append(dict(kind="recipe", plan=q.description, peak_bytes=q.peak_bytes, step=q.step_time_s,
                            fits=q.fits and budget.fits(q.peak_bytes)))
    # peaks in GiB, or in the unit the plot's axis reads in when every peak is under a GiB (a tiny model's
    # 0.00737 GiB reads 7.55 MiB)
    scale, unit = byte_scale(max((r["peak_bytes"] for r in records), default=GIB))
    peak = f"peak ({unit})"
    return pd.DataFrame.from_records([
        {
            "kind": r["kind"],
            "plan": r["plan"],
            peak: r["peak_bytes"] / scale,
            "step time (s)": r["step"],
            f"throughput ({tp.unit})": tp.of(r["step"]),
            budget.fits_column: "yes" if r["fits"] else "NO",
        }
        for r in records
    ], columns=["kind", "plan", peak, "step time (s)", f"throughput ({tp.unit})", budget.fits_column])


def _plain(value):
    return value.item() if hasattr(value, "item") and not isinstance(value, str) else value


def _column_format(values, name: str = "") -> str:
    """One float format for a whole column, so its numbers line up: decimals by the column's magnitude;
    errors in percent signed with one decimal."""
    if name.endswith("(%)"):
        return "+.1f"
    floats = [abs(v) for v in map(_plain, values) if isinstance(v, float) and v == v]
    top = max(floats, default=0.0)
    if top >= 1000:
        return ",.0f"
    if top >= 10:
        return ",.1f"
    if top >= 0.1:
        return ".3f"
    return ".3g"


def _cell(value, float_format: str = ".3g") -> str:
    value = _plain(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return "" if value != value else format(value, float_format)  # NaN: no figure for this row
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _formatters(df: pd.DataFrame) -> dict:
    return {c: (lambda v, f=_column_format(df[c], str(c)): _cell(v, f)) for c in df.columns}


def md_escape(text: str) -> str:
    """A cell's text as Markdown shows it literally: ``|`` escaped, ``<root>`` not taken for an HTML tag."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def to_markdown(df: pd.DataFrame) -> str:
    """A GitHub-flavoured Markdown table; numbers right-aligned, ``|`` escaped."""
    numeric = [pd.api.types.is_numeric_dtype(df[c]) for c in df.columns]
    fmt = _formatters(df)
    head = "| " + " | ".join(md_escape(str(c)) for c in df.columns) + " |"
    rule = "|" + "|".join("---:" if num else "---" for num in numeric) + "|"
    body = ["| " + " | ".join(md_escape(fmt[c](v)) for c, v in zip(df.columns, row)) + " |"
            for row in df.itertuples(index=False)]
    return "\n".join([head, rule, *body])


def to_html(df: pd.DataFrame) -> str:
    """An HTML table with the same number formatting as the Markdown one: numbers right-aligned (class
    "num"), text left-aligned, as the Markdown table aligns them."""
    numeric = [pd.api.types.is_numeric_dtype(df[c]) for c in df.columns]
    fmt = _formatters(df)

    def cells(tag: str, values) -> str:
        return "".join(f"<{tag}{NUM if num else ''}>{html.escape(v)}</{tag}>" for v, num in zip(values, numeric))

    rows = [f"<tr>{cells('td', [fmt[c](v) for c, v in zip(df.columns, row)])}</tr>" for row in df.itertuples(index=False)]
    return ('<table class="table">\n<thead><tr>' + cells("th", [str(c) for c in df.columns]) + "</tr></thead>\n<tbody>\n"
            + "\n".join(rows) + "\n</tbody>\n</table>")


def measurements_table(plan: Plan) -> pd.DataFrame:
    """The plans ``shard-planner tune`` ran, predicted vs measured, with the errors in percent."""
    def err(p, m):
        return float("nan") if p is None or not m else 100.0 * (p - m) / m

    return pd.DataFrame.from_records([
        {
            "plan": m.description + (" (chosen)" if m.chosen and "chosen" not in m.description else ""),
            "ranks": m.world_size,
            "predicted peak (GiB)": m.predicted_peak_bytes / GIB if m.predicted_peak_bytes is not None else float("nan"),
            "measured peak (GiB)": m.peak_bytes / GIB,
            "peak error (%)": err(m.predicted_peak_bytes, m.peak_bytes),
            "predicted step (s)": m.predicted_step_time_s if m.predicted_step_time_s is not None else float("nan"),
            "measured step (s)": m.step_time_s,
            "step error (%)": err(m.predicted_step_time_s, m.step_time_s),
        }
        for m in plan.measurements
    ])
