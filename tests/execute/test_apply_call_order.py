"""A unit that lists siblings in call order, not registration order (a tight BERT plan groups its
embeddings as word, token_type, position) applies and trains."""

import pytest

from shard_planner.execute import apply_plan, describe_sharding
from shard_planner.model.modelfile import load_model_file
from shard_planner.plan import Unit
from shard_planner.trace import trace_model
from tests.execute.test_run import make_plan

MODEL = "tests/models/exec_call_order.py"


def test_the_trace_sees_call_order():
    order = [f for f in trace_model(MODEL, dtype="fp32").forward_order if f.startswith("embed.")]
    assert order == ["embed.word", "embed.kind", "embed.position"]


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_a_group_in_call_order_applies_and_trains(fake_world):
    units = [Unit(("",), True), Unit(("embed.word", "embed.kind", "embed.position"), True), Unit(("head",), True)]
    plan = make_plan(units, 2, model=MODEL)
    mf = load_model_file(MODEL)
    model = apply_plan(mf.build(), plan, fake_world)
    assert {u.modules for u in describe_sharding(model)} == {u.modules for u in plan.units}
    inputs, targets = mf.batch(2)
    mf.loss(model(*inputs), targets).backward()
    assert all(p.grad is not None for p in model.parameters())

