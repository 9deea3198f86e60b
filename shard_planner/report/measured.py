"""Reading a Measurement (the executor's output) into the figures the report compares."""

from __future__ import annotations

from shard_planner.errors import UserError
from shard_planner.measurement import Measurement, plan_fingerprint
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


def check_measurement_matches(plan: Plan, measurement: Measurement) -> None:
    """Raise UserError when the measurement is of another plan (its decisions' fingerprint differs from
    the plan's, and from the plan re-derived for the world size the run used)."""
    mine = {plan_fingerprint(plan)}
    if measurement.world_size != plan.cluster.gpus:
        mine.add(plan_fingerprint(plan.with_world_size(measurement.world_size)))
    if measurement.plan_fingerprint not in mine:
        raise UserError(f"the measurement is of another plan (plan fingerprint {measurement.plan_fingerprint}, this "
                        f"plan's {plan_fingerprint(plan)}): run shard-planner run on this plan, or report without it")
