"""Exports of tensor-parallel plans (issue 30): each export states the plan's tensor parallelism (degree, the
data-parallel degrees over GPUs / tp, sequence and loss parallelism, the styles) or says in one line what its
target cannot express. The Llama example's plans, by hand (tests/report/tp_plans.py)."""

import json
from dataclasses import replace

import pytest

from shard_planner.report.export import export_plan, model_info_for_plan
from shard_planner.parallel.tensor_parallel import Style, TensorParallel
from tests.ecosystem.conftest import llama_size
from tests.report.tp_plans import llama_tp_plan


@pytest.fixture(scope="module")
def plan_8b():
    """dp 32 x tp 8 on 256 GPUs, torchtitan's Llama styles, sequence and loss parallelism."""
    return llama_tp_plan("8b")


def _exec(text: str) -> dict:
    namespace: dict = {}
    exec(compile(text, "export.py", "exec"), namespace)
    return namespace


# ---- fsdp2 ----

@pytest.mark.parametrize("sequence_parallel", [True, False])
@pytest.mark.parametrize("loss_parallel", [True, False])
def test_fsdp2_snippet_styles_are_the_executors(sequence_parallel, loss_parallel):
    """The snippet's _parallel_style builds, for every style, the ParallelStyle execute/tensor_parallel.py's
    torch_style builds (same class, same layouts), and TP_STYLES is the plan's styles."""
    from shard_planner.execute.tensor_parallel import torch_style

    styles = {"emb": "embedding", "n": "norm", "a": "gather_input", "b": "gather_input:hidden_states", "q": "colwise",
              "o": "rowwise", "out": "head", "qn": "grad_all_reduce"}
    if not sequence_parallel:
        styles = {f: s for f, s in styles.items() if not s.startswith(("norm", "gather_input"))}
    plan = llama_tp_plan("tiny", shard=2, tp=2, styles=styles, sequence_parallel=sequence_parallel,
                         loss_parallel=loss_parallel)
    ns = _exec(export_plan(plan, "fsdp2").text)
    assert ns["TP_STYLES"] == styles and ns["DP_MESH_DIMS"] == ("shard",)
    for fqn, style in plan.tensor_parallel.styles_by_fqn.items():
        ours, theirs = ns["_parallel_style"](styles[fqn]), torch_style(style, plan.tensor_parallel)
        assert type(ours).__name__.lstrip("_") == type(theirs).__name__, fqn
        assert vars(ours) == vars(theirs), fqn


def test_fsdp2_snippet_folds_the_8b_styles(plan_8b):
    text = export_plan(plan_8b, "fsdp2").text
    ns = _exec(text)
    assert ns["TP_STYLES"] == plan_8b.tensor_parallel.styles
    assert '**{f"layers.{i}.attention.wq": "colwise" for i in range(0, 32)},' in text
    assert 'mesh = init_device_mesh("cuda", (32, 8), mesh_dim_names=("shard", "tp"))' in text
    assert "with loss_context():" in ns["__doc__"] and ns["LOSS_PARALLEL"] is True
    assert len(text.splitlines()) < 190, "a 32-block TP plan must stay short"


@pytest.mark.parametrize("fake_world", [4], indirect=True)
def test_fsdp2_snippet_splits_and_shards_like_apply_plan(fake_world):
    """dp 2 x tp 2 of the tiny Llama under the fake process group: every parameter has the executor's placements
    (tp split, then FSDP2 over the dp sub-mesh) and local shape; one forward and backward in loss_context."""
    from torch.distributed.device_mesh import init_device_mesh

    from shard_planner.execute.apply import apply_plan
    from shard_planner.model.modelfile import load_model_file

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "tp"))
    with llama_size("tiny"):
        plan = llama_tp_plan("tiny", shard=2, tp=2)
        model_file = load_model_file(plan.model.path)
        reference = apply_plan(model_file.build(), plan, mesh)
        ns = _exec(export_plan(plan, "fsdp2").text)
        model = ns["apply_sharding"](model_file.build(), mesh)

    def layout(m):
        return {n: (p.placements, p.to_local().shape, p.device_mesh.mesh_dim_names) for n, p in m.named_parameters()}

    assert layout(model) == layout(reference)
    assert layout(model)["layers.0.attention.wq.weight"][2] == ("shard", "tp")
    inputs, targets = model_file.batch(2)
    with ns["loss_context"]():
        model_file.loss(model(*inputs), targets).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_fsdp2_train_step_runs_the_loss_in_loss_context():
    plan = llama_tp_plan("tiny", shard=2, tp=2, accumulation_steps=2)
    text = export_plan(plan, "fsdp2").text
    step = text[text.index("def train_step"):]
    assert "with loss_context():" in step and "(loss / ACCUMULATION_STEPS).backward()" in step
    _exec(text)


