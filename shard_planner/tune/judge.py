"""How ``tune`` predicts and judges a plan: as the planner does (solve/survive.py, cost/fits.py).

    judge = Judge(trace, estimate)
    prediction, fits = judge.judged(plan, profile, usable_bytes)   # whether it fits --mem, retries priced
    judge.prediction(plan, profile)                                  # the prediction, retries priced in
    judge.step_time_s(plan, profile)                                 # its step time

[Note: tune judges as the planner]
  A candidate fits when its allocated peak is within ``profile.tensor_budget_bytes(--mem)`` (the search's
  budget) and, on a GPU profile, the caching-allocator simulation of its first two steps survives --mem
  (cost/fits.py ``device_fit``): the planner's test for what it shows (solve/context.py ``shown_fits``).
  Its predicted step time includes the retries it needs to survive (cost/fits.py [Note: Retries are
  priced]), so candidates, the early stop and the fit of the profile compare priced times. On a CPU
  profile ``device_fit`` is None: the allocated peak alone decides and nothing is added, as before.
"""

from __future__ import annotations

from typing import Callable

from shard_planner.cost.fits import FitVerdict, device_fit
from shard_planner.plan import Plan, Prediction
from shard_planner.hardware.profile import HardwareProfile
from shard_planner.trace.types import ModelTrace


class Judge:
    """The planner's verdict for ``tune``: ``estimate`` is :func:`shard_planner.cost.estimate`. One cost model
    per GPU profile judged with (its allocator simulations memoised), by identity: tune judges with the
    prior profile and each fitted one."""

    def __init__(self, trace: ModelTrace, estimate: Callable):
        self.trace, self.estimate = trace, estimate
        self._cost_models: list[tuple[HardwareProfile, object]] = []

    def fit(self, plan: Plan, profile: HardwareProfile) -> FitVerdict | None:
        """``plan`` on a GPU of its --mem (cost/fits.py); None on a CPU profile."""
        if profile.device != "cuda":
            return None
        return device_fit(self._cost_model(profile), plan)

    def prediction(self, plan: Plan, profile: HardwareProfile) -> Prediction:
        """``plan``'s prediction on ``profile``, the allocator's retries priced in on a GPU."""
        return self._priced(plan, profile)[0]

    def step_time_s(self, plan: Plan, profile: HardwareProfile) -> float:
        return self.prediction(plan, profile).step_time_s

    def judged(self, plan: Plan, profile: HardwareProfile, usable_bytes: int) -> tuple[Prediction, bool]:
        """The priced prediction and whether ``plan`` fits: [Note: tune judges as the planner]."""
        prediction, fit = self._priced(plan, profile)
        return prediction, prediction.peak_bytes <= usable_bytes and (fit is None or fit.survives)

    def _priced(self, plan: Plan, profile: HardwareProfile) -> tuple[Prediction, FitVerdict | None]:
        base = self.estimate(self.trace, plan, profile).prediction()
        fit = self.fit(plan, profile)
        return (fit.priced(base) if fit is not None else base), fit

    def _cost_model(self, profile: HardwareProfile):
        for known, cm in self._cost_models:
            if known is profile:
                return cm
        from shard_planner.cost.model import CostModel

        cm = CostModel(self.trace, profile)
        self._cost_models.append((profile, cm))
        return cm
