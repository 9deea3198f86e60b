"""cost/comm_bytes.py: the bytes of FSDP2's collectives per step, by hand on tiny parameter lists (the
real-run equality with the counted bytes is tests/execute/test_comm_count.py)."""

import pytest

from shard_planner.plan.comm import CollectiveBytes
from shard_planner.cost.comm_bytes import ParamShape, collective_bytes_per_step
from shard_planner.cost.fsdp2_rules import padded_numel
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit

F32 = "float32"


def plan_of(units, shard, replicate=1, **training):
    training = {"param_dtype": F32, "reduce_dtype": F32, **training}
    return Plan(ModelRef("m.py", "0" * 16), Cluster(shard * replicate, 8, "cpu-gloo", 2**30),
                Mesh(shard=shard, replicate=replicate), Training(4, **training), tuple(units), Prefetch(0, 1))


def as_dict(result):
    return {(c.collective, c.group_size): (c.calls, c.bytes) for c in result}


def test_padding_is_dim0_rounded_up_to_the_shard_group():
    assert padded_numel(5, 15, 2) == 6 * 3  # ceil(5/2)=3 rows per rank, 2 ranks, 3 columns
    assert padded_numel(5, 15, 4) == 8 * 3
    assert padded_numel(8, 16, 4) == 16  # divisible: no padding
    assert padded_numel(0, 0, 2) == 0


def test_reshard_true_gathers_twice_false_once_each_unit_reduce_scatters_once():
    plan = plan_of([Unit(("",), False), Unit(("a",), True), Unit(("b",), True)], 2)
    params = ((ParamShape(5, 15, F32),), (ParamShape(4, 8, F32),), ())  # unit b owns nothing: no collective
    got = as_dict(collective_bytes_per_step(plan, params))
    # root: 18 elements once (kept after forward); a: 8 elements in forward and again in backward
    assert got == {("all_gather", 2): (3, 18 * 4 + 2 * 8 * 4), ("reduce_scatter", 2): (2, 18 * 4 + 8 * 4)}


def test_int_reshard_gathers_backward_over_the_smaller_group():
    plan = plan_of([Unit(("",), False), Unit(("a",), 2), Unit(("b",), True)], 4)
    p = (ParamShape(5, 15, F32),)  # 24 padded elements over 4 ranks
    got = as_dict(collective_bytes_per_step(plan, ((), p, p)))
    assert got == {("all_gather", 2): (1, 96), ("all_gather", 4): (3, 3 * 96), ("reduce_scatter", 4): (2, 2 * 96)}


def test_mixed_precision_gathers_in_the_param_dtype_and_reduces_in_the_reduce_dtype():
    plan = plan_of([Unit(("",), True)], 2, param_dtype="bfloat16", reduce_dtype=F32)
    got = as_dict(collective_bytes_per_step(plan, ((ParamShape(4, 8, F32), ParamShape(3, 3, "int64")),)))
    # bf16: 8 x 2 bytes; the int64 parameter is gathered in its own dtype (4 padded elements) and not reduced
    assert got == {("all_gather", 2): (2, 2 * (8 * 2 + 4 * 8)), ("reduce_scatter", 2): (1, 8 * 4)}


def test_hsdp_all_reduces_the_reduce_scatter_output_across_replicas():
    p = ((ParamShape(5, 15, F32),),)
    got = as_dict(collective_bytes_per_step(plan_of([Unit(("",), True)], 2, replicate=3), p))
    assert got == {("all_gather", 2): (2, 2 * 72), ("reduce_scatter", 2): (1, 72), ("all_reduce", 3): (1, 36)}
    # one rank per shard group: nothing gathered or reduce-scattered, the whole gradient all-reduced
    got = as_dict(collective_bytes_per_step(plan_of([Unit(("",), True)], 1, replicate=2), p))
    assert got == {("all_reduce", 2): (1, 60)}


def test_zero_d_parameters_are_all_reduced_over_each_mesh_dimension():
    scalar = (ParamShape(1, 1, F32),)
    got = as_dict(collective_bytes_per_step(plan_of([Unit(("",), False)], 2), ((),), scalar))
    assert got == {("all_reduce", 2): (1, 4)}
    got = as_dict(collective_bytes_per_step(plan_of([Unit(("",), False)], 2, replicate=2), ((),), scalar))
    assert got == {("all_reduce", 2): (2, 8)}


def test_results_are_sorted_and_checked():
    plan = plan_of([Unit(("",), True)], 2, replicate=2)
    result = collective_bytes_per_step(plan, ((ParamShape(2, 2, F32),),))
    assert [(c.collective, c.group_size) for c in result] == sorted((c.collective, c.group_size) for c in result)
    with pytest.raises(ValueError):
        collective_bytes_per_step(plan, ())
    with pytest.raises(ValueError):
        CollectiveBytes("broadcast", 2, 1, 4)
