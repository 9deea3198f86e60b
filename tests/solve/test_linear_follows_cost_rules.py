"""The solver's linear model and the simulators call the same FSDP2 rules (issue 27 item 2): change one
rule in its one place (cost/optimizer.py, cost/reshard.py, cost/unit_collectives.py, cost/unit_bytes.py,
and FSDP2's per-unit rules in cost/fsdp2_rules.py: the 1/N shard, the prefetch depth and targets, the
collectives of each reshard policy) and both follow, by the same amount; the executor follows the
prefetch rules too (issue 37 item 4)."""

import dataclasses

import pytest

from shard_planner.cost import CostModel, EventKind
from shard_planner.cost.schedule import Phase
from shard_planner.cost import fsdp2_rules
from shard_planner.cost import optimizer as optimizer_rules
from shard_planner.cost.unit_cost import unit_bytes_rules
from shard_planner.cost import unit_collectives as collective_rules
from shard_planner.plan import Cluster, Mesh, Prefetch, Training
from shard_planner.solve import linear
from shard_planner.solve.candidate_costs import candidate_costs
from shard_planner.solve.choice import GlobalChoice
from shard_planner.solve.linear import MIB, US_PER_S, build_linear_model, evaluate
from shard_planner.solve.simulate import cover_units, make_plan
from shard_planner.solve.space import build_space
from tests.models import solve_traces

EXTRA_BYTES = 10 * 1024 * MIB  # 10 GiB: far above everything else, so the peak moves by exactly this


def _both(profile, training: Training, choice: GlobalChoice):
    """The simulators' estimate of one plan and the linear model it was covered from, each with a fresh
    CostModel (no memo from before a patch)."""
    trace = solve_traces.stack_trace(4)
    space = build_space(trace, shard_group=choice.mesh.shard, gpus_per_node=8, max_group_size=4)
    lm = build_linear_model(trace, space, choice, training, profile, CostModel(trace, profile))
    return CostModel(trace, profile).estimate(_plan_of(lm, profile, training), timeline=False), lm


def _plan_of(lm, profile, training):
    """The plan of ``lm``'s one-unit-per-item cover."""
    choice = lm.choice
    return make_plan(solve_traces.stack_trace(4), cover_units(lm, _one_unit_per_item(lm)), choice, training=training,
                     cluster=Cluster(choice.mesh.world_size, 8, profile.name, 80 * 2**30))


def _one_unit_per_item(lm) -> tuple[int, ...]:
    """The cover of ``lm`` with one unit per item, each resharded after forward (True), no checkpointing."""
    return tuple(k for k, c in enumerate(lm.space.candidates) if c.stop - c.start == 1
                 and c.option.reshard_after_forward is True and not c.option.activation_checkpoint
                 and not c.option.in_root and not c.option.nested)


@pytest.fixture
def setup():
    training = Training(1, "adamw", "bfloat16")
    return solve_traces.profile(), training, GlobalChoice(1, Prefetch(1, 1), Mesh(8, 1))


def test_optimizer_temporaries_rule_moves_both(setup, monkeypatch):
    profile, training, choice = setup
    rule = optimizer_rules.optimizer_temporaries_bytes
    monkeypatch.setattr(optimizer_rules, "optimizer_temporaries_bytes", lambda *a: rule(*a) + EXTRA_BYTES)
    est, lm = _both(profile, training, choice)  # the step is the peak now
    monkeypatch.setattr(optimizer_rules, "optimizer_temporaries_bytes", lambda *a: rule(*a) + 2 * EXTRA_BYTES)
    est2, lm2 = _both(profile, training, choice)
    assert est.memory.peak_event == est2.memory.peak_event == "optimizer step"
    assert est2.memory.peak_bytes - est.memory.peak_bytes == EXTRA_BYTES
    assert lm2.optimizer_mib - lm.optimizer_mib == EXTRA_BYTES // MIB
    assert lm2.base_mib == lm.base_mib and lm2.coeffs == lm.coeffs


def test_optimizer_state_rule_moves_both(setup, monkeypatch):
    profile, training, choice = setup
    est, lm = _both(profile, training, choice)
    rule = optimizer_rules.optimizer_state_bytes
    monkeypatch.setattr(optimizer_rules, "optimizer_state_bytes", lambda *a: rule(*a) + EXTRA_BYTES)
    est2, lm2 = _both(profile, training, choice)
    assert est2.memory.peak_bytes - est.memory.peak_bytes == EXTRA_BYTES  # live at every event
    assert est2.memory.memory_at_peak["optimizer_states"] - est.memory.memory_at_peak["optimizer_states"] == EXTRA_BYTES
    assert lm2.base_mib - lm.base_mib == EXTRA_BYTES // MIB
    assert lm2.optimizer_mib - lm.optimizer_mib == EXTRA_BYTES // MIB