def test_fsdp2_snippet_without_tp_has_no_tp_code():
    plan = llama_tp_plan("tiny", shard=2, tp=2)
    plain = replace(plan, mesh=replace(plan.mesh, shard=4, tp=1), tensor_parallel=None)
    text = export_plan(plain, "fsdp2").text
    assert "TP_STYLES" not in text and "loss_context" not in text and "policy = dict(mesh=mesh," in text


# ---- torchtitan ----

def _torchtitan(plan) -> tuple[dict, dict, tuple[str, ...]]:
    export = export_plan(plan, "torchtitan")
    ns = _exec(export.text)
    return ns["PARALLELISM"], ns["COMPILE"], export.notes


def test_torchtitan_states_the_degrees_and_sequence_parallelism(plan_8b):
    parallelism, compile_fields, notes = _torchtitan(plan_8b)
    assert parallelism == {"data_parallel_shard_degree": 32, "data_parallel_replicate_degree": 1,
                           "fsdp_reshard_after_forward": "always", "tensor_parallel_degree": 8,
                           "enable_sequence_parallel": True}
    assert compile_fields == {"enable_async_tensor_parallel": False}
    assert not [n for n in notes if "logits" in n or "styles" in n]  # torchtitan's Llama split, loss parallel


def test_torchtitan_hsdp_without_sequence_or_loss_parallelism():
    plan = llama_tp_plan("tiny", shard=2, replicate=2, tp=2, sequence_parallel=False, loss_parallel=False)
    parallelism, _, notes = _torchtitan(plan)
    assert (parallelism["data_parallel_replicate_degree"], parallelism["data_parallel_shard_degree"],
            parallelism["tensor_parallel_degree"], parallelism["enable_sequence_parallel"]) == (2, 2, 2, False)
    assert [n for n in notes if "torchtitan 0.3 always keeps them split on the vocabulary" in n]
    assert not [n for n in notes if "styles" in n]  # without sequence parallelism: no norm, no gather_input


def test_torchtitan_notes_styles_that_are_not_its_llama_split():
    from shard_planner.report.export.torchtitan import torchtitan_layout_gaps

    plan = llama_tp_plan("tiny", shard=2, tp=2)
    assert torchtitan_layout_gaps(plan.tensor_parallel) == []
    styles = {f: s for f, s in plan.tensor_parallel.styles.items() if f != "layers.1.feed_forward.w3"}
    gaps = torchtitan_layout_gaps(TensorParallel(styles))
    assert gaps[0] == "block layers.1: 4 colwise, 2 gather_input, 2 norm, 2 rowwise" and len(gaps) == 2
    _, _, notes = _torchtitan(replace(plan, tensor_parallel=TensorParallel(styles)))
    assert [n for n in notes if "not torchtitan's Llama split" in n and "block layers.1" in n]


# ---- accelerate ----

def _accelerate(plan):
    import yaml

    with llama_size("8b" if plan.mesh.world_size > 64 else "tiny"):
        export = export_plan(plan, "accelerate")
    return yaml.safe_load(export.text), export


def test_accelerate_states_the_sizes_and_how_to_split(plan_8b):
    config, export = _accelerate(plan_8b)
    assert config["parallelism_config"] == {"parallelism_config_dp_replicate_size": 1,
                                            "parallelism_config_dp_shard_size": 32, "parallelism_config_tp_size": 8}
    assert config["num_processes"] == 256
    assert "# Tensor parallelism: FSDP over 32 GPUs x TP 8" in export.text
    assert [n for n in export.notes if "applies none of the plan's 355 tensor-parallel styles" in n
            and "model.tp_size = 8" in n]
    assert [n for n in export.notes if "sequence parallelism; transformers' tensor-parallel plans have none" in n]
    assert [n for n in export.notes if "loss_parallel()" in n]


