"""Tier 1: the solver on hand-written traces (tests/models/solve_traces.py) — no tracer, no profiles/.

- the search space finds the blocks, the one-off modules and the nestable blocks;
- CP-SAT = DP = brute force on tiny models, across budgets and prefetch depths;
- known optima: with no memory pressure nothing is checkpointed and every block keeps its parameters;
  at the smallest budget every block is checkpointed and resharded;
- plan_model: the chosen plan never exceeds the budget in the simulators, whatever the budget;
  budgets no plan fits raise InfeasibleError with the smallest budget that fits;
- the same inputs give the same plan.
"""

from dataclasses import replace

import pytest

from tests.models.solve_traces import GIB, MIB, profile, stack_trace
from shard_planner.errors import InfeasibleError
from shard_planner.plan import Cluster, Mesh, Prefetch, Training
from shard_planner.solve import PlanRequest, plan_model
from shard_planner.solve.cpsat import greedy_cover, lagrangian_cover, solve_min_peak, solve_min_time
from shard_planner.solve.exact import all_covers, solve_brute_force, solve_dp
from shard_planner.solve.choice import GlobalChoice
from shard_planner.solve.linear import build_linear_model, evaluate
from shard_planner.solve.simulate import cover_units, make_plan, simulate
from shard_planner.solve.space import build_space, find_items
from shard_planner.units import parse_bytes


def tiny_model(n_layers=2, prefetch=Prefetch(0, 1), shard=16, gpn=8, max_group=2, **trace_kw):
    trace = stack_trace(n_layers, **trace_kw)
    space = build_space(trace, shard_group=shard, gpus_per_node=gpn, max_group_size=max_group)
    lm = build_linear_model(trace, space, GlobalChoice(4, prefetch, Mesh(shard)), Training(4), profile(gpus_per_node=gpn))
    return trace, space, lm


def test_items_are_blocks_and_one_off_modules():
    items = find_items(stack_trace(3))
    assert [it.fqn for it in items] == ["embed", "layers.0", "layers.1", "layers.2", "norm", "head"]
    assert [it.may_join_root for it in items] == [True, False, False, False, True, True]
    assert items[1].nested_children == ("layers.1.attn", "layers.1.mlp")[:0] + ("layers.0.attn", "layers.0.mlp")
    assert items[1].parent == "layers" and items[0].parent == ""


def test_segments_are_runs_of_siblings():
    space = build_space(stack_trace(3), shard_group=16, gpus_per_node=8, max_group_size=4)
    for c in space.candidates:
        assert len({space.items[i].parent for i in range(c.start, c.stop)}) == 1
        assert c.stop - c.start <= 4
    # int reshard to the node size only when the shard group spans nodes
    assert any(c.option.reshard_after_forward == 8 for c in space.candidates)
    single_node = build_space(stack_trace(3), shard_group=8, gpus_per_node=8)
    assert all(isinstance(c.option.reshard_after_forward, bool) for c in single_node.candidates)


@pytest.mark.parametrize("prefetch", [Prefetch(0, 1), Prefetch(1, 1), Prefetch(2, 2)])
def test_cpsat_equals_dp_equals_brute_force(prefetch):
    _, space, lm = tiny_model(prefetch=prefetch, shard=8)  # no int reshard: a smaller space for the brute force
    results = [evaluate(lm, c) for c in all_covers(lm)]
    assert len(results) > 1000
    low = solve_min_peak(lm, relative_gap=0.0)
    assert low.status == "OPTIMAL"
    assert low.objective == min(r.peak_mib for r in results)
    best_time = min(r.time_us for r in results)
    fastest = min(r.peak_mib for r in results if r.time_us == best_time)
    for budget in (low.objective - 1, low.objective, low.objective + 40, low.objective + 150, fastest, 10**7):
        cp = solve_min_time(lm, budget, relative_gap=0.0, hint=greedy_cover(lm, budget))
        dp = solve_dp(lm, budget)
        bf = solve_brute_force(lm, budget)
        if bf is None:
            assert cp.chosen is None and cp.status == "INFEASIBLE" and dp is None
            continue
        assert cp.status == "OPTIMAL"
        assert cp.objective == dp[1] == bf[1], budget
        for cover in (cp.chosen, dp[0], bf[0]):
            res = evaluate(lm, cover)
            assert res.peak_mib <= budget and res.time_us == bf[1]


