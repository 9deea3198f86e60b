"""Frozen parameters priced as FSDP2 runs them (issue 28; docs/frozen_facts.md): all-gathered with the
others, but no gradient, reduce-scatter or optimizer state; the measured runs of docs/frozen_baseline
predicted again."""

import pytest

from shard_planner.plan.comm import ALL_GATHER, REDUCE_SCATTER
from shard_planner.cost import CostModel, estimate
from shard_planner.cost.comm_bytes import ParamShape, collective_bytes_per_step
from shard_planner.cost.queries import UnitSetting
from shard_planner.cost.unit_cost import unit_cost
from shard_planner.cost.unit_params import UnitParams
from shard_planner.plan.measurement import load_measurement
from shard_planner.plan import Mesh, Prefetch, load_plan
from shard_planner.hardware.profile import load_profile
from shard_planner.solve.choice import GlobalChoice
from shard_planner.solve.linear import build_linear_model
from shard_planner.solve.space import build_space
from shard_planner.trace import trace_model
from shard_planner.plan.numerics import Numerics
from tests.paths import REPO

MODEL = str(REPO / "examples" / "llama_lora.py")
BASELINE = REPO / "docs" / "frozen_baseline"


@pytest.fixture(scope="module")
def traces():
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        for kind in ("lora", "wq_wv", "none"):
            mp.setenv("SHARD_PLANNER_FINETUNE", kind)
            out[kind] = trace_model(MODEL, dtype="bfloat16")
    return out


@pytest.mark.parametrize("kind", ["lora", "wq_wv", "none"])
@pytest.mark.parametrize("which", ["solver", "units"])
def test_the_measured_fine_tunes_are_predicted_within_0_2_percent(traces, kind, which):
    """Measured on 2 gloo ranks (docs/frozen_baseline/run.sh); before frozen parameters were priced the
    fine-tunes were predicted +10-11% (every frozen parameter with a gradient and AdamW's states)."""
    plan = load_plan(BASELINE / f"{which}_{kind}" / "plan.json")
    measured = load_measurement(BASELINE / f"{which}_{kind}" / "measurement.json").peak_bytes
    predicted = estimate(traces[kind], plan, load_profile("cpu-gloo")).memory.peak_bytes
    assert predicted == pytest.approx(measured, rel=0.002)


def test_a_frozen_unit_is_gathered_but_reduces_nothing():
    frozen = UnitParams.of({"float32": 1000}, trainable_numel_by_dtype={})
    mixed = UnitParams.of({"bfloat16": 1000, "float32": 100}, 0, trainable_numel_by_dtype={"float32": 100})
    setting = UnitSetting(Mesh(4), Numerics("bfloat16", "float32"), "adamw", False, "fsdp2")
    h100 = load_profile("h100-80gb")
    f = unit_cost(frozen, True, setting, h100)
    assert f.bytes.all_gather_output == 2000 and f.bytes.sharded == 1000  # 1000 x bf16 gathered; fp32 / 4 kept
    assert f.bytes.rs_input == f.bytes.sharded_grad == f.bytes.unsharded_grads == f.optimizer_state_bytes == 0
    assert f.collectives.reduce_scatter_s == 0 and f.collectives.all_gather_fwd_s > 0
    m = unit_cost(mixed, True, setting, h100)
    assert m.bytes.all_gather_output == 2 * 1100  # the frozen bf16 base and the fp32 adapter cast to bf16
    assert m.bytes.rs_input == 4 * 100 and m.bytes.sharded_grad == 4 * 100 / 4
    assert m.optimizer_state_bytes == 2 * m.bytes.sharded_grad  # AdamW: two states of the trainable ones


