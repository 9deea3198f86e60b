"""The plan-quality benchmark's judging (benchmarks/bench_plan_quality.py) on synthetic measurements:
which plans are confirmed, the gap to the best, the A/A pair and the verdict. No runs."""

from argparse import Namespace
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

import bench_plan_quality as bq  # noqa: E402
import common  # noqa: E402
import timing_stats as ts  # noqa: E402

from shard_planner.plan import Prefetch  # noqa: E402

ROUNDS, STEPS = 8, 6
ARGS = Namespace(boot=500, seed=0)


def _case(chosen: dict) -> bq.Case:
    """Plans "fast" / "close" (3% slower) / "slow" (25% slower) at 10 MiB and "small" at 5 MiB."""
    trace = SimpleNamespace(fingerprint="synthetic", tokens_per_sample=8)
    base = common.base_plan(str(common.EXAMPLES / "gpt2.py"), trace, world_size=2)
    case = bq.Case("synthetic", trace, base, budgets={"loose": 100 * 2**20, "tight": 6 * 2**20})
    for i, name in enumerate(("fast", "close", "slow", "small")):
        case.plans[name] = replace(base, prefetch=Prefetch(i, 1))  # distinct plans; only the key matters here
        case.entries.append((name, "space", name))
    case.chosen = {label: (key, 0.1) for label, key in chosen.items()}
    return case


def _launch(rounds: int, extra: tuple = ()) -> dict:
    rng = np.random.default_rng(0)
    level = rng.uniform(0.8, 1.5, rounds)  # what each round did to every plan
    own = {"fast": 0.100, "close": 0.103, "slow": 0.125, "small": 0.140}
    times = {k: own[k if isinstance(k, str) else k[0]] * level[:, None]
             * (1 + 0.01 * rng.standard_normal((rounds, STEPS))) for k in [*own, *extra]}
    rel = ts.normalise_by_round(times)
    peak = {"fast": 10, "close": 10, "slow": 10, "small": 5}
    return {k: bq.Timed(times[k], rel[k], peak[k if isinstance(k, str) else k[0]] * 2**20) for k in times}


def _judge(case, label):
    timed = _launch(2)
    jobs = bq.confirmation_jobs(case, timed, top=3)
    confirmed = _launch(ROUNDS, extra=[j for j in jobs if isinstance(j, tuple)])
    confirmed = {k: v for k, v in confirmed.items() if k in jobs}
    sboot, cboot = bq.bootstrap(timed, ARGS), bq.bootstrap(confirmed, ARGS)
    return jobs, bq.judge_budget(case, label, timed, confirmed, sboot, cboot, bq.aa_gap(confirmed, cboot))


def test_a_close_choice_meets_the_target_and_the_aa_pair_is_near_zero():
    jobs, row = _judge(_case({"loose": "close", "tight": "small"}), "loose")
    assert set(jobs) == {"close", "fast", "slow", "small", ("close", bq.AA_COPY)}
    assert row["best"] == "fast" and 1 < row["gap_pct"] < 5 and row["verdict"].startswith("met")
    assert row["aa_lo_pct"] <= 0 <= row["aa_hi_pct"] and row["aa_includes_zero"] and row["resolves_5pct"]
    assert row["screen_rank"] == "2/4"


def test_a_slow_choice_is_a_miss_with_its_interval():
    _, row = _judge(_case({"loose": "slow"}), "loose")
    assert row["best"] == "fast" and 20 < row["gap_pct"] < 30 and row["gap_lo_pct"] > 5
    assert row["verdict"] == "MISSED: slower than the best"


def test_only_plans_that_fit_compete_and_over_budget_is_a_miss():
    case = _case({"loose": "close", "tight": "small"})
    _, row = _judge(case, "tight")
    assert row["plans_that_fit"] == 1 and row["best"] == "small" and row["gap_pct"] == 0
    assert row["verdict"].startswith("met") and not row["chosen_over_budget"]
    case.chosen["tight"] = ("fast", 0.1)
    _, row = _judge(case, "tight")
    assert row["chosen_over_budget"] and row["verdict"] == "MISSED: over budget"


@pytest.mark.parametrize("gap, verdict", [
    (ts.Estimate(4.0, 1.0, 7.0), "met: gap <= 5%"),
    (ts.Estimate(8.0, 0.0, 20.0), "met: indistinguishable from the best"),
    (ts.Estimate(8.0, 3.0, 12.0), "MISSED: slower than the best"),
])
def test_verdict(gap, verdict):
    assert bq.verdict_of(False, gap) == verdict
    assert bq.verdict_of(True, gap) == "MISSED: over budget"


def test_verdict_line_flags_a_failed_aa_check_and_wide_intervals():
    row = dict(model="m", budget="loose", verdict="met: indistinguishable from the best", gap_pct=8.0,
               gap_lo_pct=0.0, gap_hi_pct=30.0, resolves_5pct=False, aa_includes_zero=False)
    line = bq.verdict_line([row])
    assert "met (met in 1/1 case(s))" in line and "cannot resolve 5%" in line and "A/A check FAILED for m" in line
    assert "MISSED (met in 1/2 case(s))" in bq.verdict_line([row, dict(row, verdict="MISSED: over budget")])
