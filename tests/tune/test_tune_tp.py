"""``tune --tp N``: the styles derived as ``plan --tp`` derives them, one rank traced at that degree, and every
candidate (the solver's plan, its re-solves, neighbours and the hand-written policies) keeping the degree; a
degree that does not divide the cluster, the runs' world or the model is one line; and one real tune of dp 2 x
tp 2 on 4 gloo ranks (~20 s on two cores), its runs' tensor-parallel collectives equal to the prediction."""

from __future__ import annotations

import pytest

from shard_planner.errors import UserError
from shard_planner.plan.measurement import Measurement, RankMemory, plan_fingerprint
from shard_planner.tune import tune_model
from tests.cli.test_bad_input import one_error_line
from tests.paths import REPO

LLAMA = str(REPO / "examples" / "llama.py")
TP_ARGS = dict(gpus=4, mem_budget_bytes=2**30, profile="cpu-gloo", world_size=4, dtype="float32", tp=2)


def fake_run_plans(plans, *, world_size, steps, warmup, timeout_s, device):
    """Synthetic runs: each plan measured 1.5 times slower than its prediction, at its predicted peak."""
    return [Measurement(
        plan_fingerprint=plan_fingerprint(p), model_path=p.model.path, world_size=world_size,
        mesh_shard=p.mesh.shard, mesh_replicate=1, mesh_tp=p.mesh.tp, micro_batch=p.training.micro_batch,
        device="cpu", device_name="synthetic", backend="gloo", torch_version="x", memory_method="storage-tracker",
        memory=tuple(RankMemory(r, p.predicted.peak_bytes) for r in range(world_size)),
        step_time_s=(1.5 * p.predicted.step_time_s,) * steps, timing_method="wall clock", warmup_steps=warmup,
        losses=(1.0,) * (steps + warmup)) for p in plans]


def recording(run_plans, ran: list):
    def run(plans, **kwargs):
        ran.extend(plans)
        return run_plans(plans, **kwargs)
    return run


def test_every_candidate_keeps_the_degree_and_its_styles():
    ran = []
    # every candidate in one launch (synthetic runs): none left out by the early stop
    result = tune_model(LLAMA, trials=40, per_launch=40, run_plans=recording(fake_run_plans, ran), **TP_ARGS)
    styles = result.plan.tensor_parallel
    assert styles is not None and styles.sequence_parallel and styles.loss_parallel
    assert "layers.0.attention.wq" in styles.styles_by_fqn
    sources = {t.candidate.source.split(" ")[0].rstrip(":") for t in result.trials}
    assert {"solver", "recipe", "prefetch"} <= sources, sources  # re-solves, neighbours, the recipes
    assert len(ran) == len(result.trials) > 5
    for p in [t.candidate.plan for t in result.trials] + ran:
        assert (p.mesh.tp, p.mesh.shard, p.tensor_parallel) == (2, 2, styles), p.mesh
    assert "x TP 2" in result.trials[0].candidate.description


def test_tp_1_is_fsdp_alone():
    result = tune_model(LLAMA, trials=2, run_plans=fake_run_plans, **dict(TP_ARGS, tp=1))
    assert result.plan.mesh.tp == 1 and result.plan.tensor_parallel is None


@pytest.mark.parametrize("args, error", [
    (["--gpus", "4", "--tp", "3"], "--tp 3 must divide the GPUs per node (64) and --gpus (4): tensor parallelism "
                                   "stays inside a node"),  # cpu-gloo's 64 per node: tune's default is plan's
    (["--gpus", "4", "--tp", "2", "--world-size", "3"], "--tp 2 must divide --world-size (3): every run keeps the "
                                                        "plan's tensor-parallel degree"),
    (["--gpus", "8", "--tp", "8", "--world-size", "8"], "--tp 8: tensor parallelism of degree 8: "
                                                        "layers.0.attention.wq holds attention heads"),
])
def test_a_degree_that_does_not_divide_is_one_line(tmp_path, capsys, args, error):
    from shard_planner.cli.main import main

    assert main(["tune", LLAMA, "--mem", "1GB", "--device", "cpu", "-o", str(tmp_path / "p.json"), *args]) == 2
    assert one_error_line(capsys).startswith(error)
    assert not (tmp_path / "p.json").exists()


def test_a_given_trace_must_be_at_the_degree():
    from shard_planner.trace import trace_model

    with pytest.raises(UserError, match="one rank at tensor-parallel degree 1, but tune was asked for --tp 2"):
        tune_model(LLAMA, trials=1, run_plans=fake_run_plans, trace=trace_model(LLAMA, dtype="float32"),
                   **TP_ARGS)


@pytest.mark.multiprocess
def test_tune_dp2_x_tp2_on_4_ranks():
    from shard_planner.execute import run_plans

    ran = []
    result = tune_model(LLAMA, trials=2, per_launch=2, steps=2, warmup=1, device="cpu", timeout_s=300,
                        run_plans=recording(run_plans, ran), **TP_ARGS)
    assert ran and all(p.mesh.tp == 2 and p.mesh.shard == 2 and p.tensor_parallel is not None for p in ran)
    assert result.plan.mesh.tp == 2 and result.plan.tensor_parallel == ran[0].tensor_parallel
    for t in result.trials:
        m = t.measurement
        assert (m.world_size, m.mesh_shard, m.mesh_tp) == (4, 2, 2)
        assert m.comm_matches, m.comm_comparison()
        assert m.comm_tp and m.comm_tp_matches, m.comm_tp_comparison()
