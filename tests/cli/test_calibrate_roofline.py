"""`shard-planner calibrate --quick` on this CPU at world size 2 writes a profile that loads, validates,
carries the measured [kernels] table and the collectives' curve, and prices a plan with the roofline as
written; and profiles/cpu-gloo-roofline.toml (written by it) does the same."""

from __future__ import annotations

import pytest

from shard_planner.cost.kernels import KernelConstants
from shard_planner.hardware.profile import load_profile
from tests.paths import EXAMPLES


def _prices_with_the_roofline(profile):
    from shard_planner.cost import estimate
    from shard_planner.cost.model import CostModel
    from shard_planner.solve import PlanRequest, plan_model
    from shard_planner.trace import trace_model

    trace = trace_model(str(EXAMPLES / "gpt2.py"), dtype="float32")
    plan = plan_model(trace, PlanRequest(gpus=2, gpus_per_node=2, mem_budget_bytes=2**33, profile=profile,
                                         time_limit_s=5.0)).plan
    assert CostModel(trace, profile).kernel_module_s(plan.training.micro_batch, plan.training.numerics) is not None
    return estimate(trace, plan, profile).time.step_time_s


def _check(profile):
    assert profile.device == "cpu" and profile.compute_model == "roofline"
    kc = KernelConstants.from_table(profile.kernels)  # validates every constant
    assert 0 < kc.matmul_efficiency <= 1 and 0 < kc.memory_efficiency <= 1
    assert 0 < kc.attention_fwd_efficiency <= 1 and 0 < kc.attention_bwd_efficiency <= 1
    ic = profile.interconnect
    assert ic.intra_node_busbw_bytes_per_s > 1e6 and ic.intra_node_busbw_half_bytes >= 0 and ic.intra_node_latency_s >= 0
    assert profile.flops_per_s("float32") > 1e8 and profile.per_op_overhead_s > 0
    assert 0 < _prices_with_the_roofline(profile) < 60


def test_shipped_roofline_profile_is_usable_as_written():
    _check(load_profile("cpu-gloo-roofline"))


@pytest.mark.multiprocess
def test_quick_calibrate_writes_a_roofline_profile(tmp_path, capsys):
    from shard_planner.cli.main import main

    out = tmp_path / "quick.toml"
    assert main(["calibrate", "--quick", "--world-size", "2", "--device", "cpu", "-o", str(out)]) == 0
    text = out.read_text()
    assert "[kernels]" in text and "busbw_half_bytes" in text
    profile = load_profile(str(out))
    assert profile.name == "quick"
    _check(profile)
    # the optimizer's overhead per tensor measured over FSDP2's DTensors and over plain ones (one device)
    assert profile.per_param_tensor_optimizer_overhead_s > 0 and profile.plain_tensor_optimizer_overhead_s > 0
    assert "compute_model roofline" in capsys.readouterr().out
