"""A tiny examples/llama.py for the executor's tensor-parallel tests (a shard-planner model file): dim 32, 2 blocks,
4 heads, 2 kv heads, a 64-token vocabulary and 8-token sequences, so a 4-rank gloo world runs in seconds. Its
modules and shapes are the example's (tok_embeddings, layers.{i}.{attention_norm, attention.{wq, wk, wv, wo},
ffn_norm, feed_forward.{w1, w2, w3}}, norm, output); :func:`styles` is torchtitan's plan for them."""

import importlib.util
from pathlib import Path

import torch
import torch.nn as nn

# by path, not as tests.models: a model file is imported by path wherever run's ranks start
_spec = importlib.util.spec_from_file_location("shard_planner_trace_tp_llama", Path(__file__).with_name("trace_tp_llama.py"))
_tp_llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tp_llama)
llama, tp_styles = _tp_llama.llama, _tp_llama.tp_styles

DIM, LAYERS, HEADS, KV_HEADS, FFN, VOCAB, SEQ = 32, 2, 4, 2, 64, 64, 8
loss_fn = llama.loss_fn


def build_model() -> nn.Module:
    return llama.Transformer(DIM, LAYERS, HEADS, KV_HEADS, FFN, VOCAB)


def make_batch(batch_size: int):
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def styles(n_layers: int = LAYERS) -> dict[str, str]:
    """torchtitan's Llama plan (torchtitan/models/llama3/infra/parallelize.py ``apply_tp``), by fqn."""
    return tp_styles(n_layers)


TRAINING = {"micro_batch": 2, "seq_len": SEQ, "optimizer": "adamw", "lr": 0.01}
