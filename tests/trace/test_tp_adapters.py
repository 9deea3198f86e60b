"""LoRA adapters under tensor parallelism (shard_planner/trace/tp_adapters.py): the styles derived for
examples/llama_lora.py (structure) and a tiny transformers Llama fine-tuned with peft (its own plan under peft's
prefix), colwise and rowwise layers, sequence parallelism left out, and QLoRA's NF4 weights refused. The runs that
prove the styles train with the collectives predicted are in tests/execute/test_tensor_parallel_run.py."""

from __future__ import annotations

import pytest
import torch.nn as nn

from shard_planner.errors import UserError
from shard_planner.model.modelfile import load_model_file
from shard_planner.plan.finetune import FineTune
from shard_planner.trace.tp_adapters import layer_of, lora_parts, with_adapters
from shard_planner.parallel.tensor_parallel import TensorParallel
from shard_planner.trace.tp_degrees import degree_styles
from shard_planner.trace.tp_styles import check_divisible
from tests.hf.finetune import load, need_finetune_extra, write_config
from tests.paths import EXAMPLES

PEFT = "base_model.model.model.layers.0."


def test_a_lora_layer_is_its_base_layer_and_adapters():
    layer = nn.Module()
    layer.base_layer, layer.lora_A, layer.lora_B = nn.Linear(8, 16), nn.Linear(8, 2), nn.Linear(2, 16)
    assert lora_parts(layer) == (["lora_A"], ["lora_B"])
    layer.lora_A = nn.ModuleDict({"default": nn.Linear(8, 2)})  # peft's: one Linear per adapter
    layer.lora_B = nn.ModuleDict({"default": nn.Linear(2, 16)})
    assert lora_parts(layer) == (["lora_A.default"], ["lora_B.default"])
    assert lora_parts(nn.Linear(8, 16)) is None
    assert layer_of("a.wq.lora_B.default") == layer_of("a.wq.base_layer") == "a.wq" and layer_of("a.wk") == "a.wk"
    model = nn.Module()
    model.wq, model.wo = layer, nn.Linear(16, 8)
    assert with_adapters(model, {"wq": "colwise", "wo": "rowwise"}) == {
        "wq.base_layer": "colwise", "wq.lora_B.default": "colwise", "wo": "rowwise"}
    assert with_adapters(model, {"wq": "rowwise"}) == {"wq.base_layer": "rowwise", "wq.lora_A.default": "rowwise"}
    with pytest.raises(UserError, match="wq is a LoRA layer styled head"):
        with_adapters(model, {"wq": "head"})


def test_the_example_lora_model_splits_its_adapters_without_sequence_parallelism(monkeypatch):
    monkeypatch.setenv("SHARD_PLANNER_FINETUNE", "lora")
    found = degree_styles(load_model_file(str(EXAMPLES / "llama_lora.py")), [2], sequence_parallel=True,
                          loss_parallel=True)
    assert not found.refused
    tp = found.styles[2]
    assert not tp.sequence_parallel and tp.loss_parallel  # sequence parallelism left out for the adapters
    styles = {f: s.style.value for f, s in tp.styles_by_fqn.items() if f.startswith("layers.0.")}
    assert styles == {"layers.0.attention.wq.base_layer": "colwise", "layers.0.attention.wq.lora_B": "colwise",
                      "layers.0.attention.wk": "colwise", "layers.0.attention.wv.base_layer": "colwise",
                      "layers.0.attention.wv.lora_B": "colwise", "layers.0.attention.wo": "rowwise",
                      "layers.0.feed_forward.w1": "colwise", "layers.0.feed_forward.w3": "colwise",
                      "layers.0.feed_forward.w2": "rowwise"}


@pytest.mark.parametrize("targets, expected, parts, split", [
    ((), {"self_attn.q_proj.base_layer": "colwise", "self_attn.q_proj.lora_B.default": "colwise",
          "self_attn.k_proj": "colwise", "self_attn.v_proj.base_layer": "colwise",
          "self_attn.v_proj.lora_B.default": "colwise", "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise",
          "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"},
     ("self_attn.v_proj.base_layer", "self_attn.v_proj.lora_B.default"),
     ("colwise", 4, "heads 2, which 4 does not divide")),
    (("o_proj", "down_proj"), {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
                               "self_attn.v_proj": "colwise", "self_attn.o_proj.base_layer": "rowwise",
                               "self_attn.o_proj.lora_A.default": "rowwise", "mlp.gate_proj": "colwise",
                               "mlp.up_proj": "colwise", "mlp.down_proj.base_layer": "rowwise",
                               "mlp.down_proj.lora_A.default": "rowwise"},
     ("mlp.down_proj.base_layer",), ("rowwise", 3, "splits its input features 512, which 3 does not divide")),
], ids=["q,v (peft's default)", "o,down (rowwise)"])
def test_transformers_plan_under_peft_splits_the_adapters(tmp_path, targets, expected, parts, split):
    need_finetune_extra()
    model_file = load(write_config(tmp_path), FineTune(lora_rank=8, lora_targets=targets))
    found = degree_styles(model_file, [2, 4], sequence_parallel=False, loss_parallel=False)
    assert set(found.styles) == {2}  # 2 key/value heads
    assert [o.refused for o in found.refused] == [
        f"tensor parallelism of degree 4: {PEFT}self_attn.k_proj holds attention heads of head_dim 64: heads 2, "
        "which 4 does not divide; choose a tp degree that divides it"]
    # a LoRA layer's parts are checked as the Linear: colwise ones by the attention's heads past the LoRA layer
    style, degree, message = split
    model = model_file.build()
    for part in parts:
        with pytest.raises(UserError, match=message):
            check_divisible(model, TensorParallel({PEFT + part: style}, False, False), degree)
    styles = found.styles[2].styles_by_fqn
    assert {f[len(PEFT):]: s.style.value for f, s in styles.items() if f.startswith(PEFT)} == expected
    assert styles["base_model.model.model.embed_tokens"].style.value == "embedding"
    assert styles["base_model.model.lm_head"].style.value == "head"


def test_qlora_is_refused_with_why(tmp_path):
    need_finetune_extra(qlora=True)
    model_file = load(write_config(tmp_path), FineTune(lora_rank=8, qlora=True))
    found = degree_styles(model_file, [2], sequence_parallel=False, loss_parallel=False)
    assert not found.styles
    (refused,) = found.refused
    assert "is stored in NF4 (QLoRA), which tensor parallelism cannot split; plan a QLoRA fine-tune without --tp" in (
        refused.refused)
    # a hand-written plan's styles on an NF4 weight are refused by the trace, in the same words
    from shard_planner.trace import trace_model

    styles = TensorParallel({f"{PEFT}self_attn.q_proj.base_layer": "colwise"}, False, False)
    with pytest.raises(UserError, match="q_proj.base_layer.weight is stored in NF4 \\(QLoRA\\), which tensor "
                                        "parallelism cannot split"):
        trace_model(model_file, tensor_parallel=styles, tp_size=2)
