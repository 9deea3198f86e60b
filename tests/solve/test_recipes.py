"""The recipes (shard_planner/plan/recipes.py) and the planner's promise never to answer worse than one that fits
(shard_planner/solve/never_worse.py [Note: Never worse than a recipe]), on hand-written traces."""

from dataclasses import replace

import pytest

from tests.models.solve_traces import GIB, profile, stack_trace
from shard_planner.plan.checkpointing import SELECTIVE, TORCHTITAN_OP_SAVE_OPS
from shard_planner.cost import estimate
from shard_planner.errors import InfeasibleError
from shard_planner.parallel.mesh import Mesh
from shard_planner.plan import ROOT, Prefetch, Unit
from shard_planner.plan.recipes import PLANNER_KNOBS, PREFETCH, RECIPE_NAMES, RECIPES, recipe_named, recipes_for
from shard_planner.solve import PlanRequest, plan_model
from shard_planner.solve.alternatives import RECIPE_METHOD, recipe_plan, recipes
from shard_planner.solve.context import PlanContext
from shard_planner.solve.choice import GlobalChoice
from shard_planner.solve.never_worse import RECIPE_TOLERANCE, never_worse, priced_time_per_sample_s
from shard_planner.solve.space import build_space

PROFILE = profile()


def _space(trace, shard=8):
    return build_space(trace, shard_group=shard, gpus_per_node=8)


def test_names_are_unique_and_each_recipe_says_what_it_fixes():
    assert len(set(RECIPE_NAMES)) == len(RECIPES) >= 10
    for r in RECIPES:
        assert set(PLANNER_KNOBS) <= set(r.planner_knobs()) and not set(r.fixes) & set(r.planner_knobs())
        assert r.source and r.title in r.describe()
    # the stacks expose no explicit prefetch; the generic recipes leave it to the planner
    assert PREFETCH in recipe_named("torchtitan").fixes and PREFETCH in recipe_named("zero2-like").planner_knobs()
    with pytest.raises(ValueError, match="unknown recipe 'titan'"):
        recipe_named("titan")


def test_torchtitan_units_are_its_apply_fsdp():
    """tok_embeddings and each block resharded, [norm, output] one unit not resharded, the root not resharded."""
    trace = stack_trace(4)
    units = recipe_named("torchtitan").units(_space(trace))
    assert units == (Unit((ROOT,), False), Unit(("embed",), True), *(Unit((f"layers.{i}",), True) for i in range(4)),
                     Unit(("norm", "head"), False))
    op = recipe_named("torchtitan-op-sac").units(_space(trace))
    assert {(u.activation_checkpoint, u.ac_save_ops) for u in op if u.modules[0].startswith("layers.")} == {
        (SELECTIVE, TORCHTITAN_OP_SAVE_OPS)}
    layer = recipe_named("torchtitan-layer-sac").units(_space(trace))
    # torchtitan counts blocks from 1 and checkpoints the 2nd, 4th, ...
    assert [u.activation_checkpoint for u in layer if u.modules[0].startswith("layers.")] == [False, True, False, True]


def test_torchtune_and_accelerate_reshard_the_root_zero2_keeps_everything_gathered():
    trace = stack_trace(3)
    tune = recipe_named("torchtune").units(_space(trace))
    assert tune[0] == Unit((ROOT,), True) and all(u.reshard_after_forward and u.activation_checkpoint for u in tune[1:])
    assert recipe_named("torchtune-cpu-offload").cpu_offload
    assert all(u.reshard_after_forward is False for u in recipe_named("zero2-like").units(_space(trace)))


def test_recipes_for_drops_checkpointing_where_the_forward_builds_a_cache():
    trace = replace(stack_trace(3), forward_cache="DynamicCache")
    kept = [r for r, _units in recipes_for(_space(trace), trace)]
    assert {r.name for r in kept} >= {"torchtitan", "zero2-like", "accelerate-transformer-wrap"}
    assert not any(u.activation_checkpoint for _r, units in recipes_for(_space(trace), trace) for u in units)


def test_recipe_plan_is_the_recipe_at_the_requested_micro_batch():
    trace = stack_trace(4)
    request = PlanRequest(gpus=8, mem_budget_bytes=80 * GIB, profile=PROFILE, micro_batch=2)
    plan = recipe_plan(trace, request, "torchtune-cpu-offload")
    assert plan.units == recipe_named("torchtune").units(_space(trace))
    assert plan.training.micro_batch == 2 and plan.training.cpu_offload and plan.prefetch == Prefetch()


def _checked(ctx, units, status, micro_batch=4):
    return ctx.check_units(units, GlobalChoice(micro_batch, Prefetch(), Mesh(shard=8), False), status)


def test_never_worse_returns_the_faster_recipe_and_says_so():
    """An answer slower than a recipe that fits (here, every block checkpointed where nothing needs to be) is
    replaced by the recipe; an answer as fast is kept."""
    trace = stack_trace(4)
    ctx = PlanContext(trace, PlanRequest(gpus=8, mem_budget_bytes=80 * GIB, profile=PROFILE, micro_batch=4,
                                         allocator_check=False))
    try:
        slow = _checked(ctx, recipe_named("full-ac").units(_space(trace)), "slow answer")
        [fast] = [c for c in recipes(ctx, [slow.choice]) if c.status == recipe_named("zero2-like").title]
        assert priced_time_per_sample_s(ctx, fast) < priced_time_per_sample_s(ctx, slow) * (1 - RECIPE_TOLERANCE)
        chosen, status = never_worse(ctx, slow, slow, [fast], "cp-sat")
        assert chosen is fast and chosen.method == RECIPE_METHOD
        assert status.startswith("recipe ZeRO-2-like (no reshard): the search's answer (slow answer) was")
        # the fastest plan the search found is preferred to the recipe when it is as fast
        chosen, status = never_worse(ctx, slow, fast, [fast], "cp-sat")
        assert chosen is fast
        assert never_worse(ctx, fast, fast, [slow], "kept") == (fast, "kept")
    finally:
        ctx.close()


@pytest.mark.parametrize("budget_gib", [1.5, 2, 3, 6])
def test_the_answer_is_never_slower_than_a_recipe_that_fits(budget_gib):
    """Judged apart from the planner: every recipe at the answer's micro-batch, FSDP2's default prefetch, priced by
    the simulators. ``simpler_within=0.5`` lets the simplification give up to 50% against the fastest plan:
    the recipes still bound the answer."""
    trace, budget = stack_trace(6), int(budget_gib * GIB)
    request = PlanRequest(gpus=8, mem_budget_bytes=budget, profile=PROFILE, micro_batch=4, time_limit_s=2.0,
                          frontier_points=3, simpler_within=0.5, allocator_check=False)
    try:
        plan = plan_model(trace, request).plan
    except InfeasibleError:
        pytest.skip("no plan fits")
    space = _space(trace)
    for r in RECIPES:
        if r.cpu_offload:
            continue
        est = estimate(trace, replace(plan, predicted=None, units=r.units(space), prefetch=Prefetch()), PROFILE)
        if est.memory.peak_bytes <= PROFILE.tensor_budget_bytes(budget):
            assert plan.predicted.step_time_s <= est.time.step_time_s * (1 + RECIPE_TOLERANCE), r.name
