"""Tier 1: the parallel degrees (shard_planner.parallel.mesh.Mesh): validation, derived sizes, placement on nodes,
the plan file's JSON form (unchanged for tp == 1) and the device mesh's shape."""

import json

import pytest

from shard_planner.errors import PlanError
from shard_planner.parallel.mesh import Mesh, group_spans_nodes
from shard_planner.plan import Plan, Unit
from tests.cli.test_plan_schema import make_plan


@pytest.mark.parametrize("kwargs, message", [
    (dict(shard=0), "mesh.shard must be a positive int"),
    (dict(shard=8, replicate=0), "mesh.replicate must be a positive int"),
    (dict(shard=8, replicate=True), "mesh.replicate must be a positive int"),
    (dict(shard=8, tp=0), "mesh.tp must be a positive int"),
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
    d["mesh"].update(shard=4, tp=2)
    with pytest.raises(PlanError, match="a plan has a tensor_parallel section exactly when mesh.tp is above 1"):
        Plan.from_dict(d)


TP_STYLES = {"tok": "embedding", "layers.0.attn_norm": "norm", "layers.0.attn": "gather_input",
             "layers.0.attn.wq": "colwise", "layers.0.attn.wo": "rowwise", "out": "head"}


def test_tp_sizes_and_device_mesh():
    """tp ranks are adjacent (the last mesh dimension); FSDP2 shards over the data-parallel sub-mesh."""
    m = Mesh(shard=4, replicate=2, tp=8)
    assert (m.world_size, m.dp_size, m.shard_group_size, m.tp_size) == (64, 8, 4, 8)
    assert m.device_mesh_shape == (2, 4, 8) and m.device_mesh_dim_names == ("replicate", "shard", "tp")
    assert m.dp_mesh_dim_names == ("replicate", "shard")
    assert Mesh(shard=2, tp=2).device_mesh_shape == (2, 2) and Mesh(shard=2, tp=2).dp_mesh_dim_names == ("shard",)
    assert m.shape_text == "2x4x8" and m.description == "HSDP 2 replicas x 4 GPUs x TP 8"
    assert Mesh(shard=32, tp=8).shard_group_spans_nodes(gpus_per_node=8)  # shard ranks are 8 apart
    assert not Mesh(shard=1, tp=8).shard_group_spans_nodes(gpus_per_node=8)


def test_tp_plan_round_trip_and_checks():
    from shard_planner.parallel.tensor_parallel import Style, TensorParallel

    tp = TensorParallel(styles=dict(TP_STYLES, **{"layers.0.mlp": "gather_input:hidden_states"}))
    plan = make_plan(mesh=Mesh(shard=4, tp=2), tensor_parallel=tp, units=(Unit(("",)), Unit(("layers.0",), 2)))
    d = json.loads(plan.to_json())
    assert d["mesh"] == {"shard": 4, "replicate": 1, "tp": 2} and d["tensor_parallel"]["styles"]["out"] == "head"
    assert Plan.from_dict(d) == plan
    assert tp.style_of("layers.0.mlp").kwarg == "hidden_states" and tp.head_fqn == "out"
    assert tp.style_of("layers.0.attn.wq").style is Style.COLWISE and tp.style_of("nope") is None
    d["tensor_parallel"]["styles"]["out"] = "diagonal"
    with pytest.raises(PlanError, match="unknown tensor-parallel style 'diagonal'"):
        Plan.from_dict(d)
    with pytest.raises(PlanError, match="norm and gather_input are sequence parallelism's styles"):
        TensorParallel(styles=TP_STYLES, sequence_parallel=False)
    with pytest.raises(PlanError, match="exactly when mesh.tp is above 1"):
        make_plan(mesh=Mesh(shard=8), tensor_parallel=tp)
    assert "tensor_parallel" not in json.loads(make_plan().to_json())


def test_tp_plan_at_another_world_size():
    from shard_planner.parallel.tensor_parallel import TensorParallel

    plan = make_plan(mesh=Mesh(shard=4, tp=2), tensor_parallel=TensorParallel(styles=TP_STYLES),
                     units=(Unit(("",)), Unit(("layers.0",), 2)))
    four = plan.with_world_size(4)
    assert four.mesh == Mesh(shard=2, tp=2) and four.tensor_parallel == plan.tensor_parallel
    three = plan.with_world_size(3)
    assert three.mesh == Mesh(shard=3) and three.tensor_parallel is None


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


def test_pipeline_degree_is_validated_and_refused_above_1():
    """pp is room for pipeline stages: validated, 1 by default, refused above 1 in one PlanError line (parallel/mesh.py
    [Note: The layout's name and its pipeline degree]); plan files read and write as before it."""
    with pytest.raises(PlanError, match="mesh.pp must be a positive int"):
        Mesh(shard=8, pp=0)
    with pytest.raises(PlanError, match=r"^mesh.pp is 2: pipeline stages are not planned yet"):
        Mesh(shard=4, pp=2)
    m = Mesh(shard=8, tp=2)
    assert (m.pp_size, m.non_data_parallel_size, m.world_size) == (1, 2, 16)
    plan = make_plan(mesh=Mesh(shard=8))
    d = json.loads(plan.to_json())
    assert "pp" not in d["mesh"]
    d["mesh"]["pp"] = 1
    assert Plan.from_dict(d) == plan
    d["mesh"]["pp"] = 2
    with pytest.raises(PlanError, match="pipeline stages are not planned yet"):
        Plan.from_dict(d)


def test_layouts_of_a_world():
    """The layouts a world of ranks is planned on, built here and nowhere else."""
    from shard_planner.parallel.mesh import degree_divides

    assert Mesh.fsdp(16, tp=2) == Mesh(shard=8, tp=2) and Mesh.fsdp(8) == Mesh(shard=8)
    with pytest.raises(PlanError, match="mesh.tp 4 does not divide the 6 ranks"):
        Mesh.fsdp(6, tp=4)
    assert Mesh.per_node_hsdp(32, 8, tp=2) == Mesh(shard=4, replicate=4, tp=2)
    assert Mesh.per_node_hsdp(8, 8) is None and Mesh.per_node_hsdp(12, 8) is None
    assert Mesh.per_node_hsdp(24, 8, tp=3) is None  # a tp group would straddle two nodes
    assert Mesh(shard=4, replicate=2, tp=2).at_world_size(4) == Mesh(shard=2, tp=2)
    assert Mesh(shard=4, tp=2).at_world_size(3) == Mesh(shard=3)
    assert Mesh.tp_group(4) == Mesh(shard=1, tp=4) and Mesh.tp_group(4).world_size == 4
    assert Mesh(shard=2, tp=4).tp_share(4096) == 1024 and Mesh(shard=2).tp_share(7) == 7
    assert degree_divides(4, 8, 16) and not degree_divides(4, 8, 6)


def test_tp_group_placement():
    """tp ranks are adjacent: the group leaves a node only when the degree exceeds its GPUs."""
    assert not Mesh.tp_group(8).tp_group_spans_nodes(gpus_per_node=8)
    assert Mesh.tp_group(16).tp_group_spans_nodes(gpus_per_node=8)
    assert not Mesh(shard=4).tp_group_spans_nodes(gpus_per_node=8)  # no tp, no group
