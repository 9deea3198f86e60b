"""Real FSDP2 runs on CPU/gloo: losses match a single-process run of the same model and batches, for
every kind of decision a plan makes; measurements are sane; failures end cleanly."""

import json
import os

import pytest
import torch

from shard_planner.cli.main import main as cli_main
from shard_planner.errors import RunError, UserError
from shard_planner.execute import launch_plans
from shard_planner.execute.accumulate import batch_index
from shard_planner.execute.worker import build_on_device, make_optimizer, make_step_batch
from shard_planner.plan.measurement import (Measurement, RankMemory, load_measurement, plan_fingerprint,
                                       save_measurement)
from shard_planner.model.modelfile import load_model_file
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prediction, Prefetch, Training, Unit, save_plan
from shard_planner.trace.structure import model_fingerprint
from shard_planner.model.hf import model_options

MODEL = "tests/models/exec_net.py"
FAULTY = "tests/models/exec_faulty.py"
STEPS, WARMUP = 2, 1


def make_plan(units, world_size, *, model=MODEL, replicate=1, prefetch=(0, 1), predicted=None, **training):
    fp = model_fingerprint(load_model_file(model).build())
    training = {"param_dtype": "float32", **training}
    return Plan(ModelRef(model, fp), Cluster(world_size, 8, "cpu-gloo", 2**30),
                Mesh(shard=world_size // replicate, replicate=replicate), Training(4, **training),
                tuple(units), Prefetch(*prefetch), predicted=predicted)


def reference_losses(plan: Plan, world_size: int, n_steps: int, device: str = "cpu") -> list[float]:
    """One process, no FSDP, no accumulation: the same initial weights and, per step, the mean loss over
    every rank's batch of every micro-step (the batches the run draws: execute/accumulate.py's
    batch_index), one backward, one optimizer step. On the run's device type: build_on_device seeds that
    device's generator, and CUDA's draws other initial weights than the CPU's (seen on an H200: the first
    losses 2% apart)."""
    mf = load_model_file(plan.model.path, model_options(plan.model))  # a transformers config as planned
    device = torch.device(device)
    model = build_on_device(mf, device)
    opt = make_optimizer(plan, model.parameters())
    tr = plan.training
    losses = []
    for s in range(n_steps):
        opt.zero_grad()
        batches = [make_step_batch(mf, tr.micro_batch, batch_index(tr, s, m), r, device)
                   for m in range(tr.accumulation_steps) for r in range(world_size)]
        loss = sum(mf.loss(mf.forward(model, inputs), targets) for inputs, targets in batches) / len(batches)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


BLOCKS = [f"blocks.{i}" for i in range(6)]
PLANS_2 = {
    # grouped units, reshard True/False mixed, prefetch depth 2 both ways, a checkpointed group
    "grouped+prefetch2+checkpoint": dict(units=[
        Unit(("",), False), Unit(("embed",), False), Unit(("blocks.0", "blocks.1")),
        Unit(("blocks.2", "blocks.3"), True, True), Unit(("blocks.4", "blocks.5"), False), Unit(("head",))],
        prefetch=(2, 2)),
    # one unit per block, nothing resharded, a nested unit, CPU offload, SGD with momentum
    "reshard-false+nested+offload": dict(units=[
        Unit(("",), False), *(Unit((b,), False) for b in BLOCKS), Unit(("blocks.1.mlp",), False, True)],
        cpu_offload=True, optimizer="sgd_momentum", lr=0.05),
    # the same with every unit resharded after forward: the memory comparison below
    "reshard-true+nested+offload": dict(units=[
        Unit(("",), True), *(Unit((b,), True) for b in BLOCKS), Unit(("blocks.1.mlp",), True, True)],
        cpu_offload=True, optimizer="sgd_momentum", lr=0.05),
    # bf16 compute, fp32 reduce
    "bf16": dict(units=[Unit(("",), True), *(Unit((b,), True) for b in BLOCKS)],
                 param_dtype="bfloat16", reduce_dtype="float32"),
}


@pytest.mark.multiprocess
def test_loss_matches_single_process_world_size_2():
    names = list(PLANS_2)
    plans = [make_plan(world_size=2, **PLANS_2[n]) for n in names]
    result = launch_plans(plans, steps=STEPS, warmup=WARMUP, device="cpu", timeout_s=240)
    n_steps = WARMUP + STEPS + 1  # + the storage-tracked step on CPU
    for name, plan, m in zip(names, plans, result.measurements):
        ref = reference_losses(plan, 2, n_steps)
        assert len(m.losses) == n_steps, name
        # bf16 compute vs an fp32 reference: measured 2e-4; one skipped optimizer step moves it 2e-3.
        tol = 1e-3 if name == "bf16" else 1e-5
        assert m.losses == pytest.approx(ref, rel=tol), name
        assert m.world_size == 2 and m.device == "cpu" and m.backend == "gloo", name
        assert m.memory_method == "storage-tracker" and len(m.memory) == 2, name
        assert all(r.peak_bytes > 0 and r.peak_phase in ("forward", "backward", "optimizer") for r in m.memory)
        assert len(m.step_time_s) == STEPS and m.step_time_median_s > 0, name
    # Keeping every unit unsharded after forward holds more than resharding them all: at the forward/backward
    # turn, every block's unsharded parameters are live (6 blocks x 8.4k fp32 params, 1/2 of them gathered).
    by_name = dict(zip(names, result.measurements))
    kept, resharded = by_name["reshard-false+nested+offload"], by_name["reshard-true+nested+offload"]
    assert kept.peak_bytes - resharded.peak_bytes > 4 * 8_000 * 4 / 2, (kept.peak_bytes, resharded.peak_bytes)
    assert len({m.plan_fingerprint for m in result.measurements}) == len(names)
    for pid in result.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.multiprocess
def test_loss_matches_single_process_world_size_4_int_reshard_and_hsdp():
    plans = [
        # reshard to 2 of 4 ranks after forward (a divisor of the shard group)
        make_plan([Unit(("",), False), *(Unit((b,), 2) for b in BLOCKS)], 4, prefetch=(1, 2)),
        # HSDP: replicate 2 x shard 2
        make_plan([Unit(("",), True), Unit(("blocks.0", "blocks.1", "blocks.2")), Unit(("blocks.3", "blocks.4", "blocks.5"))],
                  4, replicate=2),
    ]
    result = launch_plans(plans, steps=1, warmup=1, device="cpu", timeout_s=300)
    for plan, m in zip(plans, result.measurements):
        assert m.losses == pytest.approx(reference_losses(plan, 4, 3), rel=1e-5)
        assert (m.mesh_replicate, m.mesh_shard) == (plan.mesh.replicate, plan.mesh.shard)
    # Same weights sharded 4 ways vs 2 ways: the HSDP ranks hold more sharded state.
    flat, hsdp = result.measurements
    assert hsdp.peak_bytes > 0 and flat.peak_bytes > 0


def test_measurement_json_round_trip_and_comparison_without_overhead(tmp_path):
    m = Measurement(plan_fingerprint="f" * 16, model_path="m.py", world_size=2, mesh_shard=2, mesh_replicate=1,
                    micro_batch=4, device="cuda", device_name="GPU", backend="nccl", torch_version="2.13",
                    memory_method="cuda max_memory_allocated",
                    memory=(RankMemory(0, 900, 1000), RankMemory(1, 1100, 1200)),
                    step_time_s=(0.3, 0.1, 0.2), timing_method="cuda events", warmup_steps=1,
                    losses=(2.0, 1.5), predicted_peak_bytes=1300, predicted_step_time_s=0.25,
                    predicted_overhead_bytes=200)
    save_measurement(m, tmp_path / "measurement.json")
    back = load_measurement(tmp_path / "measurement.json")
    assert back == m
    assert (back.peak_bytes, back.reserved_bytes) == (1100, 1200)
    assert back.step_time_median_s == 0.2 and back.step_time_spread_s == pytest.approx(0.2)
    assert back.comparison() == [("peak_bytes", 1100.0, 1100.0, 0.0),
                                 ("step_time_s", 0.25, 0.2, pytest.approx(25.0))]
    with pytest.raises(UserError, match="2 ranks of memory for world size 3"):
        Measurement.from_dict({**m.to_dict(), "world_size": 3})
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(UserError, match="not valid JSON"):
        load_measurement(tmp_path / "bad.json")


def test_plan_fingerprint_ignores_where_the_model_file_is_and_predictions():
    plan = make_plan([Unit(("",))], 2)
    moved = Plan.from_dict({**plan.to_dict(), "model": {**plan.to_dict()["model"], "path": "/elsewhere/net.py"}})
    predicted = Plan.from_dict({**plan.to_dict(), "predicted": {
        "peak_bytes": 1, "step_time_s": 1.0, "memory_at_peak": {}, "samples_per_s": 1.0}})
    assert plan_fingerprint(plan) == plan_fingerprint(moved) == plan_fingerprint(predicted)
    assert plan_fingerprint(plan) != plan_fingerprint(plan.with_world_size(1))


def _write(tmp_path, plan, name="plan.json"):
    path = tmp_path / name
    save_plan(plan, path)
    return path


@pytest.mark.multiprocess
def test_cli_run_prints_predicted_vs_measured_and_writes_measurement(tmp_path, capsys):
    units = [Unit(("",), False), *(Unit((b,)) for b in BLOCKS)]
    predicted = Prediction(peak_bytes=700_000, step_time_s=0.05, memory_at_peak={}, samples_per_s=160.0)
    plan = make_plan(units, 2, model=os.path.abspath(MODEL), predicted=predicted)
    path = _write(tmp_path, plan)
    code = cli_main(["run", str(path), "--steps", "2", "--warmup", "1", "--device", "cpu", "--timeout", "120"])
    out = capsys.readouterr().out
    assert code == 0
    m = load_measurement(tmp_path / "measurement.json")
    assert m.predicted_peak_bytes == 700_000 and m.rederived_from_world_size is None
    assert "CPU" in out and "gloo" in out
    err_pct = (700_000 - m.peak_bytes) / m.peak_bytes * 100
    assert "peak memory" in out and f"{err_pct:+.1f}%" in out
    assert "step time" in out
    assert json.loads((tmp_path / "measurement.json").read_text())["summary"]["peak_bytes"] == m.peak_bytes


@pytest.mark.multiprocess
def test_cli_run_on_fewer_ranks_rederives_the_plan(tmp_path, capsys):
    units = [Unit(("",), False), Unit(("blocks.0", "blocks.1"), 2), Unit(("head",))]
    predicted = Prediction(peak_bytes=1, step_time_s=1.0, memory_at_peak={}, samples_per_s=1.0)
    # The model file given relative to the plan's folder.
    model_copy = tmp_path / "exec_net.py"
    model_copy.write_text(open(MODEL).read())
    plan = make_plan(units, 4, model=MODEL, predicted=predicted)
    plan = Plan.from_dict({**plan.to_dict(), "model": {**plan.to_dict()["model"], "path": "exec_net.py"}})
    path = _write(tmp_path, plan)
    code = cli_main(["run", str(path), "--world-size", "1", "--steps", "1", "--warmup", "0", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0
    m = load_measurement(tmp_path / "measurement.json")
    assert m.world_size == 1 and m.rederived_from_world_size == 4
    assert "re-derived: the plan is for 4 GPUs" in out
    assert m.predicted_peak_bytes != 1  # the 4-GPU prediction is not carried over: none, or re-estimated
    if m.predicted_peak_bytes is None:
        assert "no prediction for this world size" in out
    else:
        assert "re-estimated" in out


def _assert_all_ended(pids):
    assert pids
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _faulty_plan():
    return make_plan([Unit(("",), False), *(Unit((b,)) for b in BLOCKS)], 2, model=os.path.abspath(FAULTY))


@pytest.mark.multiprocess
def test_a_rank_that_raises_ends_the_run_with_its_name_and_cause(monkeypatch):
    monkeypatch.setenv("SHARD_PLANNER_TEST_FAULT", "raise@1")
    with pytest.raises(RunError) as info:
        launch_plans([_faulty_plan()], steps=3, warmup=1, device="cpu", timeout_s=120)
    assert str(info.value) == "rank 1 raised RuntimeError: injected failure in forward"
    _assert_all_ended(info.value.pids)


@pytest.mark.multiprocess
def test_cli_a_rank_out_of_memory_one_line_exit_code_and_no_measurement(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHARD_PLANNER_TEST_FAULT", "oom@0")
    path = _write(tmp_path, _faulty_plan())
    code = cli_main(["run", str(path), "--steps", "3", "--warmup", "1", "--device", "cpu", "--timeout", "120"])
    err = capsys.readouterr().err
    assert code == RunError.exit_code
    assert err.strip() == ("shard-planner: error: rank 0 out of memory: "
                           "injected: could not allocate 1073741824 bytes")
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no measurement, no partial file


@pytest.mark.multiprocess
def test_a_hanging_rank_is_named_after_the_timeout(monkeypatch):
    monkeypatch.setenv("SHARD_PLANNER_TEST_FAULT", "hang@1")
    with pytest.raises(RunError) as info:
        launch_plans([_faulty_plan()], steps=3, warmup=1, device="cpu", timeout_s=30)
    msg = str(info.value)
    assert msg.startswith("rank 1 hung: the run did not finish within --timeout 30 s"), msg
    assert "exec_faulty.py" in msg and "rank 0 waits for it in a collective" in msg, msg
    _assert_all_ended(info.value.pids)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@pytest.mark.multiprocess
@needs_cuda
def test_gpu_run_measures_the_cuda_allocator_and_matches_the_unsharded_losses():
    units = [Unit(("",), False), Unit(("blocks.0", "blocks.1")), *(Unit((b,), True, True) for b in BLOCKS[2:])]
    world_size = min(2, torch.cuda.device_count())
    plan = make_plan(units, world_size, prefetch=(1, 2))
    m = launch_plans([plan], steps=2, warmup=1, device="cuda", timeout_s=180).measurements[0]
    assert m.device == "cuda" and m.backend == "nccl" and m.timing_method == "cuda events"
    assert m.memory_method == "cuda max_memory_allocated"
    assert all(r.reserved_bytes >= r.peak_bytes > 0 for r in m.memory)
    assert m.losses == pytest.approx(reference_losses(plan, world_size, 3, "cuda"), rel=1e-3)  # fp32, no TF32


def test_reestimate_traces_in_the_plans_dtype():
    from shard_planner.cost import estimate
    from shard_planner.execute.runner import reestimate
    from shard_planner.hardware.profile import load_profile
    from shard_planner.trace import trace_model

    plan = make_plan([Unit(("",), False)], 1)  # param_dtype float32
    want = estimate(trace_model(MODEL, dtype="float32"), plan, load_profile("cpu-gloo")).prediction()
    assert reestimate(plan, MODEL) == want
