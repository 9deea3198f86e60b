"""torchtitan 0.3's ConfigManager loads the exported config module (--module/--config, plus a typed
command-line override) on top of torchtitan's own llama3_8b: the parsed config has the plan's degrees,
reshard policy, checkpointing mode, batch, mixed precision, offload and learning rate."""

import sys

import pytest

from tests.ecosystem.conftest import INSTALL, PLANS_8B

pytestmark = pytest.mark.ecosystem
torchtitan = pytest.importorskip("torchtitan", reason=f"torchtitan: {INSTALL}")


@pytest.mark.parametrize("name", list(PLANS_8B))
def test_torchtitan_parses_the_plan(name, llama_8b_exports, tmp_path, monkeypatch):
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    from shard_planner.report.export.common import block_units
    from shard_planner.report.export.torchtitan import ac_mode

    plan, exports = llama_8b_exports[name]
    module = f"shard_planner_torchtitan_{name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(exports["torchtitan"].text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SHARD_PLANNER_BASE_CONFIG", "llama3:llama3_8b")
    config = ConfigManager().parse_args(["--module", module, "--config", "shard_planner_plan", "--training.steps", "3"])
    sys.modules.pop(module, None)
    t = plan.training
    assert config.parallelism.data_parallel_shard_degree == plan.mesh.shard
    assert config.parallelism.data_parallel_replicate_degree == plan.mesh.replicate
    assert config.parallelism.fsdp_reshard_after_forward in ("always", "never")
    assert config.training.local_batch_size == t.micro_batch and config.training.steps == 3
    data_parallel = plan.mesh.dp_size  # torchtitan's batch degree: dp_replicate x dp_shard
    global_batch = config.training.global_batch_size
    assert (global_batch if global_batch > 0 else t.micro_batch * data_parallel) == plan.global_batch_samples
    assert config.training.seq_len == plan.model.seq_len
    assert config.training.mixed_precision_param == t.param_dtype and config.training.enable_cpu_offload == t.cpu_offload
    expected = {"none": type(None), "full": FullAC.Config, "selective": SelectiveAC.Config}[ac_mode(block_units(plan))[0]]
    assert type(config.activation_checkpoint) is expected
    if any(u.activation_checkpoint is True for u in block_units(plan)):
        assert type(config.activation_checkpoint) is FullAC.Config  # a fully checkpointed block is never less
    assert all(g.optimizer_kwargs["lr"] == t.lr for g in config.optimizer.param_groups)


def test_torchtitan_parses_the_tp_plan(llama_8b_tp_exports, tmp_path, monkeypatch):
    """dp 32 x tp 8 on 256 GPUs: torchtitan reads the plan's tensor-parallel degree, sequence parallelism and
    async TP off, and its ParallelDims accepts the degrees at the plan's world size (dp x tp == WORLD_SIZE)."""
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims

    plan, exports = llama_8b_tp_exports["dp32-tp8"]
    (tmp_path / "shard_planner_torchtitan_tp.py").write_text(exports["torchtitan"].text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SHARD_PLANNER_BASE_CONFIG", "llama3:llama3_8b")
    config = ConfigManager().parse_args(["--module", "shard_planner_torchtitan_tp", "--config", "shard_planner_plan"])
    sys.modules.pop("shard_planner_torchtitan_tp", None)
    p = config.parallelism
    assert (p.data_parallel_shard_degree, p.data_parallel_replicate_degree, p.tensor_parallel_degree) == (32, 1, 8)
    assert p.enable_sequence_parallel is True and config.compile.enable_async_tensor_parallel is False
    dims = ParallelDims.from_config(p, world_size=plan.mesh.world_size)  # asserts the product is the world
    assert (dims.dp_shard, dims.tp, dims.world_size) == (32, 8, 256)
    assert not any("not torchtitan's Llama split" in n for n in exports["torchtitan"].notes)
    with pytest.raises(AssertionError, match="Invalid parallel dims"):  # the check would catch a wrong degree
        ParallelDims.from_config(p, world_size=plan.mesh.dp_size)
