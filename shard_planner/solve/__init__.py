"""The solver: the fastest FSDP2 plan that fits a memory budget (or a simpler one within 1% of it),
the memory-vs-time frontier, and the recipes (shard_planner/plan/recipes.py) beside it, never faster than the answer.

    from shard_planner.solve import PlanRequest, plan_model
    result = plan_model(trace, PlanRequest(gpus=8, mem_budget_bytes=40 * 2**30, profile=load_profile("h100-80gb")))
    result.plan, result.estimate, result.timings

Modules: request (PlanRequest, PlanResult), space (candidate units), linear (integer coefficients),
cpsat (the program), exact (DP and brute force cross-checks), simulate (covers as plans), context (what
one call shares: caches, the memo of estimates, the clock), frontier, alternatives (what
the program cannot express), polish (local search), simpler (the simplest plan within 1%), describe
(words), never_worse (the answer against the recipes), planner (the orchestrator).
"""

from shard_planner.solve.describe import summarize_units
from shard_planner.solve.planner import plan_model
from shard_planner.solve.request import PlanRequest, PlanResult, PlanTimings

__all__ = ["PlanRequest", "PlanResult", "PlanTimings", "plan_model", "summarize_units"]
