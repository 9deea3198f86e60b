"""Every memo of a CostModel is keyed by the query its function takes (cost/queries.py [Note: A memo is
keyed by its function's query]): two plans that differ in one decision get, from one CostModel that
priced the first, the second's own estimate — never the first's from a key that left the field out."""

from dataclasses import replace

import pytest

from shard_planner.plan.checkpointing import SAVEABLE_OP_CLASSES, SELECTIVE
from shard_planner.cost import CostModel
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit
from shard_planner.trace import trace_model
from tests.paths import EXAMPLES


@pytest.fixture(scope="module")
def tiny():
    """A traced Llama (examples/llama.py at its default, tiny size): its blocks have the op classes that
    selective checkpointing's save list chooses among (the synthetic trace has none)."""
    return trace_model(str(EXAMPLES / "llama.py"), dtype="bfloat16")


def _plan(trace, *, reshard=True, ckpt=False, save_ops=(), mesh=Mesh(8), training=Training(1), prefetch=Prefetch(0, 1)):
    layers = [m.fqn for m in trace.modules if m.type_name in ("Block", "TransformerBlock")]
    units = (Unit(("",), False),) + tuple(Unit((fqn,), reshard, ckpt, save_ops) for fqn in layers)
    return Plan(model=ModelRef("synthetic", trace.fingerprint), cluster=Cluster(mesh.world_size, 8, "h100-80gb", 80 * 2**30),
                mesh=mesh, training=training, units=units, prefetch=prefetch)


def _variants(trace):
    """(base, the same plan with one decision changed), per dimension."""
    return {
        "reshard": (_plan(trace), _plan(trace, reshard=False)),
        "reshard to a group": (_plan(trace), _plan(trace, reshard=2)),
        "activation checkpoint": (_plan(trace), _plan(trace, ckpt=True)),
        "selective ops": (_plan(trace, ckpt=SELECTIVE, save_ops=("matmul",)),
                          _plan(trace, ckpt=SELECTIVE, save_ops=SAVEABLE_OP_CLASSES)),
        "prefetch": (_plan(trace), _plan(trace, prefetch=Prefetch(2, 2))),
        "offload": (_plan(trace), _plan(trace, training=Training(1, cpu_offload=True))),
        "accumulation": (_plan(trace), _plan(trace, training=Training(1, accumulation_steps=2))),
        "param dtype": (_plan(trace), _plan(trace, training=Training(1, param_dtype="float32"))),
        "reduce dtype": (_plan(trace), _plan(trace, training=Training(1, reduce_dtype="bfloat16"))),
        "micro-batch": (_plan(trace), _plan(trace, training=Training(2))),
        "shard group": (_plan(trace), _plan(trace, mesh=Mesh(4))),
        "replicas": (_plan(trace), _plan(trace, mesh=Mesh(8, 2))),
    }


DIMENSIONS = [
    "reshard", "reshard to a group", "activation checkpoint", "selective ops", "prefetch", "offload", "accumulation",
    "param dtype", "reduce dtype", "micro-batch", "shard group", "replicas"]


@pytest.mark.parametrize("dimension", DIMENSIONS)
def test_one_changed_decision_changes_the_cached_estimate(tiny, h100, dimension):
    base, changed = _variants(tiny)[dimension]
    shared = CostModel(tiny, h100)
    first = shared.estimate(base)
    second = shared.estimate(changed)  # every memo warm with the base plan's entries
    assert second == CostModel(tiny, h100).estimate(changed)  # what a fresh model says
    assert second != first, dimension  # the test's plans do differ in cost
    assert shared.estimate(base) == first  # and the base's entries are still its own