def test_cpsat_equals_dp_with_int_reshard_and_nesting():
    _, space, lm = tiny_model(n_layers=3, shard=16, max_group=1)
    assert any(c.option.nested for c in space.candidates) and any(
        c.option.reshard_after_forward == 8 for c in space.candidates)
    low = solve_min_peak(lm, relative_gap=0.0).objective
    for budget in (low, low + 100, low + 400, 10**7):
        cp = solve_min_time(lm, budget, relative_gap=0.0)
        dp = solve_dp(lm, budget)
        assert cp.objective == dp[1]
        assert evaluate(lm, cp.chosen).peak_mib <= budget


def test_known_optimum_without_memory_pressure():
    """Communication hides behind compute, so checkpointing only costs recomputation and resharding
    only costs collectives: the fastest plan checkpoints nothing and keeps every block's parameters."""
    _, space, lm = tiny_model(n_layers=4, shard=8, max_group=1)
    res = solve_min_time(lm, 10**7, relative_gap=0.0)
    opts = [space.candidates[k].option for k in res.chosen]
    assert not any(o.activation_checkpoint for o in opts)
    blocks = [space.candidates[k].option for k in res.chosen if space.items[space.candidates[k].start].fqn.startswith("layers.")]
    assert blocks and all(o.reshard_after_forward is False and not o.nested for o in blocks)
    # its time is the compute of every block plus the constant part, with no recomputation
    assert res.objective == evaluate(lm, res.chosen).time_us


def test_known_optimum_at_the_smallest_budget():
    """At the smallest budget every block but the last is checkpointed (each keeps 8 MiB of input
    instead of 128 MiB of activations) and resharded (keeping parameters costs 64 MiB per block). The
    last block's choice is free: its activations are live only at its own backward, where
    re-materialising them would put them back, so the peak does not depend on it."""
    _, space, lm = tiny_model(n_layers=4, shard=8, max_group=1)
    low = solve_min_peak(lm, relative_gap=0.0)
    res = solve_min_time(lm, low.objective, relative_gap=0.0)
    blocks = [space.candidates[k].option for k in res.chosen if space.items[space.candidates[k].start].fqn.startswith("layers.")]
    assert len(blocks) == 4
    assert all(o.activation_checkpoint and o.reshard_after_forward is not False for o in blocks[:-1])
    assert res.objective < min(evaluate(lm, c).time_us for c in [res.chosen]) + 1  # what CP-SAT reports is the cover's time


def test_budget_between_buys_exactly_the_checkpoints_it_must():
    """Each checkpointed block saves 120 MiB of stack at micro-batch 4 and costs 8 ms of recompute:
    with room for all but ~1.5 blocks' worth of activations, exactly two blocks are checkpointed."""
    _, space, lm = tiny_model(n_layers=4, shard=8, max_group=1)
    free = solve_min_time(lm, 10**7, relative_gap=0.0)
    lean = _lean_peak(lm)  # the leanest plan without checkpointing
    res = solve_min_time(lm, lean - 180, relative_gap=0.0)
    n_ac = sum(space.candidates[k].option.activation_checkpoint for k in res.chosen
               if space.items[space.candidates[k].start].fqn.startswith("layers."))
    assert n_ac == 2  # (checkpointing the norm costs almost nothing: the solver may do it too)
    assert res.objective > free.objective


def _lean_peak(lm):
    """The smallest linear peak without checkpointing: min-peak over the space without AC options."""
    keep = [k for k, c in enumerate(lm.space.candidates) if not c.option.activation_checkpoint]
    sub = replace(lm, space=replace(lm.space, candidates=tuple(lm.space.candidates[k] for k in keep)),
                  coeffs=tuple(lm.coeffs[k] for k in keep))
    return solve_min_peak(sub, relative_gap=0.0).objective


def test_hints_fit_and_are_covers():
    _, _, lm = tiny_model(n_layers=6, shard=16, max_group=4)
    low = solve_min_peak(lm).objective
    for budget in (low, low + 300, 10**7):
        for heuristic in (greedy_cover, lagrangian_cover):
            cover = heuristic(lm, budget)
            assert cover is not None and evaluate(lm, cover).peak_mib <= budget


# ---- plan_model: the simulators have the last word ----

PROFILE = profile()


def _plan(trace, budget_bytes, **kw):
    kw.setdefault("micro_batch", 4)
    kw.setdefault("frontier_points", 3)
    return plan_model(trace, PlanRequest(gpus=8, mem_budget_bytes=budget_bytes, profile=PROFILE, gpus_per_node=8,
                      time_limit_s=2.0, **kw)).plan


