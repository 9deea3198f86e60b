"""Reading a Measurement (the executor's output) into the figures the report compares."""

from __future__ import annotations

from shard_planner.measurement import Measurement
from shard_planner.plan import Plan
from shard_planner.report.plots import MeasuredFigures


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
