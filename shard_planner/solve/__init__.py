"""The solver: the fastest FSDP2 plan that fits a memory budget, the memory-vs-time frontier, and the
hand-written policies beside it.

    from shard_planner.solve import plan_model
    plan = plan_model(trace, gpus=8, mem_budget_bytes=40 * 2**30, profile=load_profile("h100-80gb"))

Modules: space (candidate units), linear (integer coefficients), cpsat (the program), exact (DP and
brute force cross-checks), simulate (the cost model's check), baselines, planner (the orchestrator).
"""

from shard_planner.solve.planner import plan_model, summarize_units

__all__ = ["plan_model", "summarize_units"]
