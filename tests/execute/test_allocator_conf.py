"""shard_planner/hardware/allocator_conf.py: the CUDA allocator's mode a plan is made for, and what `run` gives its ranks
([Note: The allocator mode a plan runs with])."""

from __future__ import annotations

import logging
from dataclasses import replace

from shard_planner.hardware.allocator_conf import (
    EXPANDABLE_CONF, effective_conf, expandable_in, planned_expandable, rank_environment,
)
from shard_planner.execute.launch import allocator_environment
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Training, Unit


def test_the_primary_variable_wins_over_the_old_one():
    assert effective_conf({}) is None
    assert effective_conf({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) == "expandable_segments:True"
    both = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert effective_conf(both) == "max_split_size_mb:128"
    assert not planned_expandable(both)  # the setting torch reads turns them off


def test_expandable_segments_read_from_a_list_of_pairs():
    assert expandable_in("expandable_segments:True")
    assert expandable_in("max_split_size_mb:512, expandable_segments:True")
    assert not expandable_in("expandable_segments:False")
    assert not expandable_in("max_split_size_mb:512")
    assert not expandable_in(None)


def test_plan_records_the_users_mode_else_expandable_segments():
    assert planned_expandable({})
    assert not planned_expandable({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert planned_expandable({"PYTORCH_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:64"})


def test_run_sets_the_mode_unless_the_user_did():
    assert rank_environment(True, {}) == ({"PYTORCH_ALLOC_CONF": EXPANDABLE_CONF}, None)
    assert rank_environment(False, {}) == ({}, None)  # the default mode: nothing to set
    env, warning = rank_environment(True, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert env == {} and warning is None
    env, warning = rank_environment(True, {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"})
    assert env == {} and "max_split_size_mb:64" in warning and "expandable_segments:True" in warning


def _plan(expandable: bool) -> Plan:
    return Plan(ModelRef("m.py", ""), Cluster(2, 8, "h100-80gb", 2**30, expandable_segments=expandable), Mesh(2),
                Training(micro_batch=1), (Unit(("",)),))


def test_one_launch_runs_with_the_first_plans_mode(monkeypatch, caplog):
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    assert allocator_environment([_plan(True)]) == {"PYTORCH_ALLOC_CONF": EXPANDABLE_CONF}
    with caplog.at_level(logging.WARNING):
        assert allocator_environment([_plan(False), _plan(True)]) == {}
    assert "different CUDA allocator modes" in caplog.text


def test_old_plans_read_as_made_for_expandable_segments():
    d = _plan(False).to_dict()
    del d["cluster"]["expandable_segments"]
    assert Plan.from_dict(d).cluster.expandable_segments
    assert replace(_plan(False), cluster=replace(_plan(False).cluster, expandable_segments=True)) == _plan(True)
