"""The tracer takes a real run's path: transformers' mask helpers on an unpadded batch (no materialised
causal mask, no repeated K/V heads), a fallback from block reuse when a caller modifies a block's output in
place, and MoE routing traced under the balanced-routing assumption instead of failing on aten.nonzero."""

import json
import logging
from contextlib import nullcontext
from dataclasses import fields

import pytest

from shard_planner.model.modelfile import load_model_file
from shard_planner.trace import trace_model
from shard_planner.trace.realrun import compare_with_real_run
from shard_planner.trace.routing import balanced_indices
from shard_planner.trace.types import ModelTrace
from tests.paths import MODELS

INPLACE = str(MODELS / "trace_inplace_twin.py")

LLAMA_WITH_MASK = '''
import os
import torch
import transformers

CONFIG = transformers.{config}(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads={kv}, max_position_embeddings=64{extra})
SEQ = 32


def build_model():
    return transformers.AutoModelForCausalLM.from_config(CONFIG, attn_implementation="sdpa")


def make_batch(batch_size):
    ids = torch.randint(0, 256, (batch_size, SEQ))
    mask = torch.ones_like(ids)
    if {padded}:
        mask[:, -4:] = 0
    return {{"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}}, None


TRAINING = {{"seq_len": SEQ}}
'''

ARCHS = {  # name -> (config class, kv heads, extra config arguments)
    "llama": ("LlamaConfig", 2, ""),
    "mistral": ("MistralConfig", 2, ", sliding_window=16"),
    "gemma": ("GemmaConfig", 1, ", head_dim=16"),
}


def write_model(tmp_path, name: str, padded: bool) -> str:
    config, kv, extra = ARCHS[name]
    path = tmp_path / f"{name}_{'padded' if padded else 'unpadded'}.py"
    path.write_text(LLAMA_WITH_MASK.format(config=config, kv=kv, extra=extra, padded=padded))
    return str(path)


@pytest.mark.parametrize("name", sorted(ARCHS))
@pytest.mark.parametrize("padded", [False, True])
def test_transformers_masks_traced_as_a_real_run(name, padded, tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'shard-planner[hf]')")
    path = write_model(tmp_path, name, padded)
    trace = trace_model(path, dtype="fp32")
    assert compare_with_real_run(path, trace, batch_size=2) == ()


