"""DeepSpeed reads the exported ZeRO-3 configs with its own parser (DeepSpeedConfig, its batch check at
the plan's world size) and, in one ZeRO-3 step on CPU/gloo, partitions every block parameter: none is
left persistent (whole on every rank) by stage3_param_persistence_threshold."""

import json
import os
import subprocess
import sys

import pytest

from tests.ecosystem.conftest import INSTALL, LLAMA, PLANS_8B, llama_size
from tests.paths import REPO

pytestmark = pytest.mark.ecosystem
deepspeed = pytest.importorskip("deepspeed", reason=f"DeepSpeed: {INSTALL}")


@pytest.mark.parametrize("name", list(PLANS_8B))
def test_deepspeed_config_means_the_plan(name, llama_8b_exports, monkeypatch):
    from deepspeed.runtime import config as ds_config

    plan, exports = llama_8b_exports[name]
    config = json.loads(exports["deepspeed"].text)
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: plan.mesh.world_size)
    parsed = ds_config.DeepSpeedConfig(config)  # asserts train_batch = micro x accumulation x world
    t = plan.training
    assert parsed.train_batch_size == plan.global_batch_samples
    assert parsed.train_micro_batch_size_per_gpu == t.micro_batch
    assert parsed.gradient_accumulation_steps == t.accumulation_steps
    assert parsed.zero_optimization_stage == 3 and parsed.bfloat16_config.enabled == (t.param_dtype == "bfloat16")
    assert parsed.optimizer_name == t.optimizer and parsed.optimizer_params["lr"] == t.lr
    # every tensor of the blocks lies above the persistence threshold: DeepSpeed partitions them
    from shard_planner.report.export import model_info_for_plan

    with llama_size("8b"):
        info = model_info_for_plan(plan)
    block_tensors = [n for m in info.modules if m.fqn.startswith("layers.") for n in m.param_numels]
    assert parsed.zero_config.param_persistence_threshold < min(block_tensors)
    assert (parsed.zero_config.offload_param is not None) == t.cpu_offload


def test_deepspeed_zero3_step_partitions_every_block_parameter(tiny_llama_plan, tmp_path):
    """deepspeed.initialize and one step (world size 1 on CPU/gloo; train_batch_size rescaled to it) of the
    tiny Llama with the export of a plan whose root keeps its parameters: no block parameter persistent."""
    from shard_planner.report.export import export_plan

    with llama_size("tiny"):
        config = json.loads(export_plan(tiny_llama_plan, "deepspeed").text)
    config["train_batch_size"] //= tiny_llama_plan.mesh.world_size
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "SHARD_PLANNER_SIZE": "tiny", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(REPO / "tests" / "ecosystem" / "ds_step.py"), LLAMA, str(path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    blocks = [n for n in result["status"] if n.startswith("layers.")]
    assert blocks and not [n for n in result["persistent"] if n.startswith("layers.")]
    assert all(result["status"][n] == "NOT_AVAILABLE" for n in blocks)  # partitioned after the step
    assert result["loss"] == result["loss"]  # finite