def test_state_on_device_rule_moves_both(setup, monkeypatch):
    """CPU offload on a GPU takes the sharded state off the device, in both; the rule patched to keep it
    there puts it back in both."""
    profile, training, choice = setup
    offload = GlobalChoice(1, Prefetch(1, 1), Mesh(8, 1), cpu_offload=True)
    est_on, lm_on = _both(profile, training, choice)
    est_off, lm_off = _both(profile, training, offload)
    assert est_off.memory.memory_at_peak["optimizer_states"] == 0 and lm_off.base_mib < lm_on.base_mib
    monkeypatch.setattr(optimizer_rules, "state_on_device", lambda cpu_offload, device: True)
    est_kept, lm_kept = _both(profile, training, offload)
    assert est_kept.memory.memory_at_peak["optimizer_states"] == est_on.memory.memory_at_peak["optimizer_states"] > 0
    assert lm_kept.base_mib == lm_on.base_mib and lm_kept.optimizer_mib == lm_on.optimizer_mib


def test_optimizer_step_time_rule_moves_both(setup, monkeypatch):
    profile, training, choice = setup
    est, lm = _both(profile, training, choice)
    rule = optimizer_rules.optimizer_step_s
    monkeypatch.setattr(optimizer_rules, "optimizer_step_s", lambda *a: rule(*a) + 1.0)
    est2, lm2 = _both(profile, training, choice)
    assert est2.time.optimizer_s - est.time.optimizer_s == pytest.approx(1.0)
    assert est2.time.step_time_s - est.time.step_time_s == pytest.approx(1.0)
    assert lm2.const_time_us - lm.const_time_us == pytest.approx(US_PER_S, abs=1)


def _slower_reduce_scatter(monkeypatch, rule, extra_s: float) -> None:
    """The per-unit collective rule (``rule``, the unpatched one), each unit's reduce-scatter ``extra_s`` slower."""
    monkeypatch.setattr(collective_rules, "unit_collectives", lambda *a: dataclasses.replace(
        rule(*a), reduce_scatter_s=rule(*a).reduce_scatter_s + extra_s))


def test_unit_collectives_rule_moves_both(setup, monkeypatch):
    """Each unit's reduce-scatter 1 s slower, then 2 s (far above the compute, so every one is exposed at
    both): one more second per unit in the simulated step and in the linear model's step of the same cover,
    its root unit included."""
    profile, training, choice = setup
    rule = collective_rules.unit_collectives
    _slower_reduce_scatter(monkeypatch, rule, 1.0)
    est, lm = _both(profile, training, choice)
    _slower_reduce_scatter(monkeypatch, rule, 2.0)
    est2, lm2 = _both(profile, training, choice)
    n_units = len(est.time.units)  # the cover's units and the root
    assert n_units == len(_one_unit_per_item(lm)) + 1
    assert est2.time.comm_s - est.time.comm_s == pytest.approx(n_units)
    assert est2.time.step_time_s - est.time.step_time_s == pytest.approx(n_units)
    assert lm2.const_time_us - lm.const_time_us == pytest.approx(US_PER_S, abs=1)  # the root's
    cover = _one_unit_per_item(lm)
    assert (evaluate(lm2, cover).time_us - evaluate(lm, cover).time_us
            == pytest.approx(n_units * US_PER_S, abs=n_units))
    assert est2.memory == est.memory and lm2.base_mib == lm.base_mib


def test_unit_bytes_rule_moves_both(setup, monkeypatch):
    """Each unit's sharded parameters counted twice (the per-unit bytes rule, cost/unit_bytes.py, through
    the per-unit cost query): the simulated sharded parameters grow by the model's sharded bytes, and so
    does the linear model's base (it sizes the sharded state as the whole model's unit)."""
    profile, training, choice = setup
    est, lm = _both(profile, training, choice)
    rule = unit_bytes_rules.unit_bytes_of
    monkeypatch.setattr(unit_bytes_rules, "unit_bytes_of", lambda *a: dataclasses.replace(
        rule(*a), sharded=2 * rule(*a).sharded))
    est2, lm2 = _both(profile, training, choice)
    grew = est2.memory.memory_at_peak["sharded_params"] - est.memory.memory_at_peak["sharded_params"]
    assert grew == lm.model_bytes.sharded > 50 * MIB
    assert lm2.base_mib - lm.base_mib == pytest.approx(grew / MIB, abs=1)
    assert lm2.optimizer_mib - lm.optimizer_mib == pytest.approx(grew / MIB, abs=1)


