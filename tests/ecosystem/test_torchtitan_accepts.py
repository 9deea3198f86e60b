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
    data_parallel = plan.mesh.world_size
    global_batch = config.training.global_batch_size
    assert (global_batch if global_batch > 0 else t.micro_batch * data_parallel) == plan.global_batch_samples
    assert config.training.seq_len == plan.model.seq_len
    assert config.training.mixed_precision_param == t.param_dtype and config.training.enable_cpu_offload == t.cpu_offload
    expected = {"none": type(None), "full": FullAC.Config, "selective": SelectiveAC.Config}[ac_mode(block_units(plan))[0]]
    assert type(config.activation_checkpoint) is expected
    if any(u.activation_checkpoint is True for u in block_units(plan)):
        assert type(config.activation_checkpoint) is FullAC.Config  # a fully checkpointed block is never less
    assert all(g.optimizer_kwargs["lr"] == t.lr for g in config.optimizer.param_groups)
