"""``tune``: confirm the planner's answer by running the best few plans, learn the profile from them.

    plan -> top-K distinct candidates (predicted) -> run a round of them (one launch) -> fit the profile
         -> re-rank what is left with the fitted profile -> stop, or run the next round
         -> the measured best, with every measurement in the plan

[Note: early stop]
After each round the profile is fitted to every run so far and the largest relative error it leaves,
``e = max_i |t_i - m_i| / m_i``, is the observed error. A remaining candidate with fitted prediction
``t`` could still beat the measured best ``m*`` only if ``t * (1 - e) < m*``; when none can, tuning
stops and the rest are reported as skipped, with the reason.

[Note: world size of the runs]
On a machine with fewer devices than the plan's GPUs (this CPU machine: gloo ranks), the candidates are
planned for ``gpus`` and each is re-derived for ``world_size`` ranks (:meth:`Plan.with_world_size`) to
run. Predictions compared with the runs are made for the re-derived plans; the plan returned is the
``gpus`` plan whose re-derived run was fastest, with its prediction for ``gpus`` under the fitted
profile. The measured ranking at ``world_size`` need not be the ranking at ``gpus``; the result says so.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Callable

from shard_planner.errors import InfeasibleError, RunError, UserError
from shard_planner.plan.measurement import Measurement, plan_fingerprint
from shard_planner.plan import MeasuredPoint, Plan, Prediction, SolverInfo
from shard_planner.hardware.profile import HardwareProfile
from shard_planner.trace.types import ModelTrace
from shard_planner.tune.candidates import Candidate, describe_plan
from shard_planner.tune.fit import ProfileFit, fit_profile
from shard_planner.tune.judge import Judge

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Trial:
    """One candidate run for real."""

    candidate: Candidate  # planned for the cluster's gpus
    run_plan: Plan  # what ran (re-derived for the run's world size when it differs)
    measurement: Measurement
    predicted_prior_s: float  # the run plan's step time under the prior profile
    predicted_peak_bytes: int  # the run plan's peak (memory is not fitted)
    round: int  # launch number, from 1

    @property
    def measured_s(self) -> float:
        return self.measurement.step_time_median_s


@dataclass(frozen=True)
class Skipped:
    candidate: Candidate
    predicted_prior_s: float  # at the run's world size, prior profile
    predicted_fitted_s: float  # at the run's world size, fitted profile
    reason: str


@dataclass(frozen=True)
class TuneResult:
    plan: Plan  # the measured best, with every measurement
    trials: tuple[Trial, ...]
    skipped: tuple[Skipped, ...]
    fit: ProfileFit
    chosen: int  # index into trials
    world_size: int  # where the runs ran
    rederived: bool  # the runs used another world size than the plan's gpus
    launches: int
    seconds: float

    @property
    def best(self) -> Trial:
        return self.trials[self.chosen]


def _measured_best(trials: list[Trial], budget_bytes: int, rederived: bool) -> int:
    """Index of the fastest run that fits the budget; a re-derived run is judged by the prediction for
    the plan's own gpus (the candidates fit it), since its measured memory is for another world size."""
    eligible = [i for i, t in enumerate(trials) if rederived or t.measurement.peak_bytes <= budget_bytes]
    if not eligible:
        peaks = ", ".join(f"{t.measurement.peak_bytes / 2**20:.1f} MiB" for t in trials)
        raise InfeasibleError(f"every plan tune ran was over the {budget_bytes / 2**20:.1f} MiB usable budget "
                              f"(measured peaks {peaks}): raise --mem or check the profile's memory figures")
    return min(eligible, key=lambda i: trials[i].measured_s)


