"""The styles' forward records a repeated block from its first twin (shard_planner/trace/tp_call_twins.py [Note: Twin
blocks in the styles' forward]): what it records equals the forward with every block run."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shard_planner.trace.tp_call_twins as call_twins
from shard_planner.model import hf
from shard_planner.model.modelfile import load_model_file
from shard_planner.trace.tp_styles import derive_tensor_parallel, trace_calls
from tests.paths import EXAMPLES
from tests.trace.test_tp_styles import hf_batch, hf_model


def recorded(model, inputs, reuse: bool, monkeypatch) -> tuple:
    """(calls, SDPA calls, ticks) the forward records, in the order recorded, and how many calls were copied."""
    copied = []
    replay = call_twins._replay
    monkeypatch.setattr(call_twins, "_replay", lambda *a: copied.append(a[1]) or replay(*a))
    trace = trace_calls(model, inputs, reuse=reuse)
    monkeypatch.setattr(call_twins, "_replay", replay)
    return (list(trace.calls.items()), list(trace.attention.items()), trace.counter), copied


def check_same(model, inputs, monkeypatch) -> list[str]:
    with_twins, copied = recorded(model, inputs, True, monkeypatch)
    every_block, none = recorded(model, inputs, False, monkeypatch)
    assert with_twins == every_block and none == []
    return copied


def example(name: str):
    mf = load_model_file(str(EXAMPLES / name))
    return mf.build(), mf.batch(2)[0]


def test_llama_example_records_the_same_with_its_blocks_copied(monkeypatch):
    model, inputs = example("llama.py")
    n = len(model.layers)
    assert n >= 2
    assert check_same(model, inputs, monkeypatch) == [f"layers.{i}" for i in range(1, n)]


@pytest.mark.parametrize("kind", ["Llama", "Qwen2", "Mistral"])
def test_transformers_records_the_same_with_its_blocks_copied(kind, monkeypatch):
    model = hf_model(kind)  # two layers
    copied = check_same(model, hf_batch(), monkeypatch)
    assert copied == ["model.layers.1"]
    tp = derive_tensor_parallel(model, hf_batch(), sequence_parallel=False, hf_tp_plan=hf.tp_plan(model))
    assert "model.layers.1.self_attn.q_proj" in tp.styles


@pytest.mark.parametrize("name", ["vit.py", "gpt2.py", "unet.py"])
def test_other_examples_record_the_same(name, monkeypatch):
    model, inputs = example(name)
    check_same(model, inputs, monkeypatch)


class Attention(nn.Module):
    def __init__(self, dim=16, heads=2, rotary=None):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim) for _ in range(4))
        self.rotary = rotary  # one module shared by every block when given

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        if self.rotary is not None:
            q = self.rotary(q)
        return self.wo(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, rotary=None, as_dict=False):
        super().__init__()
        self.attention, self.as_dict = Attention(rotary=rotary), as_dict
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))

    def forward(self, x):
        x = x + self.attention(x)
        x = x + self.mlp(x)
        return {"hidden": x} if self.as_dict else x


class Stack(nn.Module):
    def __init__(self, shared_rotary=False, as_dict=False, n=3):
        super().__init__()
        rotary = nn.Sequential(nn.Identity(), nn.Identity()) if shared_rotary else None
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(Block(rotary, as_dict) for _ in range(n))
        self.head = nn.Linear(16, 32)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
            h = h["hidden"] if isinstance(h, dict) else h
        return self.head(h)


def test_blocks_sharing_a_module_run_for_real(monkeypatch):
    """Every block holds the same rotary module: its first call is recorded in block 0 only, so neither the
    blocks nor their attentions may be copied; the records still equal the full forward's."""
    copied = check_same(Stack(shared_rotary=True), (torch.randint(0, 32, (2, 8)),), monkeypatch)
    assert not any(f.startswith("blocks.") and f.count(".") == 1 for f in copied)


def test_a_block_returning_a_dict_is_run_for_real_and_its_parts_copied(monkeypatch):
    copied = check_same(Stack(as_dict=True), (torch.randint(0, 32, (2, 8)),), monkeypatch)
    assert "blocks.1" not in copied and "blocks.1.attention" in copied and "blocks.2.mlp" in copied


def test_plain_blocks_are_copied(monkeypatch):
    assert check_same(Stack(), (torch.randint(0, 32, (2, 8)),), monkeypatch) == ["blocks.1", "blocks.2"]


def test_forward_is_restored(monkeypatch):
    model = Stack()
    own = model.blocks[1].forward = lambda x: Block.forward(model.blocks[1], x)  # a forward set on the instance
    trace_calls(model, (torch.randint(0, 32, (2, 8)),))
    assert model.blocks[1].forward is own and "forward" not in vars(model.blocks[0])