@pytest.fixture(scope="module")
def trace8():
    return stack_trace(8)


@pytest.fixture(scope="module")
def roomy_plan(trace8):
    return _plan(trace8, 3 * GIB)


def test_plan_fits_in_the_simulator_and_beats_hand_written(trace8, roomy_plan):
    plan = roomy_plan
    est = simulate(trace8, replace(plan, predicted=None), PROFILE)
    assert est.memory.peak_bytes == plan.predicted.peak_bytes <= 3 * GIB
    assert plan.solver.method in ("cp-sat", "recipe") and plan.solver.seconds > 0
    fitting = [b for b in plan.baselines if b.fits]
    assert fitting and plan.predicted.step_time_s <= min(b.step_time_s for b in fitting)
    assert {b.description for b in plan.baselines} >= {"torchtitan (per block, reshard, no AC)",
                                                      "full activation checkpointing"}
    # the frontier is a Pareto set: peaks rise as step times fall
    pts = plan.frontier
    assert len(pts) >= 2
    assert all(a.peak_bytes < b.peak_bytes and a.step_time_s > b.step_time_s for a, b in zip(pts, pts[1:]))


@pytest.fixture(scope="module")
def tight_plan(trace8):
    return _plan(trace8, 1700 * MIB)


@pytest.mark.parametrize("budget_mib", [1700, 2300])
def test_chosen_plan_never_exceeds_the_budget(trace8, tight_plan, budget_mib):
    plan = tight_plan if budget_mib == 1700 else _plan(trace8, budget_mib * MIB)
    assert plan.predicted.peak_bytes <= budget_mib * MIB
    est = simulate(trace8, plan, PROFILE)
    assert est.memory.peak_bytes <= budget_mib * MIB


def test_tighter_budget_never_faster(tight_plan, roomy_plan):
    assert tight_plan.predicted.step_time_s >= roomy_plan.predicted.step_time_s


def test_infeasible_budget_names_the_smallest_that_fits(trace8):
    with pytest.raises(InfeasibleError) as info:
        _plan(trace8, 600 * MIB, allow_offload=False)
    msg = str(info.value)
    assert "no plan fits 600.00 MiB" in msg and "the smallest budget any plan needs is" in msg
    assert "micro-batch 4" in msg and "\n" not in msg
    # the budget it names does fit
    smallest = parse_bytes(msg.split("needs is ")[1].split(" (")[0])
    plan = _plan(trace8, smallest + 8 * MIB, allow_offload=False)  # + the rounding of the message's 2 decimals
    assert plan.predicted.peak_bytes <= smallest + 8 * MIB


def test_activations_dominate_advice(trace8):
    with pytest.raises(InfeasibleError, match="activations"):
        _plan(stack_trace(8, saved_per_sample=512 * MIB, input_per_sample=64 * MIB), 1 * GIB,
              allow_offload=False, micro_batch=8)


def test_fixed_overhead_over_budget_says_so(trace8):
    # The profile reserves 512 MiB (context, NCCL): no plan can fit 256 MiB, and the advice must say
    # that, not point at the largest category a plan could change.
    with pytest.raises(InfeasibleError, match="fixed overhead .* alone exceeds the budget"):
        _plan(trace8, 256 * MIB, allow_offload=False)


def test_same_inputs_same_plan(trace8, roomy_plan):
    again = _plan(trace8, 3 * GIB)
    strip = lambda p: replace(p, solver=replace(p.solver, seconds=0.0)).to_dict()  # noqa: E731
    assert strip(again) == strip(roomy_plan)


def test_search_batch_maximises_throughput():
    trace = stack_trace(3)
    plan = _plan(trace, 2 * GIB, micro_batch=None, search_batch=True, frontier_points=2)
    assert plan.training.micro_batch >= 2
    fixed = _plan(trace, 2 * GIB, micro_batch=1, frontier_points=2)
    assert plan.predicted.samples_per_s >= fixed.predicted.samples_per_s


def test_hsdp_considered_across_nodes():
    trace = stack_trace(4)
    plan = plan_model(trace, PlanRequest(gpus=32, mem_budget_bytes=4 * GIB, profile=PROFILE, gpus_per_node=8,
                      micro_batch=2, time_limit_s=5.0, frontier_points=2)).plan
    assert plan.mesh.world_size == 32 and plan.mesh.shard in (8, 32)
    assert plan.predicted.peak_bytes <= 4 * GIB


