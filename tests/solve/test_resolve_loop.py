"""The planner's solve-check loop (solve/planner.py ``_solve_checked``) with a scripted program and
simulators: which budgets CP-SAT is asked to solve at, when the simulators accept a cover with room to
spare (loosen once) and then reject the loosened cover."""

from types import SimpleNamespace

import pytest

from shard_planner.solve import cpsat, planner
from shard_planner.solve.cpsat import SolveResult

MIB = 2**20
BUDGET_MIB = 1000


class ScriptedContext:
    """CP-SAT answers a cover named after the budget it was asked for; the simulators' peak and the linear
    model's for each budget come from ``peaks`` (budget -> (simulated MiB, linear MiB))."""

    def __init__(self, peaks: dict[int, tuple[int, int]]):
        self.peaks = peaks
        self.budget_mib, self.budget_bytes = BUDGET_MIB, BUDGET_MIB * MIB
        self.time_limit_s = 1.0
        self.solved_at: list[int] = []

    def linear(self, choice):
        return "lm"

    def greedy(self, lm, budget_mib):
        return None

    def min_time(self, lm, budget_mib, **kwargs):
        self.solved_at.append(budget_mib)
        return SolveResult(chosen=(budget_mib,), status="FEASIBLE", objective=1, seconds=0.0)

    def check(self, lm, cover, status):
        sim, linear = self.peaks[cover[0]]
        return SimpleNamespace(peak_bytes=sim * MIB, linear_peak_mib=linear, samples_per_s=1e4 / cover[0],
                               step_time_s=cover[0] / 1e4, cover=cover, status=status)


@pytest.fixture(autouse=True)
def no_uniform_covers(monkeypatch):
    monkeypatch.setattr(cpsat, "uniform_covers", lambda lm: {})


def test_rejected_loosened_cover_ends_the_loop_when_the_linear_model_over_estimated():
    """Accepted at 800 of 1000 MiB: loosened to 1200; that cover simulates at 1100 MiB (linear said 1150):
    re-solving at 999 would repeat the solve at the budget, so there are two solves and the first plan."""
    ctx = ScriptedContext({1000: (800, 950), 1200: (1100, 1150)})
    best = planner._solve_checked(ctx, choice=SimpleNamespace(label="c"))
    assert ctx.solved_at == [1000, 1200]
    assert best.cover == (1000,)


def test_rejected_loosened_cover_is_re_solved_tighter_when_the_linear_model_under_estimated():
    """The same, but the linear model said 1050 for a cover that simulates at 1100: the program's budget
    is tightened by the 50 MiB gap (1000 - 50 - 1) and solved again."""
    ctx = ScriptedContext({1000: (800, 950), 1200: (1100, 1050), 949: (900, 940)})
    best = planner._solve_checked(ctx, choice=SimpleNamespace(label="c"))
    assert ctx.solved_at[:3] == [1000, 1200, 949]
    assert best.cover == (949,)  # faster than the first by the scripted speeds, and it fits
