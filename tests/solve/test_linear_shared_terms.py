"""The linear models the planner derives instead of building (solve/context.py ``PlanContext.linear``)
equal the ones it would build, term for term: from the candidates' unit costs priced once per setting
(solve/candidate_costs.py) and, at other prefetch depths, from a built model's compute
(solve/linear.py ``with_prefetch``); on GPU and CPU profiles, FSDP and HSDP, with and without offload
and checkpointing, at two micro-batches."""

from dataclasses import astuple, replace

import pytest

from shard_planner.cost.model import CostModel
from shard_planner.plan import Mesh, Prefetch, Training
from shard_planner.hardware.profile import load_profile
from shard_planner.solve.candidate_costs import candidate_costs
from shard_planner.solve.choice import GlobalChoice
from shard_planner.solve.linear import build_linear_model, unit_setting, with_prefetch
from shard_planner.solve.space import build_space
from tests.models import cost_synth, solve_traces

TRACES = {
    "stack6": lambda: solve_traces.stack_trace(6),
    "synth8": lambda: cost_synth.synthetic_trace(layers=8, hidden=1024, seq=512, vocab=4096),
}
PREFETCHES = (Prefetch(0, 1), Prefetch(1, 1), Prefetch(2, 2), Prefetch(0, 0))


def _terms(lm):
    return [astuple(c) for c in lm.coeffs], replace(lm, coeffs=())


@pytest.mark.parametrize("profile_name", ["h100-80gb", "cpu-gloo"])
@pytest.mark.parametrize("name", sorted(TRACES))
def test_derived_linear_models_equal_built_ones(name, profile_name):
    trace, profile = TRACES[name](), load_profile(profile_name)
    training = Training(2, "adamw", "bfloat16")
    for mesh, offload in ((Mesh(8), False), (Mesh(4, replicate=2), False), (Mesh(8), True)):
        space = build_space(trace, shard_group=mesh.shard_group_size, gpus_per_node=8, max_group_size=2)
        for mb in (1, 4):
            first = GlobalChoice(mb, PREFETCHES[0], mesh, offload)
            ranks_see = CostModel(trace, profile).for_world(mesh.world_size).profile  # CPU ranks share cores
            costs = candidate_costs(trace, space, unit_setting(first, training), ranks_see)
            built_first = build_linear_model(trace, space, first, training, profile, costs=costs)
            assert _terms(built_first) == _terms(build_linear_model(trace, space, first, training, profile))
            for pf in PREFETCHES[1:]:
                choice = replace(first, prefetch=pf)
                built = build_linear_model(trace, space, choice, training, profile)
                assert _terms(with_prefetch(built_first, choice, costs)) == _terms(built), (mesh, offload, mb, pf)


def test_with_prefetch_refuses_another_choice():
    trace, profile = TRACES["stack6"](), load_profile("h100-80gb")
    training = Training(2, "adamw", "bfloat16")
    space = build_space(trace, shard_group=8, gpus_per_node=8, max_group_size=1)
    choice = GlobalChoice(2, Prefetch(0, 1), Mesh(8))
    costs = candidate_costs(trace, space, unit_setting(choice, training), profile)
    lm = build_linear_model(trace, space, choice, training, profile, costs=costs)
    with pytest.raises(ValueError):
        with_prefetch(lm, replace(choice, micro_batch=4), costs)
