"""The plan-quality benchmark's statistics (benchmarks/timing_stats.py) on synthetic step times with
known effects: pure, no runs."""


import numpy as np
import pytest


import timing_stats as ts  # noqa: E402

ROUNDS, STEPS = 10, 12


def _plan(true_s: float, round_factor: np.ndarray, rng: np.random.Generator, step_noise: float = 0.03):
    """(rounds, steps) times: the plan's own time x what the round did to every plan x step noise."""
    return true_s * round_factor[:, None] * (1 + step_noise * rng.standard_normal((len(round_factor), STEPS)))


@pytest.fixture
def rounds():
    rng = np.random.default_rng(1)
    return rng, rng.uniform(0.7, 1.6, ROUNDS)  # a shared load level per round: up to 2.3x apart


def test_paired_gap_resolves_10pct_through_shared_round_noise(rounds):
    rng, factor = rounds
    a, b = _plan(0.110, factor, rng), _plan(0.100, factor, rng)
    boot = ts.joint_bootstrap({"a": a, "b": b}, seed=0)
    gap = ts.paired_gap_pct(a, b, boot["a"], boot["b"])
    assert gap.lo > 5 and gap.hi < 15 and gap.lo <= 10 <= gap.hi, gap
    # unpaired, the two medians' intervals overlap: the pairing is what resolves the gap
    ea, eb = ts.median_estimate(a, boot["a"]), ts.median_estimate(b, boot["b"])
    assert ea.lo < eb.hi


def test_aa_gap_includes_zero(rounds):
    rng, factor = rounds
    a1, a2 = _plan(0.1, factor, rng), _plan(0.1, factor, rng)
    boot = ts.joint_bootstrap({1: a1, 2: a2}, seed=0)
    gap = ts.paired_gap_pct(a1, a2, boot[1], boot[2])
    assert gap.includes_zero() and gap.half_width < 3, gap


def test_gap_to_best_finds_the_faster_plan(rounds):
    rng, factor = rounds
    samples = {"chosen": _plan(0.12, factor, rng), "best": _plan(0.10, factor, rng),
               "other": _plan(0.13, factor, rng)}
    boot = ts.joint_bootstrap(samples, seed=0)
    best, gap = ts.gap_to_best_pct("chosen", list(samples), samples, boot)
    assert best == "best"
    assert 15 < gap.point < 25 and gap.lo > 10 and not gap.includes_zero(), gap


def test_gap_to_best_is_zero_for_the_fastest_and_its_interval_starts_at_zero(rounds):
    rng, factor = rounds
    samples = {"chosen": _plan(0.100, factor, rng), "close": _plan(0.101, factor, rng),
               "slow": _plan(0.2, factor, rng)}
    boot = ts.joint_bootstrap(samples, seed=0)
    best, gap = ts.gap_to_best_pct("chosen", list(samples), samples, boot)
    assert best == "chosen" and gap.point == 0 and gap.lo == 0 and 0 < gap.hi < 5, gap


def test_gap_to_best_needs_the_chosen_among_candidates(rounds):
    rng, factor = rounds
    samples = {"a": _plan(0.1, factor, rng)}
    with pytest.raises(ValueError):
        ts.gap_to_best_pct("b", ["a"], samples, ts.joint_bootstrap(samples))


def test_bootstrap_needs_the_same_rounds_for_every_plan(rounds):
    rng, factor = rounds
    with pytest.raises(ValueError, match="same number of rounds"):
        ts.joint_bootstrap({"a": _plan(0.1, factor, rng), "b": _plan(0.1, factor[:3], rng)})
    with pytest.raises(ValueError):
        ts.as_matrix([[0.1, 0.2], [0.1]])


def test_round_orders_are_seeded_permutations():
    orders = ts.round_orders(6, 5, seed=3)
    assert all(sorted(o) == list(range(6)) for o in orders)
    assert orders == ts.round_orders(6, 5, seed=3)
    assert len({tuple(o) for o in orders}) > 1


def test_pooled_median_is_robust_to_outlier_steps():
    times = np.full((3, 10), 0.1)
    times[1, :3] = 0.25  # a burst of load in one round
    assert ts.pooled_median(times) == pytest.approx(0.1)


def test_normalising_by_round_removes_a_shared_round_level(rounds):
    _, factor = rounds
    samples = {"a": 0.1 * factor[:, None] * np.ones((ROUNDS, STEPS)),
               "b": 0.2 * factor[:, None] * np.ones((ROUNDS, STEPS)),
               "c": 0.3 * factor[:, None] * np.ones((ROUNDS, STEPS))}
    rel = ts.normalise_by_round(samples)
    assert np.allclose(rel["b"], 1.0) and np.allclose(rel["a"], 0.5) and np.allclose(rel["c"], 1.5)