def test_without_the_real_run_paths_the_check_finds_the_mask(tmp_path, monkeypatch):
    """The same unpadded Llama traced with transformers' fake-tensor branches left alone: the check lists
    the materialised mask and repeated K/V heads (so the test above can fail)."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'shard-planner[hf]')")
    import shard_planner.trace.tracer as tracer

    monkeypatch.setattr(tracer, "real_run_paths", lambda mf, b: nullcontext())
    path = write_model(tmp_path, "llama", padded=False)
    diffs = compare_with_real_run(path, trace_model(path, dtype="fp32"), batch_size=2)
    assert {d.fqn for d in diffs if d.quantity == "saved_bytes_self"} == {
        "model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert all(d.traced > d.real for d in diffs)


def test_in_place_on_a_reused_output_falls_back_to_tracing_the_block(caplog):
    with caplog.at_level(logging.WARNING, logger="shard_planner.trace.tracer"):
        fast = trace_model(INPLACE)
    assert "a caller modifies their output in place" in caplog.text and "blocks.1.mlp" in caplog.text
    full = trace_model(INPLACE, reuse=False)
    assert fast.modules == full.modules
    for f in fields(ModelTrace):
        if f.name not in ("trace_seconds", "reused_modules"):
            assert getattr(fast, f.name) == getattr(full, f.name), f.name
    assert compare_with_real_run(INPLACE, fast, batch_size=3) == ()


def test_balanced_indices():
    idx = balanced_indices((6, 2), -1, (6, 4))  # 6 tokens, top-2 of 4 experts
    assert idx.tolist() == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1], [2, 3]]
    counts = balanced_indices((2, 5, 3), 2, (2, 5, 8)).flatten().bincount(minlength=8)
    assert int(counts.max()) - int(counts.min()) <= 1 and int(counts.sum()) == 30


def test_eager_moe_routing_traced_under_the_balanced_assumption(tmp_path, caplog):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        architectures=["MixtralForCausalLM"])
    config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())  # save_pretrained leaves the implementation out
    (tmp_path / "config.json").write_text(json.dumps({**data, "experts_implementation": "eager"}))
    from shard_planner.model.hf import HfOptions

    mf = load_model_file(str(tmp_path), HfOptions(seq_len=16))
    with caplog.at_level(logging.WARNING, logger="shard_planner.trace.tracer"):
        trace = trace_model(mf, dtype="fp32")
    assert "balanced routing at the configured top-k" in caplog.text
    assert trace.param_count == sum(p.numel() for p in mf.build().parameters())
    # balanced: 16 tokens x top-2 = 32 (token, expert) pairs per sample, each a gate_up (64 -> 2 x 64) and a
    # down (64 -> 64) projection: 2 * 64 * 128 + 2 * 64 * 64 FLOPs a pair (matmuls only are counted)
    experts = trace.module("model.layers.0.mlp.experts")
    for b in (1, 2):
        assert experts.fwd_flops_self.at(b) == b * 32 * (2 * 64 * 128 + 2 * 64 * 64)


def write_config(tmp_path, use_cache: bool) -> str:
    """A tiny Llama config.json (no attention mask in the batch: without a cache transformers asks
    ``find_packed_sequence_indices`` about the position ids)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             use_cache=use_cache, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    return str(tmp_path / "config.json")


def load_config(path: str):
    from shard_planner.model.hf import HfOptions

    return load_model_file(path, HfOptions(seq_len=16))


@pytest.mark.parametrize("use_cache", [False, True])
def test_llama_with_and_without_a_cache_traced_as_a_real_run(use_cache, tmp_path):
    """use_cache=False used to fail ('NoneType' object is not subscriptable: the packing helper got None)."""
    mf = load_config(write_config(tmp_path, use_cache))
    trace = trace_model(mf, dtype="fp32")
    assert compare_with_real_run(mf, trace, batch_size=2) == ()
    assert (trace.forward_cache is not None) == use_cache


def _attention_saved_bytes(trace) -> float:
    return sum(trace.module(f"model.layers.{i}.self_attn").saved_bytes_self.at(2) for i in range(2))


@pytest.mark.parametrize("change", ["raises", "renamed"])
def test_a_changed_transformers_helper_falls_back_with_one_warning(change, tmp_path, monkeypatch, caplog):
    """[Note: transformers internals may change]: a packing helper that raises on the real run's answer, or
    whose argument is renamed, leaves transformers' conservative path (a materialised mask: more attention
    memory), one warning line, never a failed trace."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    from transformers import masking_utils

    mf = load_config(write_config(tmp_path, use_cache=False))
    adapted = trace_model(mf, dtype="fp32")
    from torch._subclasses.fake_tensor import FakeTensor

    original = masking_utils.find_packed_sequence_indices

    def raises(position_ids):  # on the real run's position ids (the wrapper's answer), not on the fake ones
        if not isinstance(position_ids, FakeTensor):
            raise RuntimeError("a changed helper")
        return original(position_ids)

    def renamed(ids):
        return original(ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", raises if change == "raises" else renamed)
    with caplog.at_level(logging.WARNING, logger="shard_planner.trace.hf_paths"):
        fallback = trace_model(mf, dtype="fp32")
    warnings = [r for r in caplog.records if r.name == "shard_planner.trace.hf_paths"]
    assert len(warnings) == 1 and "find_packed_sequence_indices" in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage()
    assert _attention_saved_bytes(fallback) > _attention_saved_bytes(adapted)
