"""The planner's answer is never slower than a recipe that fits (issue 38).

[Note: Never worse than a recipe] A user who runs torchtitan, torchtune or Accelerate already has a plan:
the recipe (:mod:`shard_planner.plan.recipes`). The search judges every recipe at each of its global choices
(:func:`.alternatives.recipes`: the knobs the recipe leaves to the planner, micro-batch, accumulation,
mesh and, where the stack does not expose it, prefetch, are the search's) and they join the pool the
answer is chosen from, polished and simplified from. Steps after the choice can still lose to one: the
simplest plan within ``simpler_within`` of the fastest (:mod:`.simpler`) may be up to 1% slower than the
fastest, which a recipe may match; the allocator's verdict (:mod:`.survive`) may replace the answer. So
the last step compares the answer with the fastest recipe that fits --mem (on a GPU, that survives the
simulated allocator), both priced with their allocator retries, per sample (micro-batches may differ):
when the recipe is faster by more than :data:`RECIPE_TOLERANCE`, the answer is a bug of the search that
the planner catches itself: the fastest plan the search found is returned when it is at least as fast as
the recipe, else the recipe's plan, and the status says so.
"""

from __future__ import annotations

import logging

from shard_planner.solve.context import Checked, PlanContext
from shard_planner.solve.survive import priced_step_time_s

logger = logging.getLogger(__name__)

# An answer this much slower per sample than a recipe that fits is accepted (the simulators' rounding; the
# issue's bound is 0.1%): the simplification trades at most this against the recipes.
RECIPE_TOLERANCE = 1e-3


def priced_time_per_sample_s(ctx: PlanContext, c: Checked) -> float:
    """``c``'s step time per sample with its allocator retries priced (solve/survive.py)."""
    samples_per_step = c.samples_per_s * c.step_time_s
    return priced_step_time_s(ctx, c) / samples_per_step if samples_per_step > 0 else float("inf")


def fastest_recipe(ctx: PlanContext, recipes: list[Checked]) -> Checked | None:
    """The fastest of ``recipes`` per sample, priced, that fits --mem (``ctx.shown_fits``); None when none fits."""
    fitting = [r for r in recipes if ctx.shown_fits(r)]
    return min(fitting, key=lambda r: (priced_time_per_sample_s(ctx, r), r.peak_bytes), default=None)


def never_worse(ctx: PlanContext, chosen: Checked, fastest: Checked, recipes: list[Checked],
                status: str) -> tuple[Checked, str]:
    """``chosen`` unless a recipe among ``recipes`` fits and is faster per sample by more than
    :data:`RECIPE_TOLERANCE`; then ``fastest`` (the fastest plan the search found) when it fits and is no
    slower than that recipe, else the recipe. See [Note: Never worse than a recipe]."""
    best = fastest_recipe(ctx, recipes)
    if best is None:
        return chosen, status
    recipe_s = priced_time_per_sample_s(ctx, best)
    answer_s = priced_time_per_sample_s(ctx, chosen)
    if answer_s <= recipe_s * (1 + RECIPE_TOLERANCE):
        return chosen, status
    loss = f"{100 * (answer_s / recipe_s - 1):.2f}%"
    if fastest is not chosen and ctx.shown_fits(fastest) and priced_time_per_sample_s(ctx, fastest) <= recipe_s:
        logger.info("the simplified answer is %s slower than recipe %s: the fastest plan found is kept", loss,
                    best.status)
        return fastest, (f"{fastest.status}; the simpler plan was {loss} slower per sample than the recipe "
                         f"{best.status}, so the fastest plan found is kept")
    logger.warning("the search's answer (%s) is %s slower per sample than the recipe %s, which fits: the "
                   "recipe's plan is returned", chosen.status, loss, best.status)
    return best, (f"recipe {best.status}: the search's answer ({chosen.status}) was {loss} slower per sample "
                  "than this recipe, which fits; the recipe's plan is returned")
