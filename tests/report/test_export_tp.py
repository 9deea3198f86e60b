"""Exports of tensor-parallel plans (issue 30): each export states the plan's tensor parallelism (degree, the
data-parallel degrees over GPUs / tp, sequence and loss parallelism, the styles) or says in one line what its
target cannot express. The Llama example's plans, by hand (tests/report/tp_plans.py)."""

import json
from dataclasses import replace

import pytest

from shard_planner.report.export import export_plan, model_info_for_plan
from shard_planner.tensor_parallel import Style, TensorParallel
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
              "o": "rowwise", "out": "head"}
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
    from shard_planner.modelfile import load_model_file

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
