"""The FSDP2 export's generated file writes the prefetch slicing out (it imports only torch): here it is
checked against the one rule, cost/fsdp2_rules.py ``explicit_prefetch`` over the executor's orders
(execute/apply.py ``prefetch_orders``), at every depth from 0 to past the number of units. The generated
``apply_sharding`` runs with a recording stand-in for ``fully_shard``: no process group, no sharding."""

import functools

import pytest
import torch.nn as nn

from shard_planner.cost import fsdp2_rules
from shard_planner.execute.apply import prefetch_orders
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit
from shard_planner.report.export import export_plan

N_BLOCKS = 5


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(N_BLOCKS))
        self.head = nn.Linear(4, 4)


def _plan(prefetch: Prefetch) -> Plan:
    """The root, the embedding, the blocks (a grouped pair, a run folded into a comprehension) and the head."""
    units = [Unit(("",), reshard_after_forward=False), Unit(("wte",)), Unit(("blocks.0", "blocks.1"), reshard_after_forward=2),
             *(Unit((f"blocks.{i}",)) for i in range(2, N_BLOCKS)), Unit(("head",), reshard_after_forward=False)]
    return Plan(ModelRef("m.py", "0" * 16), Cluster(8, 8, "h100-80gb", 2**34), Mesh(8),
                Training(micro_batch=1), tuple(units), prefetch)


def _record(lists: dict, kind: str, owner: nn.Module, modules: list) -> None:
    lists[(kind, id(owner))] = tuple(id(m) for m in modules)


def _exported_lists(plan: Plan) -> dict:
    """{(kind, id(module)): ids of the modules it prefetches} as the generated file sets them."""
    namespace: dict = {}
    exec(compile(export_plan(plan, "fsdp2").text, "apply_sharding.py", "exec"), namespace)
    lists: dict = {}

    def fully_shard(module, **_):
        for m in module if isinstance(module, list) else [module]:
            m.set_modules_to_forward_prefetch = functools.partial(_record, lists, "forward", m)
            m.set_modules_to_backward_prefetch = functools.partial(_record, lists, "backward", m)

    namespace["fully_shard"] = fully_shard
    model = _Model()
    namespace["apply_sharding"](model, mesh=None)
    return model, lists


@pytest.mark.parametrize("forward,backward", [(0, 0), (0, 1), (1, 2), (2, 1), (3, 3), (N_BLOCKS + 3, N_BLOCKS + 3)])
def test_generated_prefetch_lists_follow_the_rule(forward, backward):
    plan = _plan(Prefetch(forward, backward))
    model, lists = _exported_lists(plan)
    expected = {}
    for kind, order, depth in zip(("forward", "backward"), prefetch_orders(plan), (forward, backward)):
        handle = [id(model.get_submodule(u.modules[0])) for u in order]
        for i, owner in enumerate(handle):
            if targets := fsdp2_rules.explicit_prefetch(handle, i, depth):
                expected[(kind, owner)] = targets
    assert lists == expected
    assert bool(lists) == (forward > 0 or backward > 0)
