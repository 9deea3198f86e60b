"""Encoder-decoder transformer (BART/T5-like) for sequence-to-sequence, as a shard-planner model file.

A token embedding ``shared`` by encoder and decoder, learned position embeddings, an encoder stack of
pre-LayerNorm self-attention blocks, a decoder stack of pre-LayerNorm blocks with causal
self-attention and cross-attention over the encoder output (all through
``F.scaled_dot_product_attention``), and an ``lm_head`` whose weight is tied to ``shared``.

Module names (FSDP units are chosen by fully-qualified name)::

    shared,
    encoder.embed_positions, encoder.layers.{i}.{self_attn_norm, self_attn, ffn_norm, ffn}, encoder.norm,
    decoder.embed_positions,
    decoder.layers.{i}.{self_attn_norm, self_attn, cross_attn_norm, cross_attn, ffn_norm, ffn}, decoder.norm,
    lm_head (lm_head.weight is shared.weight)
    (each attention has q_proj, k_proj, v_proj, out_proj; each ffn has fc1, fc2)

Sizes, chosen with the environment variable ``SHARD_PLANNER_SIZE`` (read each time ``build_model()``
and ``make_batch()`` are called; ``TRAINING`` is computed when the file is imported):

    tiny  d=64,  2+2 layers, 4 heads,  ffn 256,  vocab 512,   64 source + 64 target tokens (default)
    base  d=768, 6+6 layers, 12 heads, ffn 3072, vocab 50265, 512 source + 512 target tokens
          (BART-base shapes, ~140M params)

Inputs are ``(src_tokens (B, S), tgt_tokens (B, T))`` (the decoder input, shifted right); targets are
the next target tokens (B, T). ``SHARD_PLANNER_SEQ`` (optional) sets both S and T; it must not exceed
the number of position embeddings. ``TRAINING["seq_len"]`` is T, the tokens predicted per sample.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIGS = {
    "tiny": dict(d_model=64, n_enc=2, n_dec=2, n_heads=4, ffn_dim=256, vocab_size=512, max_positions=64, seq_len=64),
    "base": dict(
        d_model=768, n_enc=6, n_dec=6, n_heads=12, ffn_dim=3072, vocab_size=50265, max_positions=1024, seq_len=512
    ),
}
MICRO_BATCH = {"tiny": 8, "base": 8}


def config() -> dict:
    """The configuration chosen by ``SHARD_PLANNER_SIZE`` (default "tiny") and ``SHARD_PLANNER_SEQ``."""
    size = os.environ.get("SHARD_PLANNER_SIZE", "tiny")
    if size not in CONFIGS:
        raise ValueError(
            f"SHARD_PLANNER_SIZE={size!r} is not an encoder-decoder size; choose one of {', '.join(CONFIGS)}"
        )
    cfg = dict(CONFIGS[size], size=size)
    seq = int(os.environ.get("SHARD_PLANNER_SEQ") or cfg["seq_len"])
    if not 0 < seq <= cfg["max_positions"]:
        raise ValueError(f"SHARD_PLANNER_SEQ={seq} must be in 1..{cfg['max_positions']} (the position embeddings)")
    cfg["seq_len"] = seq
    return cfg


class MultiHeadAttention(nn.Module):
    """Self-attention (memory=None) or cross-attention (keys and values from memory)."""

    def __init__(self, d_model: int, n_heads: int, causal: bool):
        super().__init__()
        assert d_model % n_heads == 0
        self.n_heads = n_heads
        self.causal = causal
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x, memory=None):
        B, T, C = x.shape
        kv = x if memory is None else memory  # (B, S, C)
        S = kv.shape[1]
        hs = C // self.n_heads
        q = self.q_proj(x).view(B, T, self.n_heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(kv).view(B, S, self.n_heads, hs).transpose(1, 2)  # (B, nh, S, hs)
        v = self.v_proj(kv).view(B, S, self.n_heads, hs).transpose(1, 2)  # (B, nh, S, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.out_proj(y)  # (B, T, C)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, ffn_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ffn_dim, d_model)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))  # (B, T, ffn) -> (B, T, C)


class EncoderLayer(nn.Module):
    def __init__(self, d_model: int, n_heads: int, ffn_dim: int):
        super().__init__()
        self.self_attn_norm = nn.LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(d_model, n_heads, causal=False)
        self.ffn_norm = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model, ffn_dim)

    def forward(self, x):
        x = x + self.self_attn(self.self_attn_norm(x))  # (B, S, C)
        return x + self.ffn(self.ffn_norm(x))  # (B, S, C)


class DecoderLayer(nn.Module):
    def __init__(self, d_model: int, n_heads: int, ffn_dim: int):
        super().__init__()
        self.self_attn_norm = nn.LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(d_model, n_heads, causal=True)
        self.cross_attn_norm = nn.LayerNorm(d_model)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, causal=False)
        self.ffn_norm = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model, ffn_dim)

    def forward(self, x, memory):
        x = x + self.self_attn(self.self_attn_norm(x))  # (B, T, C)
        x = x + self.cross_attn(self.cross_attn_norm(x), memory)  # (B, T, C), attends over (B, S, C)
        return x + self.ffn(self.ffn_norm(x))  # (B, T, C)


class Encoder(nn.Module):
    def __init__(self, d_model, n_layers, n_heads, ffn_dim, max_positions):
        super().__init__()
        self.embed_positions = nn.Embedding(max_positions, d_model)
        self.layers = nn.ModuleList([EncoderLayer(d_model, n_heads, ffn_dim) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x):  # x: token embeddings (B, S, C)
        x = x + self.embed_positions(torch.arange(x.shape[1], device=x.device))  # (B, S, C)
        for layer in self.layers:
            x = layer(x)  # (B, S, C)
        return self.norm(x)  # (B, S, C)


class Decoder(nn.Module):
    def __init__(self, d_model, n_layers, n_heads, ffn_dim, max_positions):
        super().__init__()
        self.embed_positions = nn.Embedding(max_positions, d_model)
        self.layers = nn.ModuleList([DecoderLayer(d_model, n_heads, ffn_dim) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x, memory):  # x: token embeddings (B, T, C); memory: encoder output (B, S, C)
        x = x + self.embed_positions(torch.arange(x.shape[1], device=x.device))  # (B, T, C)
        for layer in self.layers:
            x = layer(x, memory)  # (B, T, C)
        return self.norm(x)  # (B, T, C)


class EncoderDecoder(nn.Module):
    def __init__(self, d_model, n_enc, n_dec, n_heads, ffn_dim, vocab_size, max_positions):
        super().__init__()
        self.shared = nn.Embedding(vocab_size, d_model)
        self.encoder = Encoder(d_model, n_enc, n_heads, ffn_dim, max_positions)
        self.decoder = Decoder(d_model, n_dec, n_heads, ffn_dim, max_positions)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.shared.weight  # tied, as in BART and T5 v1
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, src_tokens, tgt_tokens):
        memory = self.encoder(self.shared(src_tokens))  # (B, S, C)
        h = self.decoder(self.shared(tgt_tokens), memory)  # (B, T, C)
        return self.lm_head(h)  # (B, T, vocab)


def build_model() -> nn.Module:
    cfg = config()
    return EncoderDecoder(
        cfg["d_model"], cfg["n_enc"], cfg["n_dec"], cfg["n_heads"], cfg["ffn_dim"], cfg["vocab_size"],
        cfg["max_positions"],
    )


def make_batch(batch_size: int):
    """Random source tokens (B, S), decoder inputs (B, T) and next-token targets (B, T)."""
    cfg = config()
    src = torch.randint(0, cfg["vocab_size"], (batch_size, cfg["seq_len"]))
    tgt = torch.randint(0, cfg["vocab_size"], (batch_size, cfg["seq_len"] + 1))
    return (src, tgt[:, :-1].contiguous()), tgt[:, 1:].contiguous()


def loss_fn(output, targets):
    """Next-token cross-entropy, in fp32: output (B, T, vocab), targets (B, T)."""
    return F.cross_entropy(output.flatten(0, -2).float(), targets.flatten())


_cfg = config()
TRAINING = {
    "micro_batch": MICRO_BATCH[_cfg["size"]],
    "seq_len": _cfg["seq_len"],
    "optimizer": "adamw",
    "lr": 1e-3 if _cfg["size"] == "tiny" else 3e-4,
}
del _cfg
