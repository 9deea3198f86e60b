"""Tier 1: the parallel degrees (shard_planner.mesh.Mesh): validation, derived sizes, placement on nodes,
the plan file's JSON form (unchanged for tp == 1) and the device mesh's shape."""

import json

import pytest

from shard_planner.errors import PlanError
from shard_planner.mesh import Mesh, group_spans_nodes
from shard_planner.plan import Plan
from tests.cli.test_plan_schema import make_plan


@pytest.mark.parametrize("kwargs, message", [
    (dict(shard=0), "mesh.shard must be a positive int"),
    (dict(shard=8, replicate=0), "mesh.replicate must be a positive int"),
    (dict(shard=8, replicate=True), "mesh.replicate must be a positive int"),
    (dict(shard=8, tp=0), "mesh.tp must be a positive int"),
    (dict(shard=8, tp=2), "mesh.tp must be 1: tensor parallelism is not planned yet"),
])
def test_degrees_are_checked_once_on_construction(kwargs, message):
    with pytest.raises(PlanError, match=message):
        Mesh(**kwargs)


def test_derived_sizes():
    fsdp, hsdp = Mesh(shard=8), Mesh(shard=8, replicate=4)
    assert (fsdp.world_size, fsdp.dp_size, fsdp.shard_group_size, fsdp.replicate_group_size, fsdp.tp_size) \
        == (8, 8, 8, 1, 1)
    assert (hsdp.world_size, hsdp.dp_size, hsdp.shard_group_size, hsdp.replicate_group_size) == (32, 32, 8, 4)
    assert not fsdp.is_hsdp and hsdp.is_hsdp
    assert [r for r in range(2, 10) if fsdp.is_reshard_size(r)] == [2, 4]  # 8 itself would mean True
    assert hsdp.shape_text == "4x8"


def test_placement_on_nodes():
    """Ranks numbered node by node: the shard group is contiguous, replicas stride by the shard size."""
    assert not Mesh(shard=8).shard_group_spans_nodes(gpus_per_node=8)
    assert Mesh(shard=16).shard_group_spans_nodes(gpus_per_node=8)
    assert not Mesh(shard=16).shard_group_spans_nodes(gpus_per_node=8, group_size=8)  # a reshard group of 8
    assert Mesh(shard=8, replicate=2).replicate_group_spans_nodes(gpus_per_node=8)
    assert not Mesh(shard=4, replicate=2).replicate_group_spans_nodes(gpus_per_node=8)
    assert not Mesh(shard=16).replicate_group_spans_nodes(gpus_per_node=8)  # no replicas, no group
    assert not group_spans_nodes(1, 16, 8) and group_spans_nodes(2, 8, 8)


def test_json_form_unchanged_for_tp_1(tmp_path):
    """Plans on disk keep ``mesh: {shard, replicate}``; one that writes ``tp: 1`` reads the same."""
    plan = make_plan(mesh=Mesh(shard=8))
    d = json.loads(plan.to_json())
    assert d["mesh"] == {"shard": 8, "replicate": 1}
    assert Plan.from_dict(d) == plan
    d["mesh"]["tp"] = 1
    assert Plan.from_dict(d) == plan
    d["mesh"]["tp"] = 2
    with pytest.raises(PlanError, match="mesh: mesh.tp must be 1"):
        Plan.from_dict(d)


def test_device_mesh_shape():
    assert (Mesh(shard=8).device_mesh_shape, Mesh(shard=8).device_mesh_dim_names) == ((8,), ("shard",))
    hsdp = Mesh(shard=8, replicate=2)
    assert (hsdp.device_mesh_shape, hsdp.device_mesh_dim_names) == ((2, 8), ("replicate", "shard"))


def test_ranks_per_node_and_the_node_reshard_choice():
    """The solver tries resharding to one node's ranks of a shard group that spans nodes."""
    from shard_planner.solve.space import reshard_choices

    assert Mesh(shard=16).shard_ranks_per_node(8) == 8 and Mesh(shard=4).shard_ranks_per_node(8) == 4
    assert reshard_choices(16, 8) == (True, False, 8)
    assert reshard_choices(8, 8) == (True, False) and reshard_choices(12, 8) == (True, False)
    assert reshard_choices(16, 1) == (True, False)