def test_cover_units_nested_and_root():
    trace, space, lm = tiny_model(n_layers=2, shard=8, max_group=1)
    nested = next(k for k, c in enumerate(space.candidates) if c.option.nested and c.start == 1)
    rest = [next(k for k, c in enumerate(space.candidates) if c.start == i and c.stop == i + 1 and c.option.in_root)
            if space.items[i].may_join_root else
            next(k for k, c in enumerate(space.candidates) if c.start == i and c.stop == i + 1) for i in range(space.n)]
    rest[1] = nested
    units = cover_units(lm, tuple(rest))
    names = [u.modules for u in units]
    assert names[0] == ("",)
    assert ("layers.0",) in names and ("layers.0.attn",) in names and ("layers.0.mlp",) in names
    assert ("embed",) not in names  # left to the root
    plan = make_plan(trace, units, lm.choice, training=Training(4), cluster=Cluster(8, 8, "test", GIB))
    assert plan.training.micro_batch == 4


# ---- the planner on traced example models: tied weights, containers without forward, consistency ----
@pytest.fixture(scope="module")
def example_traces():
    from shard_planner.trace.tracer import trace_model

    return {name: trace_model(f"examples/{name}.py") for name in ("gpt2", "llama", "unet")}


def _cpu_gloo():
    from shard_planner.hardware.profile import load_profile

    return load_profile("cpu-gloo")


def _mem_for(prof, usable_bytes):
    """The --mem whose budget the planner fills is exactly ``usable_bytes`` (it keeps the profile's
    fragmentation share of --mem free: profile.tensor_budget_bytes)."""
    mem = prof.mem_for_tensor_budget(usable_bytes)
    assert prof.tensor_budget_bytes(mem) == usable_bytes
    return mem


def _unit_of(trace, units, fqn):
    """The innermost unit holding ``fqn`` (the root unit, or None when nothing wraps it)."""
    wrapped = {m: u for u in units for m in u.modules}
    while fqn not in wrapped:
        if fqn == "":
            return None
        fqn = trace.module(fqn).parent
    return wrapped[fqn]


def _every_plans_units(trace, budgets_mib, micro_batches):
    from shard_planner.plan.recipes import RECIPES
    from shard_planner.solve.space import build_space

    prof = _cpu_gloo()
    out = [r.units(build_space(trace, shard_group=2, gpus_per_node=2)) for r in RECIPES]
    for mb in micro_batches:
        for mib in budgets_mib:
            try:
                out.append(plan_model(trace, PlanRequest(gpus=2, gpus_per_node=2, mem_budget_bytes=mib * MIB, profile=prof,
                                      micro_batch=mb, frontier_points=3)).plan.units)
            except InfeasibleError:
                pass
    return out


def test_gpt2_tied_weights_never_split(example_traces):
    from shard_planner.solve.space import build_space, splits_ties

    trace = example_traces["gpt2"]
    assert trace.module("wte").tied_with == ("lm_head",) and trace.module("lm_head").tied_with == ("wte",)
    space = build_space(trace, shard_group=2, gpus_per_node=2)
    for c in space.candidates:
        for it in space.items[c.start:c.stop]:
            assert not splits_ties(trace, it.fqn), it.fqn
            assert all(not splits_ties(trace, k) for k in it.nested_children)
    all_units = _every_plans_units(trace, (2, 3, 4, 6, 8, 12), (1, 8))
    assert len(all_units) > len(space.items) // 2  # plans were found, not only baselines
    for units in all_units:
        assert _unit_of(trace, units, "wte") is _unit_of(trace, units, "lm_head"), units


def test_containers_without_forward_are_never_units(example_traces):
    from shard_planner.solve.space import find_items

    trace = example_traces["unet"]
    never_called = {m.fqn for m in trace.modules if m.calls == 0}
    assert "downs" in never_called
    assert not {it.fqn for it in find_items(trace)} & never_called
    assert any(it.parent == "downs" for it in find_items(trace))  # its children may be units
    for units in _every_plans_units(trace, (2, 4, 8, 16, 64), (1, 4)):
        for u in units:
            for fqn in u.modules:
                assert trace.module(fqn).calls >= 1, (fqn, units)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("micro_batch", [1, 8, 16])