def tune(trace: ModelTrace, candidates: list[Candidate], prior: HardwareProfile, *,
         estimate: Callable, run_plans: Callable[..., list[Measurement]], world_size: int | None = None,
         per_launch: int | None = None, steps: int = 5, warmup: int = 2, timeout_s: float = 600.0,
         device: str = "auto") -> TuneResult:
    """Run ``candidates`` (fastest predicted first) in rounds of ``per_launch`` plans per launch, fit the
    profile after each round, stop early (see [Note: early stop]) and return the measured best.
    ``estimate`` is :func:`shard_planner.cost.estimate`, ``run_plans`` :func:`shard_planner.execute.run_plans`."""
    if not candidates:
        raise UserError("tune needs at least one candidate plan")
    start = time.perf_counter()
    gpus = candidates[0].plan.cluster.gpus
    # the measured peak must fit what the planner fills of --mem (the rest is the allocator's headroom)
    budget = prior.tensor_budget_bytes(candidates[0].plan.cluster.mem_budget_bytes)
    world_size = gpus if world_size is None else world_size
    rederived = world_size != gpus
    if per_launch is None:
        per_launch = max(1, math.ceil(len(candidates) / 2))
    if per_launch < 1:
        raise UserError(f"--per-launch must be at least 1, got {per_launch}")
    judge = Judge(trace, estimate)  # step times with the allocator's retries priced (tune/judge.py)
    pending = _plans_to_run(candidates, prior, judge, world_size if rederived else None)
    rounds = _Rounds(run_plans, world_size, dict(steps=steps, warmup=warmup, timeout_s=timeout_s, device=device))
    fit: ProfileFit | None = None
    while pending:
        batch, pending = pending[:per_launch], pending[per_launch:]
        rounds.run_batch(batch)
        if not rounds.trials:
            continue
        fit = fit_profile(prior, lambda prof: [judge.step_time_s(t.run_plan, prof) for t in rounds.trials],
                          [t.measured_s for t in rounds.trials])
        if not pending:
            break
        pending = _still_worth_running(pending, rounds, fit, lambda p: judge.prediction(p, fit.profile), budget,
                                       rederived)
    if fit is None:
        raise RunError("no candidate plan ran: " + "; ".join(s.reason for s in rounds.skipped))
    return _result(rounds, fit, lambda p: judge.prediction(p, fit.profile), budget, rederived, start)


def _plans_to_run(candidates: list[Candidate], prior: HardwareProfile, judge: Judge,
                  rederive_for: int | None) -> list[tuple[Candidate, Plan]]:
    """Each candidate with the plan that runs (re-derived for ``rederive_for`` ranks when given) and its
    prediction on ``prior``; a candidate whose run plan equals an earlier one's is dropped (re-deriving
    can make two candidates equal: an int reshard becomes True)."""
    pending: list[tuple[Candidate, Plan]] = []
    seen: set[str] = set()
    for c in candidates:
        p = c.plan.with_world_size(rederive_for) if rederive_for is not None else c.plan
        rp = replace(p, predicted=judge.prediction(p, prior))
        key = plan_fingerprint(rp)
        if key not in seen:
            seen.add(key)
            pending.append((c, rp))
    return pending


class _Rounds:
    """The launches so far: what ran (trials), what did not (skipped) and how many launches it took."""

    def __init__(self, run_plans: Callable[..., list[Measurement]], world_size: int, run_options: dict):
        self.run_plans, self.world_size, self.run_options = run_plans, world_size, run_options
        self.trials: list[Trial] = []
        self.skipped: list[Skipped] = []
        self.launches = 0

    def run_batch(self, batch: list[tuple[Candidate, Plan]]) -> None:
        """Run ``batch`` in one launch; when the launch fails, each plan alone, so that a plan the
        executor rejects is reported as failed instead of ending the tuning."""
        self.launches += 1
        logger.info("launch %d: running %d plan(s) at world size %d", self.launches, len(batch), self.world_size)
        try:
            measured = self.run_plans([rp for _, rp in batch], world_size=self.world_size, **self.run_options)
        except RunError as exc:
            if len(batch) == 1:
                c, rp = batch[0]
                logger.warning("candidate %s failed to run: %s", c.description, exc)
                self.skipped.append(Skipped(c, rp.predicted.step_time_s, float("nan"), f"failed to run: {exc}"))
                return
            for item in batch:
                self.run_batch([item])
            return
        for (c, rp), m in zip(batch, measured):
            self.trials.append(Trial(c, rp, m, rp.predicted.step_time_s, rp.predicted.peak_bytes, self.launches))