def test_frozen_parameters_are_not_reduce_scattered(traces):
    plan = load_plan(BASELINE / "units_lora" / "plan.json")
    shapes = [(ParamShape(64, 64 * 64, "float32", trainable=False), ParamShape(8, 8 * 64, "float32"))] * len(plan.units)
    out = {c.collective: c for c in collective_bytes_per_step(plan, tuple(shapes))}
    n = len(plan.units)
    assert out[REDUCE_SCATTER].bytes == n * 8 * 64 * 4  # the trainable ones, fp32
    assert out[ALL_GATHER].bytes >= n * (64 + 8) * 64 * 2  # all of them, bf16, forward (and backward)
    frozen_only = tuple((ParamShape(64, 64 * 64, "float32", trainable=False),) for _ in plan.units)
    assert REDUCE_SCATTER not in {c.collective for c in collective_bytes_per_step(plan, frozen_only)}


def test_the_linear_model_sizes_the_sharded_state_of_trainable_parameters(traces):
    """The solver's constant memory term follows the simulators' rule: frozen parameters add their shard,
    not their gradients and AdamW's states."""
    profile = load_profile("h100-80gb")
    base = {}
    for kind in ("lora", "none"):
        trace = traces[kind]
        space = build_space(trace, shard_group=8, gpus_per_node=8, max_group_size=2)
        training = load_plan(BASELINE / f"solver_{kind}" / "plan.json").training
        lm = build_linear_model(trace, space, GlobalChoice(1, Prefetch(1, 1), Mesh(8)), training, profile,
                                CostModel(trace, profile))
        base[kind] = lm.model_bytes
        assert lm.model_bytes.sharded_grad == pytest.approx(4 * trace.trainable_param_count / 8)
    assert base["lora"].sharded > base["none"].sharded  # every parameter's shard, frozen or not, and the adapters
    assert base["lora"].sharded_grad < base["none"].sharded_grad / 40


def test_a_unit_without_a_pre_backward_is_gathered_only_when_prefetched(monkeypatch):
    """Units in forward order root, l0, l1, l2 with l0 and l1 frozen (tests/models/trace_frozen.py chain):
    l2 runs a pre-backward and prefetches l1 (depth 1); l0 is gathered by nothing in backward; at depth 2
    l2 prefetches both."""
    from shard_planner.cost.comm_bytes import gathers_in_backward
    from shard_planner.execute.comm_count import units_with_backward
    from shard_planner.model.modelfile import load_model_file
    from shard_planner.plan import Cluster, ModelRef, Plan, Training, Unit

    monkeypatch.setenv("TRACE_FROZEN_MODEL", "chain")
    monkeypatch.setenv("TRACE_FROZEN", "l0,l1")
    model = load_model_file(str(REPO / "tests" / "models" / "trace_frozen.py")).build()
    units = (Unit(("",), False), Unit(("l0",)), Unit(("l1",)), Unit(("l2",)))
    plan = Plan(ModelRef("m.py", ""), Cluster(2, 8, "cpu-gloo", 2**30), Mesh(2), Training(1, "adamw"), units,
                Prefetch(0, 1))
    has = units_with_backward(model, plan)
    assert has == (True, False, False, True)
    assert gathers_in_backward(plan, has) == (True, False, True, True)
    deep = Plan(plan.model, plan.cluster, plan.mesh, plan.training, units, Prefetch(0, 2))
    assert gathers_in_backward(deep, has) == (True, True, True, True)
    assert gathers_in_backward(plan, None) == (True,) * 4


def test_the_report_states_what_trains(traces):
    from shard_planner.report import fine_tune_text
    from shard_planner.report.rows import unit_rows
    from shard_planner.report.tables import units_table

    plan = load_plan(BASELINE / "units_lora" / "plan.json")
    text = fine_tune_text(traces["lora"])
    assert "3,584 of 167,744 parameters train" in text and "frozen" in text
    table = units_table(unit_rows(plan, traces["lora"]))
    assert (table["trainable params"] * table["count"]).sum() == traces["lora"].trainable_param_count  # per unit
    assert "trainable params" not in units_table(unit_rows(plan, traces["none"])).columns