def test_plan_or_infeasible_is_consistent(example_traces, name, micro_batch):
    """Either a plan whose simulated peak fits, or an InfeasibleError naming a larger budget."""
    trace, prof = example_traces[name], _cpu_gloo()
    for mib in range(4, 13):
        budget = mib * MIB
        try:
            plan = plan_model(trace, PlanRequest(gpus=2, mem_budget_bytes=budget, profile=prof, micro_batch=micro_batch,
                              frontier_points=3)).plan
        except InfeasibleError as exc:
            smallest = parse_bytes(str(exc).split("needs is ")[1].split(" (")[0])
            assert smallest > budget, str(exc)
        else:  # the profile's fragmentation share of --mem stays free
            assert simulate(trace, plan, prof).memory.peak_bytes <= prof.tensor_budget_bytes(budget) < budget


def test_fitting_smallest_peak_plan_is_returned_not_refused(example_traces, monkeypatch):
    """When the budget solves find nothing (time limit, or the linear model's error exhausting the
    re-solves) but the smallest-peak plan fits in the simulators, that plan is the answer."""
    import shard_planner.solve.planner as planner

    monkeypatch.setattr(planner, "_solve_checked", lambda *a, **k: None)
    trace, prof = example_traces["gpt2"], _cpu_gloo()
    budget = _mem_for(prof, int(7.69 * MIB))  # 7.69 MiB usable (tuned to a plan's peak) + the fragmentation share
    plan = plan_model(trace, PlanRequest(gpus=2, mem_budget_bytes=budget, profile=prof, micro_batch=8, frontier_points=3)).plan
    assert simulate(trace, plan, prof).memory.peak_bytes <= prof.tensor_budget_bytes(budget)
    with pytest.raises(InfeasibleError) as info:  # below every plan's peak: still refused, with a larger budget
        plan_model(trace, PlanRequest(gpus=2, mem_budget_bytes=MIB, profile=prof, micro_batch=8, frontier_points=3)).plan
    assert parse_bytes(str(info.value).split("needs is ")[1].split(" (")[0]) > MIB


# ---- "no wrapping" and the root's reshard: candidates the program cannot express, judged by the simulators ----
def _alternatives(trace, plan, budget_bytes, prof):
    """Estimates (independent of the planner) of every plan it must beat that fits: the hand-written
    policies, the whole model as one unit (root reshard False and True), and the chosen plan with its
    root's reshard flipped."""
    from shard_planner.cost import estimate
    from shard_planner.plan import ROOT, Unit
    from shard_planner.plan.recipes import RECIPES

    space = build_space(trace, shard_group=plan.mesh.shard, gpus_per_node=plan.cluster.gpus_per_node)
    base = replace(plan, predicted=None, prefetch=Prefetch())
    alts = [replace(base, units=r.units(space)) for r in RECIPES if not r.cpu_offload]
    alts += [replace(base, units=(Unit((ROOT,), reshard_after_forward=r),)) for r in (False, True)]
    alts.append(replace(plan, predicted=None, units=tuple(
        replace(u, reshard_after_forward=u.reshard_after_forward is not True) if u.is_root else u for u in plan.units)))
    ests = [estimate(trace, p, prof) for p in alts]
    return [e for e in ests if e.memory.peak_bytes <= budget_bytes]


def _solver_and_policies_only(trace, monkeypatch, **kw):
    """The planner as it was before it judged "no wrapping" and the root's reshard: the solver's
    result against the hand-written policies."""
    import shard_planner.solve.alternatives as alternatives
    import shard_planner.solve.planner as planner

    with monkeypatch.context() as m:
        m.setattr(alternatives, "no_wrapping", lambda *a, **k: [])
        m.setattr(alternatives, "root_resharded", lambda *a, **k: [])
        m.setattr(planner, "POLISH_MAX_S", 0.0)  # nor polished its answer (a local search reaches no wrapping too)
        return plan_model(trace, PlanRequest(**kw)).plan


def test_no_wrapping_chosen_when_fastest_with_room(example_traces, monkeypatch):
    from shard_planner.cost import estimate

    trace, prof = example_traces["gpt2"], _cpu_gloo()
    usable = 64 * MIB  # --mem less the profile's fragmentation share
    kw = dict(gpus=2, gpus_per_node=2, mem_budget_bytes=_mem_for(prof, usable), profile=prof, micro_batch=1,
              frontier_points=3)
    plan = plan_model(trace, PlanRequest(**kw)).plan
    est = estimate(trace, replace(plan, predicted=None), prof)
    assert est.memory.peak_bytes == plan.predicted.peak_bytes <= usable
    assert est.time.step_time_s == pytest.approx(plan.predicted.step_time_s)
    others = _alternatives(trace, plan, usable, prof)
    assert others and plan.predicted.step_time_s <= min(e.time.step_time_s for e in others) * (1 + 1e-9)
    before = _solver_and_policies_only(trace, monkeypatch, **kw)
    assert plan.predicted.step_time_s <= before.predicted.step_time_s * (1 + 1e-9)
    # on gpt2 tiny on the cpu-gloo profile the simulators find one unit, the root kept gathered, fastest
    assert [(u.modules, u.reshard_after_forward) for u in plan.units] == [(("",), False)]
    assert plan.solver.method == "no-wrapping" and "no wrapping" in plan.solver.status
    assert plan.predicted.step_time_s < before.predicted.step_time_s


