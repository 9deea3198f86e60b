"""Step-time statistics for plans measured interleaved in rounds (bench_plan_quality.py).

Data: for each plan, a matrix ``(rounds, steps)`` of step times in seconds — round r is the r-th job of
that plan in one launch, where every plan ran once per round (see :func:`round_orders`). All plans of a
launch have the same number of rounds and steps.

[Note: why the median of all steps, and why the bootstrap resamples rounds]
On a shared CPU machine a step's time is its own cost plus whatever the other processes take: single
steps of one plan range 49-119 ms quiet and 100-330 ms loaded, and whole jobs shift level (per-job
medians of one plan 66-92 ms in one launch). The noise is one-sided and heavy-tailed, so the mean
follows the outliers and the minimum follows luck (it rewards the plan that happened to meet a quiet
moment); the median of all timed steps of all rounds is robust to both and uses every step. The
dominant variance is between jobs, not between the steps of one job (steps of one job are correlated:
they share a load regime, an allocator state, a placement on the cores). So the interval resamples the
clusters: a two-level bootstrap draws R rounds with replacement, then the steps of each drawn round with
replacement (Davison & Hinkley 1997, §3.8, "multistage sampling"; it is slightly conservative).

[Note: paired resampling]
Every plan ran in every round, close in time to the others, so a slow round slows them all. Resampling
the *same* round indices for every plan (one draw of rounds per resample, shared) keeps that pairing: a
ratio of two plans' medians then cancels what the round did to both, and its interval is much narrower
than that of either median alone.

[Note: normalising per round]
A round of all plans lasts a minute; the machine's load moves on that scale too (load average 2 in one
round, 5 in the next). Dividing every step of round r by that round's level — the median over plans of
their job medians in round r — makes the rounds comparable before they are pooled: each plan's time
becomes relative to the typical plan of its round (1.0 = typical; unitless). Ratios within a round are
unchanged. On llama tiny at load 4-5 (10 rounds x 6 steps, 9 jobs a round) it narrowed the A/A
interval (two copies of one plan) from [-43%, +27%] to [-32%, +13%]; it cannot remove what changes from
one job to the next inside a round, which is most of the noise on this machine.

[Note: the gap to the best re-picks the best]
"Chosen vs best" is chosen / min(candidates) - 1. Picking the best from the same noisy numbers biases
it low (winner's curse: the minimum of several noisy estimates is below the best true value), which
makes the gap look worse than it is. Each bootstrap resample re-picks its own best, so the interval
carries the uncertainty of which plan is best; its lower end is 0 exactly when the chosen plan is the
fastest in at least (1 - level) / 2 of the resamples, i.e. when it cannot be told apart from the best.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

LEVEL = 0.95
N_BOOT = 2000


@dataclass(frozen=True)
class Estimate:
    """A point estimate and its bootstrap percentile interval (same unit)."""

    point: float
    lo: float
    hi: float

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2

    def includes_zero(self) -> bool:
        return self.lo <= 0.0 <= self.hi

    def fmt(self, digits: int = 1) -> str:
        return f"{self.point:+.{digits}f} [{self.lo:+.{digits}f}, {self.hi:+.{digits}f}]"


def round_orders(n_plans: int, rounds: int, *, seed: int = 0) -> list[list[int]]:
    """The order of the plans in each round: a fresh seeded shuffle per round, so that no plan always
    runs first after the launch, or always right after the same neighbour."""
    rng = random.Random(seed)
    orders = []
    for _ in range(rounds):
        order = list(range(n_plans))
        rng.shuffle(order)
        orders.append(order)
    return orders


def as_matrix(rounds: Sequence[Sequence[float]]) -> np.ndarray:
    """Step times per round -> a (rounds, steps) array; every round must have the same number of steps."""
    m = np.asarray([list(r) for r in rounds], dtype=float)
    if m.ndim != 2 or m.size == 0:
        raise ValueError("step times must be a non-empty list of rounds with the same number of steps")
    return m


def normalise_by_round(samples: Mapping[Hashable, np.ndarray]) -> dict[Hashable, np.ndarray]:
    """Every plan's step times divided by its round's level (unitless). See [Note: normalising per round]."""
    job_medians = np.stack([np.median(m, axis=1) for m in samples.values()])  # (plans, rounds)
    level = np.median(job_medians, axis=0)  # (rounds,)
    return {k: m / level[:, None] for k, m in samples.items()}


def pooled_median(times: np.ndarray) -> float:
    """The median of all steps of all rounds. See [Note: why the median of all steps ...]."""
    return float(np.median(times))


def joint_bootstrap(samples: Mapping[Hashable, np.ndarray], *, n_boot: int = N_BOOT,
                    seed: int = 0) -> dict[Hashable, np.ndarray]:
    """Bootstrap distributions (``n_boot`` values each) of every plan's pooled median, resampling rounds
    then steps within them, with the same round indices for all plans. See [Note: paired resampling]."""
    shapes = {m.shape[0] for m in samples.values()}
    if len(shapes) != 1:
        raise ValueError(f"all plans must have the same number of rounds, got {sorted(shapes)}")
    (n_rounds,) = shapes
    rng = np.random.default_rng(seed)
    round_idx = rng.integers(0, n_rounds, size=(n_boot, n_rounds))  # shared by every plan
    out = {}
    for key, m in samples.items():
        n_steps = m.shape[1]
        step_idx = rng.integers(0, n_steps, size=(n_boot, n_rounds, n_steps))
        drawn = m[round_idx[:, :, None], step_idx]  # (n_boot, n_rounds, n_steps)
        out[key] = np.median(drawn.reshape(n_boot, -1), axis=1)
    return out


def _interval(values: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1.0 - level) / 2 * 100
    lo, hi = np.percentile(values, [tail, 100 - tail])
    return float(lo), float(hi)


def median_estimate(samples: np.ndarray, boot: np.ndarray, *, level: float = LEVEL) -> Estimate:
    """A plan's pooled median step time (s) with its interval."""
    return Estimate(pooled_median(samples), *_interval(boot, level))


def paired_gap_pct(a: np.ndarray, b: np.ndarray, boot_a: np.ndarray, boot_b: np.ndarray, *,
                   level: float = LEVEL) -> Estimate:
    """How much slower plan a is than plan b, in percent: (median_a / median_b - 1) * 100, with the
    interval of the paired bootstrap (``boot_a``, ``boot_b`` from one :func:`joint_bootstrap`)."""
    point = (pooled_median(a) / pooled_median(b) - 1.0) * 100
    return Estimate(point, *_interval((boot_a / boot_b - 1.0) * 100, level))


def gap_to_best_pct(chosen: Hashable, candidates: Sequence[Hashable], samples: Mapping[Hashable, np.ndarray],
                    boot: Mapping[Hashable, np.ndarray], *, level: float = LEVEL) -> tuple[Hashable, Estimate]:
    """(the fastest candidate, how much slower ``chosen`` is than the fastest, in percent). ``candidates``
    must include ``chosen``; the gap is >= 0. See [Note: the gap to the best re-picks the best]."""
    if chosen not in candidates:
        raise ValueError("the chosen plan must be one of the candidates")
    medians = {k: pooled_median(samples[k]) for k in candidates}
    best = min(candidates, key=medians.__getitem__)
    point = (medians[chosen] / medians[best] - 1.0) * 100
    best_boot = np.min(np.stack([boot[k] for k in candidates]), axis=0)
    return best, Estimate(point, *_interval((boot[chosen] / best_boot - 1.0) * 100, level))
