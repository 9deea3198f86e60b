r"""Fit a hardware profile's time parameters to measured step times.

Three multiplicative factors ``k = (k_compute, k_bandwidth, k_latency)`` rescale the profile:

    compute_efficiency'  = compute_efficiency / k_compute       (compute time x k_compute)
    busbw' (intra, inter) = busbw / k_bandwidth                  (bytes term x k_bandwidth)
    latency' (intra, inter) = latency x k_latency                (alpha term x k_latency)

Each run ``i`` (a plan measured for real) has a measured median step time ``m_i`` and a predicted one
``t_i(k)`` from the cost model under the rescaled profile. With ``theta = log k``, the fit is the
regularised least squares

    minimise   sum_i ((t_i(theta) - m_i) / m_i)^2  +  lambda * |theta|^2

over relative errors (so a slow plan does not outweigh a fast one). The ridge term keeps a factor the
runs say nothing about (e.g. latency when every collective is bandwidth-bound) at the prior
(``theta_j = 0``). ``t_i`` is the whole cost model, overlap of compute and communication included, so it is
only piecewise linear in ``k``: it is solved by Gauss-Newton on finite-difference Jacobians with
step halving (a few iterations for a model that is linear in the three terms). Everything here is pure: the caller passes ``predict(profile) -> step times``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from shard_planner.errors import UserError
from shard_planner.hardware.profile import HardwareProfile

logger = logging.getLogger(__name__)

FACTORS = ("compute", "bandwidth", "latency")
RIDGE_LAMBDA = 1e-3  # weight of the prior per squared log-factor: moving a factor by e costs a 3% error
MAX_LOG_FACTOR = math.log(1000.0)  # factors are kept within 1/1000 .. 1000 of the prior
FD_STEP = 0.05  # finite-difference step in log-factor (5%): wide enough to see a piecewise-linear model move
MAX_ITERATIONS = 30


@dataclass(frozen=True)
class ProfileFit:
    """The fitted profile and how well it explains the runs."""

    profile: HardwareProfile
    factors: dict[str, float]  # FACTORS -> k (1.0: unchanged)
    measured_s: tuple[float, ...]
    predicted_before_s: tuple[float, ...]  # with the prior profile
    predicted_after_s: tuple[float, ...]  # with the fitted profile
    iterations: int

    @property
    def errors_before(self) -> tuple[float, ...]:
        """Relative errors (predicted - measured) / measured under the prior profile."""
        return tuple((p - m) / m for p, m in zip(self.predicted_before_s, self.measured_s))

    @property
    def errors_after(self) -> tuple[float, ...]:
        return tuple((p - m) / m for p, m in zip(self.predicted_after_s, self.measured_s))

    @property
    def max_abs_error_after(self) -> float:
        return max((abs(e) for e in self.errors_after), default=0.0)


def scale_profile(profile: HardwareProfile, factors: dict[str, float]) -> HardwareProfile:
    """``profile`` with the time parameters rescaled by ``factors`` (see the module docstring)."""
    kc, kb, kl = (float(factors.get(name, 1.0)) for name in FACTORS)
    ic = profile.interconnect
    return replace(
        profile,
        compute_efficiency=profile.compute_efficiency / kc,
        interconnect=replace(
            ic,
            intra_node_busbw_bytes_per_s=ic.intra_node_busbw_bytes_per_s / kb,
            inter_node_busbw_bytes_per_s=ic.inter_node_busbw_bytes_per_s / kb,
            intra_node_latency_s=ic.intra_node_latency_s * kl,
            inter_node_latency_s=ic.inter_node_latency_s * kl,
        ),
    )


def _factors(theta: np.ndarray) -> dict[str, float]:
    return {name: float(math.exp(v)) for name, v in zip(FACTORS, theta)}


def fit_profile(profile: HardwareProfile, predict: Callable[[HardwareProfile], Sequence[float]],
                measured_s: Sequence[float], *, ridge: float = RIDGE_LAMBDA) -> ProfileFit:
    """Fit ``profile``'s compute efficiency and collective bandwidth and latency so that
    ``predict(profile)`` (predicted step times, one per run) matches ``measured_s``."""
    m = np.asarray([float(v) for v in measured_s])
    if m.size == 0:
        raise UserError("cannot fit a profile to no runs")
    if not np.all(np.isfinite(m)) or np.any(m <= 0):
        raise UserError(f"measured step times must be positive, got {list(measured_s)}")
    sqrt_ridge = math.sqrt(ridge)

    def residuals(theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        t = np.asarray(predict(scale_profile(profile, _factors(theta))), dtype=float)
        if t.shape != m.shape:
            raise ValueError(f"predict returned {t.size} step times for {m.size} runs")
        return np.concatenate([(t - m) / m, sqrt_ridge * theta]), t

    theta = np.zeros(len(FACTORS))
    r, before = residuals(theta)
    cost = float(r @ r)
    iterations = 0
    for iterations in range(1, MAX_ITERATIONS + 1):
        jac = np.empty((r.size, theta.size))
        for j in range(theta.size):
            step = np.zeros_like(theta)
            step[j] = FD_STEP
            r_plus, _ = residuals(theta + step)
            r_minus, _ = residuals(theta - step)
            jac[:, j] = (r_plus - r_minus) / (2 * FD_STEP)
        delta = np.linalg.lstsq(jac, -r, rcond=None)[0]
        improved = False
        for _ in range(12):  # step halving: accept the first step that lowers the cost
            candidate = np.clip(theta + delta, -MAX_LOG_FACTOR, MAX_LOG_FACTOR)
            r_new, _ = residuals(candidate)
            cost_new = float(r_new @ r_new)
            if cost_new < cost - 1e-12:
                theta, r, cost, improved = candidate, r_new, cost_new, True
                break
            delta = delta / 2
        if not improved or float(np.max(np.abs(delta))) < 1e-4:
            break
    _, after = residuals(theta)
    factors = _factors(theta)
    logger.info("fitted factors %s over %d runs (relative cost %.3g)", factors, m.size, cost)
    return ProfileFit(
        profile=scale_profile(profile, factors),
        factors=factors,
        measured_s=tuple(float(v) for v in m),
        predicted_before_s=tuple(float(v) for v in before),
        predicted_after_s=tuple(float(v) for v in after),
        iterations=iterations,
    )