def test_no_wrapping_not_chosen_when_it_does_not_fit(example_traces, monkeypatch):
    from shard_planner.cost import estimate
    from shard_planner.plan import ROOT, Unit

    trace, prof = example_traces["gpt2"], _cpu_gloo()
    budget = 8 * MIB  # usable: --mem less the profile's fragmentation share
    kw = dict(gpus=2, gpus_per_node=2, mem_budget_bytes=_mem_for(prof, budget), profile=prof, micro_batch=8,
              frontier_points=3)
    plan = plan_model(trace, PlanRequest(**kw)).plan
    root_only = [estimate(trace, replace(plan, predicted=None, prefetch=Prefetch(),
                                         units=(Unit((ROOT,), reshard_after_forward=r),)), prof) for r in (False, True)]
    assert min(e.memory.peak_bytes for e in root_only) > budget  # the premise: no wrapping needs more
    assert len(plan.inner_units) >= 1 and plan.solver.method != "no-wrapping"
    assert estimate(trace, replace(plan, predicted=None), prof).memory.peak_bytes <= budget
    others = _alternatives(trace, plan, budget, prof)
    assert plan.predicted.step_time_s <= min(e.time.step_time_s for e in others) * (1 + 1e-9)
    before = _solver_and_policies_only(trace, monkeypatch, **kw)
    assert plan.predicted.step_time_s <= before.predicted.step_time_s * (1 + 1e-9)


def test_runners_up_are_earlier_fitting_covers():
    """CP-SAT's earlier incumbents, which the planner lets the simulators judge: exact covers that fit
    the budget, none faster than the answer by the linear model, the answer not among them."""
    from shard_planner.solve.cpsat import frugal_cover

    _, space, lm = tiny_model(n_layers=4, shard=8, max_group=2)
    # 100 MiB above the smallest peak (at +150 CP-SAT stops at its work limit 0.23% from optimal since a
    # nested unit's gradients count at its block's backward: solve/linear.py)
    budget = solve_min_peak(lm, relative_gap=0.0).objective + 100
    res = solve_min_time(lm, budget, relative_gap=0.0, hint=frugal_cover(lm))  # a slow start: it improves on it
    assert res.status == "OPTIMAL" and res.runners_up
    best = evaluate(lm, res.chosen).time_us
    for cover in res.runners_up:
        r = evaluate(lm, cover)  # raises unless an exact cover
        assert cover != res.chosen and r.peak_mib <= budget and r.time_us >= best


def test_root_reshard_follows_the_budget(example_traces):
    """The root's own reshard is a choice too: on gpt2 tiny at micro-batch 16 the whole model as one
    unit is fastest, kept gathered it needs more than 16 MiB, resharded after forward it fits; the
    planner returns the latter (one more all-gather, as the simulators say, beats any wrapping)."""
    from shard_planner.cost import estimate
    from shard_planner.plan import ROOT, Unit

    trace, prof = example_traces["gpt2"], _cpu_gloo()
    budget = 16 * MIB  # usable: --mem less the profile's fragmentation share
    plan = plan_model(trace, PlanRequest(gpus=2, gpus_per_node=2, mem_budget_bytes=_mem_for(prof, budget), profile=prof,
                      micro_batch=16, frontier_points=3)).plan
    kept = estimate(trace, replace(plan, predicted=None, units=(Unit((ROOT,), reshard_after_forward=False),)), prof)
    assert kept.memory.peak_bytes > budget  # the premise
    assert [(u.modules, u.reshard_after_forward) for u in plan.units] == [(("",), True)]
    assert "root reshard True" in plan.solver.status
    others = _alternatives(trace, plan, budget, prof)
    assert plan.predicted.step_time_s <= min(e.time.step_time_s for e in others) * (1 + 1e-9)
