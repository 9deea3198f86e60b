"""Tier 1: the plan file's schema — round-trips, validation on construction and on load."""

import json

import pytest

from shard_planner.errors import PlanError, UserError
from shard_planner.plan import (
    Cluster, FrontierPoint, Mesh, ModelRef, Plan, Prediction, Prefetch, SolverInfo, Training, Unit,
    load_plan, save_plan, with_paths_resolved,
)
from shard_planner.units import format_bytes, parse_bytes


def make_plan(**overrides) -> Plan:
    fields = dict(
        model=ModelRef("examples/llama.py", "0123456789abcdef", seq_len=64),
        cluster=Cluster(gpus=8, gpus_per_node=8, profile="h100-80gb", mem_budget_bytes=40 * 2**30),
        mesh=Mesh(shard=8),
        training=Training(micro_batch=2),
        units=(Unit(("",), reshard_after_forward=False), Unit(("layers.0", "layers.1"), 4, True), Unit(("layers.2",))),
        prefetch=Prefetch(forward=2, backward=1),
        predicted=Prediction(peak_bytes=123, step_time_s=0.5, memory_at_peak={"activations": 100, "overhead": 23},
                             samples_per_s=32.0, tokens_per_s=2048.0),
        solver=SolverInfo("cp-sat", "OPTIMAL", 0.5, 0.01),
        frontier=(FrontierPoint(123, 0.5, "chosen"),),
        baselines=(FrontierPoint(200, 0.4, "torchtitan default", fits=False),),
    )
    fields.update(overrides)
    return Plan(**fields)


def test_round_trip_exact(tmp_path):
    plan = make_plan()
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    save_plan(plan, tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json") == with_paths_resolved(plan, None)  # its model file found from here
    assert not list(tmp_path.glob(".*tmp")), "atomic write left a temporary file"


def test_contract_fields_present():
    d = json.loads(make_plan().to_json())
    for key in ("schema_version", "model", "cluster", "training", "units", "prefetch", "predicted", "solver", "frontier"):
        assert key in d
    assert set(d["model"]) >= {"path", "fingerprint"}
    assert set(d["cluster"]) >= {"gpus", "gpus_per_node", "profile", "mem_budget_bytes"}
    assert set(d["units"][1]) == {"modules", "reshard_after_forward", "activation_checkpoint"}
    assert set(d["prefetch"]) == {"forward", "backward"}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(units=(Unit(("layers.0",)),)), "exactly one unit for the root"),
        (dict(units=(Unit(("",)), Unit(("a",)), Unit(("a", "b")))), "in two units"),
        (dict(units=(Unit(("",)), Unit(("a",), 3))), "must divide the shard group"),
        (dict(units=(Unit(("",)), Unit(("a",), 8))), "must divide the shard group"),
        (dict(mesh=Mesh(shard=4)), "does not use the cluster's 8 GPUs"),
    ],
)
def test_invalid_plans_name_the_problem(overrides, message):
    with pytest.raises(PlanError, match=message):
        make_plan(**overrides)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: Unit(()), "at least one module"),
        (lambda: Unit(("", "a")), "root module must be a unit of its own"),
        (lambda: Unit(("a",), reshard_after_forward=1), "int >= 2"),
        (lambda: Prefetch(forward=-1), "prefetch.forward"),
        (lambda: Training(micro_batch=0), "micro_batch"),
        (lambda: Training(micro_batch=1, optimizer="lamb"), "optimizer must be one of"),
        (lambda: Mesh(shard=0), "mesh.shard"),
        (lambda: Prediction(1, 1.0, {"weights": 1}, 1.0), "unknown categories"),
    ],
)
def test_invalid_parts(build, message):
    with pytest.raises(PlanError, match=message):
        build()


def test_load_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        load_plan(bad)
    with pytest.raises(PlanError, match="no such plan file"):
        load_plan(tmp_path / "missing.json")
    d = json.loads(make_plan().to_json())
    del d["cluster"]
    bad.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="missing the field 'cluster'"):
        load_plan(bad)
    d = json.loads(make_plan().to_json())
    d["units"][0]["wrap"] = True
    bad.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="malformed section"):
        load_plan(bad)
    d = json.loads(make_plan().to_json())
    d["schema_version"] = 99
    bad.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="schema_version 99"):
        load_plan(bad)


def test_with_world_size_rederives():
    plan = make_plan().with_world_size(2)
    assert plan.mesh == Mesh(shard=2) and plan.cluster.gpus == 2
    assert plan.units[1].reshard_after_forward is True  # 4 no longer divides a group of 2
    assert plan.predicted is None
    plan4 = make_plan(units=(Unit(("",)), Unit(("a",), 2))).with_world_size(4)
    assert plan4.units[1].reshard_after_forward == 2


def test_byte_sizes():
    assert parse_bytes("40GB") == 40 * 2**30
    assert parse_bytes("1.5 GiB") == int(1.5 * 2**30)
    assert parse_bytes("512MB") == 512 * 2**20
    assert parse_bytes("4096") == 4096
    for bad in ("forty", "40XB", "0GB", "-1GB"):
        with pytest.raises(UserError):
            parse_bytes(bad)
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(10) == "10 B"


def test_mesh_and_throughput_read_the_same_everywhere():
    """One wording of the mesh and the throughput for the plan summary, estimate and tune's labels."""
    from dataclasses import replace

    from shard_planner.cli.plan import summary
    from shard_planner.hardware.profile import load_profile
    from shard_planner.tune.candidates import describe_plan

    assert Mesh(shard=8).description == "FSDP over 8 GPUs"
    assert Mesh(shard=1).description == "FSDP over 1 GPU"
    assert Mesh(shard=8, replicate=2).description == "HSDP 2 replicas x 8 GPUs"
    pred = make_plan().predicted
    assert pred.throughput_text == "2,048 tokens/s"
    assert replace(pred, tokens_per_s=None).throughput_text == "32.0 samples/s"
    hsdp = make_plan(cluster=Cluster(gpus=16, gpus_per_node=8, profile="h100-80gb", mem_budget_bytes=40 * 2**30),
                     mesh=Mesh(shard=8, replicate=2))
    text = summary(hsdp, load_profile("h100-80gb"))
    assert "HSDP 2 replicas x 8 GPUs" in text and "2,048 tokens/s on 16 GPUs" in text
    assert describe_plan(hsdp).endswith(", HSDP 2 replicas x 8 GPUs")


def test_at_world_size_rederives_only_another_size():
    plan = make_plan()
    assert plan.at_world_size(8) == (plan, None)
    run, was = plan.at_world_size(2)
    assert was == 8 and run == plan.with_world_size(2)
    assert run.mesh == Mesh(shard=2) and run.predicted is None
    assert run.units[1].reshard_after_forward is True  # reshard to 4 ranks does not divide 2
