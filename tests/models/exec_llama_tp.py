"""A tiny tensor-parallel-ready Llama for the executor's TP tests (a shard-planner model file).

A local copy of examples/llama.py (which another change makes TP-ready): its modules and shapes (tok_embeddings, layers.{i}.{attention_norm, attention.{wq, wk, wv, wo},
ffn_norm, feed_forward.{w1, w2, w3}}, norm, output), with the one change tensor parallelism needs: the
attention reshapes its projections with ``-1`` heads (``view(B, T, -1, head_dim)``), so that on a tp rank the
local colwise outputs (n_heads / tp heads) reshape too (shard_planner/tensor_parallel.py, the last
paragraph of its docstring). Dropout-free and deterministic.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, LAYERS, HEADS, KV_HEADS, FFN, VOCAB, SEQ = 32, 2, 4, 2, 64, 64, 8


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight  # (..., dim)


def rotary_cos_sin(seq_len: int, head_dim: int, device, theta: float = 500000.0):
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)  # (T, hd/2)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)  # (B, H, T, hd/2) each
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)  # (B, H, T, hd)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh / tp, T, hd)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv / tp, T, hd)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv / tp, T, hd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, nh / tp, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, dim)


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, ffn / tp) -> (B, T, dim)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = RMSNorm(DIM)
        self.attention = Attention(DIM, HEADS, KV_HEADS)
        self.ffn_norm = RMSNorm(DIM)
        self.feed_forward = FeedForward(DIM, FFN)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)  # (B, T, dim)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        cos, sin = rotary_cos_sin(tokens.shape[1], DIM // HEADS, tokens.device)  # (T, hd/2) each
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))  # (B, T, vocab)


def build_model() -> nn.Module:
    return Transformer()


def make_batch(batch_size: int):
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(output, targets):
    return F.cross_entropy(output.flatten(0, -2).float(), targets.flatten())


def styles(n_layers: int = LAYERS) -> dict[str, str]:
    """torchtitan's Llama plan (torchtitan/models/llama3/infra/parallelize.py ``apply_tp``), by fqn."""
    out = {"tok_embeddings": "embedding"}
    for i in range(n_layers):
        p = f"layers.{i}."
        out |= {p + "attention_norm": "norm", p + "attention": "gather_input",
                **{p + f"attention.{w}": "colwise" for w in ("wq", "wk", "wv")}, p + "attention.wo": "rowwise",
                p + "ffn_norm": "norm", p + "feed_forward": "gather_input",
                p + "feed_forward.w1": "colwise", p + "feed_forward.w3": "colwise", p + "feed_forward.w2": "rowwise"}
    return out | {"norm": "norm", "output": "head"}


TRAINING = {"micro_batch": 2, "seq_len": SEQ, "optimizer": "adamw", "lr": 0.01}
