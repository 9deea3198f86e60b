"""``run``'s tensor-parallel comparison (Measurement.comm_tp_predicted, comm_tp_matches, comm_tp_comparison): equal
only call for call and byte for byte per group and kind; measurements written before it still load; the CLI
prints predicted beside measured. No ranks: measurements made by hand."""

import json
from dataclasses import replace

from shard_planner.cli.run import _print_comm
from shard_planner.plan.comm import FSDP, TP, GroupCollectiveBytes
from shard_planner.plan.measurement import Measurement, RankMemory
from shard_planner.parallel.mesh import Mesh

AG = GroupCollectiveBytes(TP, "tp", "all_gather", 2, 10, 10 * 4096)
RS = GroupCollectiveBytes(TP, "tp", "reduce_scatter", 2, 10, 10 * 4096)
FSDP_RS = GroupCollectiveBytes(FSDP, "shard", "reduce_scatter", 2, 3, 999)


def measured(*tp, predicted=None, same_every_step=True) -> Measurement:
    return Measurement(
        plan_fingerprint="f" * 16, model_path="m.py", world_size=4, mesh_shard=2, mesh_replicate=1, mesh_tp=2,
        micro_batch=2, device="cpu", device_name="cpu", backend="gloo", torch_version="x",
        memory_method="storage-tracker", memory=tuple(RankMemory(r, 100) for r in range(4)), step_time_s=(0.1,),
        timing_method="wall clock", warmup_steps=1, losses=(1.0, 1.0), comm_by_group=(FSDP_RS, *tp),
        comm_same_every_step=same_every_step, comm_tp_predicted=predicted)


def test_equal_only_call_for_call_and_byte_for_byte():
    assert measured(AG, RS, predicted=(AG, RS)).comm_tp_matches is True
    assert measured(AG, RS, predicted=(RS, AG)).comm_tp_matches is True  # the order does not matter
    one_call_more = replace(AG, calls=11)
    assert measured(AG, RS, predicted=(one_call_more, RS)).comm_tp_matches is False
    assert measured(AG, RS, predicted=(replace(AG, bytes=AG.bytes + 1), RS)).comm_tp_matches is False
    assert measured(AG, RS, predicted=(AG,)).comm_tp_matches is False  # a kind the prediction lacks
    assert measured(replace(AG, group="2 ranks"), RS, predicted=(AG, RS)).comm_tp_matches is False  # another group
    assert measured(AG, RS, predicted=(AG, RS), same_every_step=False).comm_tp_matches is False
    assert measured(AG, RS).comm_tp_matches is None  # no prediction
    assert measured(AG, predicted=(one_call_more, RS)).comm_tp_comparison() == [
        ("all_gather", "tp", 2, (11, 40960), (10, 40960)), ("reduce_scatter", "tp", 2, (10, 40960), None)]


def test_json_round_trips_and_old_measurements_load():
    m = measured(AG, RS, predicted=(AG, RS))
    d = json.loads(m.to_json())
    assert d["summary"]["comm_tp_matches"] is True
    assert Measurement.from_dict(d) == m
    del d["comm_tp_predicted"]  # written before the field
    old = Measurement.from_dict(d)
    assert old.comm_tp_predicted is None and old.comm_tp_matches is None and old.comm_tp == (AG, RS)


def test_run_prints_predicted_beside_measured(capsys):
    _print_comm(measured(AG, RS, predicted=(AG, RS)))
    out = capsys.readouterr().out
    assert "all-gather over tp (2 ranks)" in out and out.count("10 calls, 40.00 KiB") == 4
    assert "measured calls and bytes equal the predicted ones exactly" in out
    _print_comm(measured(AG, RS, predicted=(replace(AG, calls=11), RS)))
    out = capsys.readouterr().out
    assert "11 calls, 40.00 KiB" in out and "differ from the prediction" in out
    _print_comm(measured(AG, RS))
    assert "no prediction" in capsys.readouterr().out


def test_the_measurement_reads_its_layout_back():
    """A measurement records the layout its run ran with as mesh_* fields; Measurement.mesh is that layout,
    whose sizes ``run`` prints (the data-parallel ranks: 4 ranks / tp 2)."""
    m = measured(AG, RS)
    assert m.mesh == Mesh(shard=2, tp=2) and m.mesh.dp_size == 2 and m.mesh.world_size == m.world_size
