"""Reading a Measurement (the executor's output) into the figures the report compares."""

from __future__ import annotations

import pandas as pd

from shard_planner.errors import UserError
from shard_planner.plan.measurement import Measurement, plan_fingerprint
from shard_planner.plan import Plan
from shard_planner.report.plots import MeasuredFigures
from shard_planner.report.render import ReportSection
from shard_planner.units import format_bytes


def measured_figures(measurement: Measurement) -> MeasuredFigures:
    """Per-rank peak bytes and step-time samples of a measurement."""
    return MeasuredFigures(
        peak_bytes_per_rank=tuple(m.peak_bytes for m in measurement.memory),
        step_time_samples_s=tuple(measurement.step_time_s),
        step_time_s=float(measurement.step_time_median_s),
    )


def predictions_for(plan: Plan, measurement: Measurement) -> tuple[int, float] | None:
    """(predicted peak bytes, predicted step time) that apply to the measured run, or None.

    The measurement's own copy when the run recorded one (it is re-estimated when the run re-derived the
    plan for fewer ranks); else the plan's prediction, unless the run used another world size."""
    if measurement.predicted_peak_bytes is not None and measurement.predicted_step_time_s is not None:
        return measurement.predicted_peak_bytes, measurement.predicted_step_time_s
    if plan.predicted is not None and not measurement.rederived:
        return plan.predicted.peak_bytes, plan.predicted.step_time_s
    return None


def check_measurement_matches(plan: Plan, measurement: Measurement) -> None:
    """Raise UserError when the measurement is of another plan (its decisions' fingerprint differs from
    the plan's, and from the plan re-derived for the world size the run used)."""
    mine = {plan_fingerprint(plan)}
    if measurement.world_size != plan.cluster.gpus:
        mine.add(plan_fingerprint(plan.with_world_size(measurement.world_size)))
    if measurement.plan_fingerprint not in mine:
        raise UserError(f"the measurement is of another plan (plan fingerprint {measurement.plan_fingerprint}, this "
                        f"plan's {plan_fingerprint(plan)}): run shard-planner run on this plan, or report without it")


def run_sections(measurement: Measurement) -> list[ReportSection]:
    """The report's sections for what a run measured beyond memory and time: the collectives per step
    beside the plan's prediction, and the checkpoint's save and restores (when the run made one)."""
    sections = []
    rows = measurement.comm_comparison()
    if rows:
        verdict = ("Measured equals predicted exactly." if measurement.comm_matches else
                   "Measured differs from predicted." if measurement.comm_predicted is not None else "")
        sections.append(ReportSection(
            "Communication per step", None, None,
            "Bytes each rank's collectives moved in one timed step (counted by wrapping torch.distributed's "
            "collectives; message sizes: the whole all-gather output, the whole reduce-scatter input, the "
            f"all-reduce buffer) beside the cost model's prediction (cost/comm_bytes.py). {verdict}",
            pd.DataFrame([{"collective": c.replace("_", "-"), "group (ranks)": g,
                           "predicted (bytes)": p if p is not None else "-",
                           "measured (bytes)": m if m is not None else "-"} for c, g, p, m in rows])))
    c = measurement.checkpoint
    if c is not None:
        sections.append(ReportSection(
            "Checkpoint save and restore", None, None,
            f"A distributed checkpoint (torch.distributed.checkpoint, get_state_dict) saved before step "
            f"{c.saved_at_step} on {c.world_size} ranks: {format_bytes(c.size_bytes)} on disk, saved in "
            f"{c.save_s:.3g} s (slowest rank), {format_bytes(c.save_extra_peak_bytes)} extra peak memory while "
            f"saving ({c.save_memory_method}). Each restore builds the model afresh, loads the checkpoint, "
            "compares every model and optimizer state entry with the saved one (SHA-256 of each whole tensor) "
            f"and the next steps' losses with the run that saved it. {'Verified.' if c.ok else 'FAILED.'}",
            pd.DataFrame([{
                "ranks": r.world_size, "load (s)": round(r.load_s, 4),
                "state entries equal": f"{r.tensors_checked - len(r.tensors_differing)} of {r.tensors_checked}",
                "losses uninterrupted": " ".join(f"{v:.6f}" for v in r.losses_uninterrupted),
                "losses restored": " ".join(f"{v:.6f}" for v in r.losses_restored),
                "tolerance (rel)": r.loss_tolerance_rel, "result": "verified" if r.ok else "FAILED",
            } for r in c.restores])))
    return sections