def _still_worth_running(pending: list[tuple[Candidate, Plan]], rounds: _Rounds, fit: ProfileFit,
                         predict_fitted: Callable[[Plan], Prediction], budget: int,
                         rederived: bool) -> list[tuple[Candidate, Plan]]:
    """The pending plans the fitted profile, less its observed error, still predicts faster than the
    measured best that fits, fastest first; the others are recorded as skipped. See [Note: early stop]."""
    fitting = [t.measured_s for t in rounds.trials if rederived or t.measurement.peak_bytes <= budget]
    if not fitting:
        return pending  # nothing measured fits yet: run the next round as ranked
    best_s = min(fitting)
    error = fit.max_abs_error_after
    scored = sorted(((predict_fitted(rp).step_time_s, c, rp) for c, rp in pending), key=lambda x: x[0])
    kept = []
    for t, c, rp in scored:
        if t * (1 - error) < best_s:
            kept.append((c, rp))
        else:
            rounds.skipped.append(Skipped(c, rp.predicted.step_time_s, t, f"fitted prediction {t:.4g} s minus the "
                                          f"observed error {error:.1%} is not below the measured best {best_s:.4g} s"))
    return kept


def _result(rounds: _Rounds, fit: ProfileFit, predict_fitted: Callable[[Plan], Prediction], budget: int,
            rederived: bool, start: float) -> TuneResult:
    """The measured best, with every run as a measured point and the fitted profile's prediction."""
    trials = rounds.trials
    chosen = _measured_best(trials, budget, rederived)
    fitted_after = fit.predicted_after_s
    points = tuple(
        MeasuredPoint(description=t.candidate.description, plan_fingerprint=plan_fingerprint(t.run_plan),
                      world_size=rounds.world_size, peak_bytes=t.measurement.peak_bytes, step_time_s=t.measured_s,
                      predicted_peak_bytes=t.predicted_peak_bytes, predicted_step_time_s=fitted_after[i],
                      chosen=i == chosen)
        for i, t in enumerate(trials))
    best = trials[chosen].candidate.plan
    seconds = time.perf_counter() - start
    predicted = predict_fitted(best)
    plan = replace(
        best,
        predicted=predicted,
        solver=SolverInfo(method="tune", status=f"measured best of {len(trials)} run(s)",
                          objective=predicted.step_time_s, seconds=seconds),
        measurements=points,
    )
    logger.info("tune: chose %s (%.4g s measured) after %d run(s) in %d launch(es)",
                describe_plan(plan), trials[chosen].measured_s, len(trials), rounds.launches)
    return TuneResult(plan=plan, trials=tuple(trials), skipped=tuple(rounds.skipped), fit=fit, chosen=chosen,
                      world_size=rounds.world_size, rederived=rederived, launches=rounds.launches, seconds=seconds)


def measurement_for_report(result: TuneResult) -> Measurement:
    """The chosen run's measurement with the fitted prediction for what ran, marked re-derived when it
    ran at another world size (so the report compares like with like)."""
    t = result.best
    # The returned plan names the fitted profile, which changes its fingerprint but not one decision
    # that ran: the measurement is re-labelled with the returned plan's fingerprint (re-derived like the run).
    ran_as = result.plan.with_world_size(result.world_size) if result.rederived else result.plan
    return replace(t.measurement, plan_fingerprint=plan_fingerprint(ran_as), predicted_peak_bytes=t.predicted_peak_bytes,
                   predicted_step_time_s=result.fit.predicted_after_s[result.chosen],
                   rederived_from_world_size=t.candidate.plan.cluster.gpus if result.rederived else None)
