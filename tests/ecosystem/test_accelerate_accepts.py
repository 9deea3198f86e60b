"""Accelerate reads the exported configs as ``accelerate launch --config_file`` does (load_config_from_file,
the launch command's validation, the FSDP_* environment it prepares) and builds its FSDP2 plugin from
that environment: the plugin means the plan (reshard, checkpointing, offload, wrapped class), and its
mixed precision is what the export's note says Accelerate runs (bf16 reduce unless built in code)."""

import pytest

from tests.ecosystem.conftest import INSTALL, PLANS_8B, llama_size

pytestmark = pytest.mark.ecosystem
accelerate = pytest.importorskip("accelerate", reason=f"Accelerate: {INSTALL}")


def _launch_env(path) -> dict[str, str]:
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    load_config_from_file(str(path))  # the file's own schema (ClusterConfig)
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    return prepare_multi_gpu_env(args)


@pytest.mark.parametrize("name", list(PLANS_8B))
def test_accelerate_plugin_means_the_plan(name, llama_8b_exports, tmp_path, monkeypatch):
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    from shard_planner.report.export import model_info_for_plan
    from shard_planner.report.export.accelerate import wrap_classes
    from shard_planner.report.export.common import uniform_reshard

    plan, exports = llama_8b_exports[name]
    path = tmp_path / "accelerate.yaml"
    path.write_text(exports["accelerate"].text)
    env = _launch_env(path)
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16" and env["FSDP_VERSION"] == "2"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    units = plan.inner_units
    assert plugin.reshard_after_forward == uniform_reshard(plan)[0]  # the plan's, or true where it mixes (noted)
    assert plugin.activation_checkpointing == any(bool(u.activation_checkpoint) for u in units)
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) == plan.training.cpu_offload
    # the classes of the plan's units (the blocks, and the embeddings where a recipe made them a unit), or the
    # root alone (NO_WRAP: a plan that keeps the whole model gathered over its micro-steps)
    with llama_size("8b"):
        classes = wrap_classes(plan, model_info_for_plan(plan))[0]
    assert plugin.transformer_cls_names_to_wrap == (classes or None)
    assert not units or "TransformerBlock" in classes
    plugin.set_mixed_precision("bf16")  # what AcceleratorState does with mixed_precision: bf16
    assert plugin.mixed_precision_policy.reduce_dtype == torch.bfloat16  # the export's note says so
    assert any("Accelerate reduce-scatters them in bfloat16" in n for n in exports["accelerate"].notes)
    # the note's remedy: a plugin built in code keeps the plan's reduce dtype
    coded = FullyShardedDataParallelPlugin(
        mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    coded.set_mixed_precision("bf16")
    assert coded.mixed_precision_policy.reduce_dtype == torch.float32
    assert coded.reshard_after_forward == plugin.reshard_after_forward


@pytest.mark.parametrize("name", ["dp32-tp8", "hsdp2x4-tp8-plain"])
def test_accelerate_parallelism_config_means_the_tp_plan(name, llama_8b_tp_exports, tmp_path, monkeypatch):
    """accelerate launch reads the tensor-parallel exports; the ParallelismConfig Accelerate builds from its
    environment has the plan's sizes, its mesh is the plan's (dp_replicate, dp_shard, tp; tp last), FSDP2
    shards over the data-parallel dimensions, and the sizes multiply to the plan's processes."""
    from accelerate.parallelism_config import ParallelismConfig

    plan, exports = llama_8b_tp_exports[name]
    path = tmp_path / "accelerate.yaml"
    path.write_text(exports["accelerate"].text)
    env = _launch_env(path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true" and env["FSDP_VERSION"] == "2"
    config = ParallelismConfig()
    m = plan.mesh
    assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size) == (m.replicate, m.shard, m.tp)
    assert config.total_size == m.world_size == plan.cluster.gpus and config.tp_enabled
    names, sizes = config._get_mesh()
    assert tuple(n.replace("dp_", "") for n in names) == m.device_mesh_dim_names and sizes == m.device_mesh_shape
    assert set(config.fsdp_dim_names) <= {"dp_replicate", "dp_shard_cp"}  # FSDP2 over the dp dimensions only


def test_accelerate_reads_a_single_device_plans_config(tmp_path):
    """A single-device plan's config (report/export/single.py): one process, no distributed type, no mixed
    precision (the model is cast in the script), as Accelerate's own loader and launch validation read it."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    from shard_planner.cli.main import main
    from shard_planner.plan import load_plan
    from shard_planner.report.export import export_plan
    from tests.paths import EXAMPLES

    out = tmp_path / "plan.json"
    assert main(["plan", str(EXAMPLES / "gpt2.py"), "--gpus", "1", "--mem", "2GB", "--profile", "cpu-gloo",
                 "--engine", "single", "--no-report", "-o", str(out)]) == 0
    path = tmp_path / "accelerate.yaml"
    path.write_text(export_plan(load_plan(out), "accelerate").text)
    config = load_config_from_file(str(path))
    assert str(config.distributed_type) in ("NO", "DistributedType.NO") and config.num_processes == 1
    assert str(config.mixed_precision) == "no"
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "x.py"]))
    assert not args.multi_gpu and args.num_processes == 1