# ---- FSDP2's per-unit rules (cost/fsdp2_rules.py, issue 37 item 4): the simulators, the linear model, the
# executor and run's byte count call each one; the FSDP2 export's copy is tests/report/test_export_rules.py ----

def test_prefetch_depth_rule_moves_both(setup, monkeypatch):
    """FSDP2's effective depth at least 2 (instead of max(1, k)): at depth 1 the schedule's and the linear
    model's windows both widen to 2, and both peaks rise by the same one more prefetched all-gather output."""
    profile, training, choice = setup
    est, lm = _both(profile, training, choice)
    cover = _one_unit_per_item(lm)
    peak_mib, depth = evaluate(lm, cover).peak_mib, lm.backward_depth
    monkeypatch.setattr(fsdp2_rules, "effective_prefetch_depth", lambda depth: max(2, depth))
    est2, lm2 = _both(profile, training, choice)
    plan = _plan_of(lm2, profile, training)
    schedule = CostModel(solve_traces.stack_trace(4), profile).schedule(plan.units, plan.prefetch)
    assert (schedule.forward_depth_effective, schedule.backward_depth) == (2, 2)
    assert (depth, lm2.backward_depth) == (1, 2)
    sim_rise_mib = (est2.memory.peak_bytes - est.memory.peak_bytes) / MIB
    assert sim_rise_mib > 10
    assert evaluate(lm2, cover).peak_mib - peak_mib == pytest.approx(sim_rise_mib, abs=1)


class _Handle:
    """A stand-in for a unit's FSDPModule: records the prefetch lists the executor sets."""

    def __init__(self, name: str, lists: dict):
        self.name, self.lists = name, lists

    def set_modules_to_forward_prefetch(self, modules):
        self.lists[("forward", self.name)] = tuple(m.name for m in modules)

    def set_modules_to_backward_prefetch(self, modules):
        self.lists[("backward", self.name)] = tuple(m.name for m in modules)


def _executor_lists(plan) -> dict:
    from shard_planner.execute import apply

    lists: dict = {}
    apply._set_prefetch(plan, {m: _Handle(u.name, lists) for u in plan.units for m in u.modules})
    return lists


def _prefetches(setup, choice) -> tuple:
    """The one-unit-per-item cover's plan, its schedule's explicit forward prefetches ((unit, unit it
    prefetches), in unit indices; the forward order) and the lists the executor sets for it."""
    profile, training, _ = setup
    _, lm = _both(profile, training, choice)
    plan = _plan_of(lm, profile, training)
    s = CostModel(solve_traces.stack_trace(4), profile).schedule(plan.units, plan.prefetch)
    issued, issuer = set(), None
    for e in s.events:
        if e.kind is EventKind.PRE_FORWARD:
            issuer = e.unit
        elif e.kind is EventKind.ALL_GATHER and e.phase is Phase.FORWARD and not e.implicit:
            issued.add((issuer, e.unit))
    return plan, issued, s.forward_units, _executor_lists(plan)


def test_prefetch_targets_rule_moves_schedule_and_executor(setup, monkeypatch):
    """The explicit prefetch list (the next k units of the order) read as "the next k after skipping one":
    the schedule's all-gathers and the lists the executor sets both follow."""
    _, _, choice = setup
    deep = dataclasses.replace(choice, prefetch=Prefetch(2, 2))
    plan, before, order, executor_before = _prefetches(setup, deep)
    assert before == {(u, v) for i, u in enumerate(order) for v in order[i + 1: i + 3]}
    rule = fsdp2_rules.explicit_prefetch
    monkeypatch.setattr(fsdp2_rules, "explicit_prefetch", lambda order, i, depth: rule(order, i + 1, depth))
    plan2, after, order2, executor_after = _prefetches(setup, deep)
    assert plan2 == plan and order2 == order
    assert after == {(u, v) for i, u in enumerate(order) for v in order[i + 2: i + 4]}
    names = {"forward": [plan.root.name, *(u.name for u in plan.inner_units)],
             "backward": [u.name for u in reversed(plan.inner_units)]}
    for lists, skip in ((executor_before, 1), (executor_after, 2)):
        assert lists == {(phase, u): tuple(names[phase][i + skip: i + skip + 2]) for phase, units in names.items()
                         for i, u in enumerate(units) if units[i + skip: i + skip + 2]}


