"""Tier 1: ``tune``'s candidates (shard_planner/tune/candidates.py) fit the budget the solver fills,
``profile.tensor_budget_bytes(--mem)`` (--mem less the profile's fragmentation share), and the solver is
re-run at the --mem whose usable budget is the intended fraction of the plan's peak. A synthetic cost
model: a plan's peak is 100 MiB + 10 MiB per unit that keeps its parameters."""


import pytest


from tests.tune.test_tune import _Estimate, _Time  # noqa: E402  (tune's synthetic estimate, shared)

from shard_planner.errors import InfeasibleError  # noqa: E402
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit  # noqa: E402
from shard_planner.hardware.profile import load_profile  # noqa: E402
from shard_planner.tune.candidates import TIGHTER_BUDGET_FRACTIONS, top_candidates  # noqa: E402

MIB = 2**20
PROFILE = load_profile("cpu-gloo")  # usable_fraction 0.8


def _plan(keep: int, mem_bytes: int) -> Plan:
    units = [Unit(("",), reshard_after_forward=False)]
    units += [Unit((f"blocks.{i}",), reshard_after_forward=i >= keep) for i in range(4)]
    return Plan(model=ModelRef("tests/models/none.py", "f" * 16), mesh=Mesh(shard=2),
                cluster=Cluster(gpus=2, gpus_per_node=8, profile="cpu-gloo", mem_budget_bytes=mem_bytes),
                training=Training(micro_batch=2), units=tuple(units), prefetch=Prefetch())


def _estimate(trace, plan, profile):
    keep = sum(u.reshard_after_forward is False for u in plan.inner_units)
    return _Estimate(_Time(1.0 - 0.1 * keep), peak_bytes=(100 + 10 * keep) * MIB)  # keeping is faster


def test_candidates_fit_the_usable_budget_and_resolve_in_mem_terms():
    mem = 170 * MIB  # usable 136 MiB: "all keep" (4 units, 140 MiB) fits --mem but not the usable budget
    usable = PROFILE.tensor_budget_bytes(mem)
    assert usable == 136 * MIB
    solver = _plan(2, mem)
    solver = Plan(**{**solver.__dict__, "predicted": _estimate(None, solver, PROFILE).prediction()})
    asked = []

    def solve(mem_budget_bytes):  # what plan_model does with a --mem: fills its usable budget
        fill = PROFILE.tensor_budget_bytes(mem_budget_bytes)
        asked.append((mem_budget_bytes, fill))
        keep = int((fill / MIB - 100) // 10)
        if keep < 0:
            raise InfeasibleError("too tight")
        return _plan(min(4, keep), mem_budget_bytes)

    cands = top_candidates(None, solver, PROFILE, 8, solve=solve, estimate=_estimate)
    # re-solved at --mem whose usable budget is each fraction of the plan's peak (120 MiB), not of --mem
    assert [fill for _, fill in asked] == [pytest.approx(120 * MIB * f, abs=1) for f in TIGHTER_BUDGET_FRACTIONS]
    assert all(m > fill for m, fill in asked)
    assert all(c.plan.predicted.peak_bytes <= usable for c in cands)
    assert all(c.plan.cluster.mem_budget_bytes == mem for c in cands)
    kept = {sum(u.reshard_after_forward is False for u in c.plan.inner_units) for c in cands}
    assert kept == {0, 2}  # the solver's, "all reshard" and the 90% re-solve; not "all keep" (140 MiB > 136 MiB)