def test_accelerate_hsdp_tp_without_sequence_or_loss_parallelism():
    plan = llama_tp_plan("tiny", shard=2, replicate=2, tp=2, sequence_parallel=False, loss_parallel=False)
    config, export = _accelerate(plan)
    sizes = config["parallelism_config"]
    assert (sizes["parallelism_config_dp_replicate_size"], sizes["parallelism_config_dp_shard_size"],
            sizes["parallelism_config_tp_size"]) == (2, 2, 2)
    assert not [n for n in export.notes if "sequence parallelism" in n or "loss_parallel()" in n]
    assert [n for n in export.notes if "applies none of the plan's" in n]


# ---- deepspeed ----

def _deepspeed(plan):
    with llama_size("8b" if plan.mesh.world_size > 64 else "tiny"):
        info = model_info_for_plan(plan)
        export = export_plan(plan, "deepspeed", info)
    return json.loads(export.text), export, info


def test_deepspeed_autotp_section_for_dp32_tp8(plan_8b):
    config, export, info = _deepspeed(plan_8b)
    tp = config["tensor_parallel"]
    assert tp["autotp_size"] == 8 and tp["vocab_parallel_lm_head"] is True
    column, row = tp["partition_config"]["layer_specs"]
    assert column["partition_type"] == "column" and len(column["patterns"]) == 5  # wq wk wv w1 w3, every block
    assert row["partition_type"] == "row" and row["patterns"] == [
        r"(?:.*\.)?layers\.\d+\.attention\.wo\.weight$", r"(?:.*\.)?layers\.\d+\.feed_forward\.w2\.weight$"]
    assert tp["partition_config"]["lm_head_patterns"] == ["output"]
    assert "train_batch_size" not in config and config["zero_optimization"]["stage"] == 3
    for words in ("sequence parallelism (65 norms, 64 gathered inputs) cannot be expressed",
                  "embedding tok_embeddings on the vocabulary", "loss_function hook"):
        assert [n for n in export.notes if words in n], words
    # ZeRO-3's sizes count one tp rank's parameters: a block's split weights / 8, its norms whole
    block = [m for m in info.modules if m.fqn.startswith("layers.0.") and m.param_count]
    local = sum(m.param_count // 8 if m.fqn.endswith(("wq", "wk", "wv", "wo", "w1", "w2", "w3")) else m.param_count
                for m in block)
    assert config["zero_optimization"]["reduce_bucket_size"] == local


def test_deepspeed_without_loss_parallelism_gathers_the_head():
    import re

    plan = llama_tp_plan("tiny", shard=2, tp=2, sequence_parallel=False, loss_parallel=False)
    config, export, _ = _deepspeed(plan)
    tp = config["tensor_parallel"]
    assert tp["vocab_parallel_lm_head"] is False and "lm_head_patterns" not in tp["partition_config"]
    head = tp["partition_config"]["layer_specs"][-1]
    assert head == {"patterns": [r"(?:.*\.)?output\.weight$"], "partition_type": "column", "gather_output": True}
    assert re.match(head["patterns"][0], "model.output.weight") and not re.match(head["patterns"][0], "output.bias")
    assert not [n for n in export.notes if "sequence parallelism" in n or "loss_function" in n]


def test_deepspeed_without_tp_has_no_tensor_parallel_section():
    plan = llama_tp_plan("tiny", shard=2, tp=2)
    config, export, _ = _deepspeed(replace(plan, mesh=replace(plan.mesh, shard=4, tp=1), tensor_parallel=None))
    assert "tensor_parallel" not in config and config["train_batch_size"] == 4 * 1
    assert not [n for n in export.notes if "AutoTP" in n]


def test_deepspeed_hsdp_is_noted_not_written_as_mics():
    """DeepSpeed 0.19.8 refuses mics_shard_size (runtime/config.py _REMOVED_ZERO_CONFIG_KEYS): HSDP is a note."""
    plan = llama_tp_plan("tiny", shard=2, replicate=2, tp=2, sequence_parallel=False, loss_parallel=False)
    config, export, _ = _deepspeed(plan)
    assert "mics_shard_size" not in config["zero_optimization"]
    assert [n for n in export.notes if n.startswith("HSDP (2 replicas x 2-way sharding) cannot be expressed")]