def test_shard_bytes_rule_moves_both(setup, monkeypatch):
    """One rank's 1/N of a sharded buffer counted twice (cost/fsdp2_rules.py ``shard_bytes``): the simulated
    sharded parameters and the linear model's base grow by the same bytes; under HSDP the replicas'
    all-reduce of the 1/N output (cost/collectives.py) takes longer in both."""
    profile, training, choice = setup
    est, lm = _both(profile, training, choice)
    rule = fsdp2_rules.shard_bytes
    monkeypatch.setattr(fsdp2_rules, "shard_bytes", lambda *a: 2 * rule(*a))
    est2, lm2 = _both(profile, training, choice)
    grew = est2.memory.memory_at_peak["sharded_params"] - est.memory.memory_at_peak["sharded_params"]
    assert grew == lm.model_bytes.sharded > 50 * MIB
    assert lm2.model_bytes.sharded == 2 * lm.model_bytes.sharded
    assert lm2.base_mib - lm.base_mib >= grew / MIB - 1
    # HSDP over a slow network, where every collective is exposed
    slow, hsdp = solve_traces.profile(busbw=1e9), GlobalChoice(1, Prefetch(1, 1), Mesh(4, 2))
    monkeypatch.setattr(fsdp2_rules, "shard_bytes", rule)
    est_h, lm_h = _both(slow, training, hsdp)
    monkeypatch.setattr(fsdp2_rules, "shard_bytes", lambda *a: 2 * rule(*a))
    est_h2, lm_h2 = _both(slow, training, hsdp)
    cover = _one_unit_per_item(lm_h)
    assert est_h2.time.comm_s > est_h.time.comm_s
    assert evaluate(lm_h2, cover).time_us > evaluate(lm_h, cover).time_us


def test_reshard_collectives_rule_moves_both(setup, monkeypatch):
    """No backward all-gather for any policy (cost/fsdp2_rules.py ``unit_collectives_of``): the simulated
    communication and the linear model's step both shrink, by one all-gather per unit that resharded."""
    profile, training, choice = setup
    est, lm = _both(profile, training, choice)
    rule = fsdp2_rules.unit_collectives_of
    monkeypatch.setattr(fsdp2_rules, "unit_collectives_of", lambda r, n: tuple(
        c for c in rule(r, n) if not (c.collective == "all_gather" and c.backward)))
    est2, lm2 = _both(profile, training, choice)
    cover = _one_unit_per_item(lm)
    resharded = [u for u in est.time.units if u.name != "<root>"]
    assert est.time.comm_s - est2.time.comm_s == pytest.approx(sum(u.all_gather_s for u in resharded) / 2)
    assert evaluate(lm2, cover).time_us < evaluate(lm, cover).time_us
    assert est2.memory == est.memory


@pytest.mark.parametrize("reshard,collectives", [(True, 3), (8, 3), (False, 2)])
def test_tie_break_counts_each_policys_collectives(setup, reshard, collectives):
    """The linear model's tie-break (1 µs per collective) counts the collectives FSDP2 issues per unit:
    forward all-gather, reduce-scatter and, for True and an int r alike, the backward all-gather
    (cost/fsdp2_rules.py [Note: The collectives of each reshard policy]). Before issue 37 it gave an int r
    two. 16 ranks on nodes of 8: the space offers True, False and 8 (solve/space.py ``reshard_choices``)."""
    profile, training, _ = setup
    choice = GlobalChoice(1, Prefetch(1, 1), Mesh(16, 1))
    trace = solve_traces.stack_trace(4)
    space = build_space(trace, shard_group=16, gpus_per_node=8, max_group_size=4)
    costs = candidate_costs(trace, space, linear.unit_setting(choice, training), profile)
    ch = linear._choice_terms(space, choice, costs)
    checked = 0
    for k, c in enumerate(space.candidates):
        r = c.option.reshard_after_forward
        if c.option.in_root or r != reshard or type(r) is not type(reshard):
            continue
        parts = costs.parts[k]
        comm = sum(p.collectives.all_gather_fwd_s + p.collectives.all_gather_bwd_s + p.collectives.reduce_scatter_s
                   + p.collectives.replica_all_reduce_s for p in parts)
        # no compute to hide behind: every collective is exposed, and the tie-break on top
        exposed = linear._exposed_comm_s(c, parts, costs.whole[k], 0.0, 0.0, ch)
        assert exposed - comm == pytest.approx(linear.TIE_BREAK_S_PER_COLLECTIVE * len(parts) * collectives, abs=1e-12)
        checked += 1
    assert checked
