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
    if plan.mesh.is_tp:  # without an mpu DeepSpeed counts every rank, tp too (report/export/deepspeed_tp.py)
        assert parsed.train_batch_size == plan.global_batch_samples * plan.mesh.tp_size and "train_batch_size" not in config
        assert any("train_batch_size is left to DeepSpeed" in n for n in exports["deepspeed"].notes)
    else:
        assert parsed.train_batch_size == plan.global_batch_samples
    assert parsed.train_micro_batch_size_per_gpu == t.micro_batch
    assert parsed.gradient_accumulation_steps == t.accumulation_steps
    assert parsed.zero_optimization_stage == 3 and parsed.bfloat16_config.enabled == (t.param_dtype == "bfloat16")
    assert parsed.optimizer_name == t.optimizer and parsed.optimizer_params["lr"] == t.lr
    # every tensor of the blocks lies above the persistence threshold: DeepSpeed partitions them (when the blocks
    # are units)
    from shard_planner.report.export import model_info_for_plan

    with llama_size("8b"):
        info = model_info_for_plan(plan)
    block_tensors = [n for m in info.modules if m.fqn.startswith("layers.") for n in m.param_numels]
    if plan.inner_units:
        assert parsed.zero_config.param_persistence_threshold < min(block_tensors)
    else:  # the root alone, kept gathered: every tensor persistent (export/deepspeed.py persistence_threshold)
        assert parsed.zero_config.param_persistence_threshold >= max(block_tensors)
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


@pytest.mark.parametrize("name", ["dp32-tp8", "hsdp2x4-tp8-plain"])
def test_deepspeed_reads_the_autotp_section(name, llama_8b_tp_exports, monkeypatch):
    """DeepSpeed parses the tensor-parallel exports (its batch check at the plan's world size: it derives
    train_batch_size over every rank) and its AutoTP config maps each of the plan's colwise and rowwise
    weights to a column and row split, the head as planned, and nothing else."""
    from deepspeed.module_inject.autotp_config import PartitionType
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime.tensor_parallel.config import get_tensor_parallel_config

    from shard_planner.parallel.tensor_parallel import Style

    plan, exports = llama_8b_tp_exports[name]
    config = json.loads(exports["deepspeed"].text)
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: plan.mesh.world_size)
    parsed = ds_config.DeepSpeedConfig(config)
    assert parsed.zero_optimization_stage == 3 and parsed.train_batch_size == plan.mesh.world_size
    tp_config = get_tensor_parallel_config(config)
    assert tp_config.autotp_size == plan.mesh.tp_size
    assert tp_config.vocab_parallel_lm_head is plan.tensor_parallel.loss_parallel
    partition = tp_config.get_partition_config_object()
    expected = {Style.COLWISE: PartitionType.COLUMN, Style.ROWWISE: PartitionType.ROW}
    for fqn, style in plan.tensor_parallel.styles_by_fqn.items():
        spec = partition.find_matching_spec(f"{fqn}.weight")
        if style.style in expected:
            assert spec.partition_type == expected[style.style], fqn
        elif style.style is Style.HEAD and not plan.tensor_parallel.loss_parallel:
            assert spec.partition_type == PartitionType.COLUMN and spec.gather_output, fqn
        else:
            assert spec is None, fqn  # norms, gathered inputs and the embedding: not split by AutoTP
    if plan.tensor_parallel.loss_parallel:
        assert partition.lm_head_patterns == ["output"]


def test_deepspeed_autotp_zero3_step_splits_as_planned(tmp_path):
    """deepspeed.initialize and one ZeRO-3 step with AutoTP (tp 2 on 2 CPU gloo ranks) of the tiny Llama, from the
    export of a plan without sequence or loss parallelism: the colwise weights are split on their output
    dimension, the rowwise on their input, the head's on the vocabulary, the embedding and norms whole."""
    from shard_planner.report.export import export_plan
    from tests.report.tp_plans import llama_tp_plan

    with llama_size("tiny"):
        plan = llama_tp_plan("tiny", shard=1, tp=2, sequence_parallel=False, loss_parallel=False, micro_batch=2)
        config = json.loads(export_plan(plan, "deepspeed").text)
    path = tmp_path / "ds_tp.json"
    path.write_text(json.dumps(config))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "SHARD_PLANNER_SIZE": "tiny", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(REPO / "tests" / "ecosystem" / "ds_tp_step.py"), LLAMA, str(path), "2"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    shapes = result["shapes"]
    assert (result["tp_world"], result["dp_world"]) == (2, 1)
    assert shapes["layers.0.attention.wq.weight"] == [32, 64] and shapes["layers.1.feed_forward.w1.weight"] == [96, 64]
    assert shapes["layers.0.attention.wo.weight"] == [64, 32] and shapes["layers.1.feed_forward.w2.weight"] == [64, 96]
    assert shapes["output.weight"] == [256, 64]  # vocabulary 512 / 2, its output gathered
    assert shapes["tok_embeddings.weight"] == [512, 64] and shapes["norm.weight"] == [64]
    assert result["loss"] == result["loss"]  # finite
