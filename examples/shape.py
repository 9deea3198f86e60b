"""A decoder-only language model of any published shape, as a shard-planner model file.

The shape comes from a small JSON object, given by the environment variable ``SHARD_PLANNER_SHAPE``:
either a path to a JSON file or the JSON text itself (read each time ``build_model()`` and
``make_batch()`` are called; ``TRAINING`` is computed when the file is imported). Keys::

    n_layers, d_model, d_ffn, n_heads, vocab, seq_len          required
    n_kv_heads       default n_heads (grouped-query attention when fewer)
    tied_embeddings  default true  (the output projection reuses the token embedding)
    ffn_type         "gelu" (2 matrices, MPT / GPT-2) or "swiglu" (3 matrices, Llama); default "gelu"
    norm             "layernorm" (with bias) or "rmsnorm"; default "layernorm"
    pos              "learned" (seq_len x d_model table) or "rope"; default "learned"
    bias             biases on every linear layer; default true
    micro_batch      TRAINING's default micro-batch; default 1

The default shape (no environment variable) is a tiny MPT-style model that trains on a CPU.

MPT (MosaicML llm-foundry, the shape of ../shared/data/published_fsdp_runs.csv) is ffn_type gelu,
norm layernorm, pos learned, bias true, tied embeddings; its parameter count is
12·L·d² + 13·L·d + V·d + S·d + 2·d (:func:`mpt_param_count`, the formula the CSV's notes check).

Module names (FSDP units are chosen by fully-qualified name)::

    wte, wpe (learned positions only), blocks.{i}.{norm_1, attn.{wqkv, out_proj}, norm_2,
    ffn.{up, down} | ffn.{gate, up, down}}, norm_f, lm_head (lm_head.weight is wte.weight when tied)

Attention is ``F.scaled_dot_product_attention(is_causal=True)`` (``enable_gqa`` for fewer K/V heads),
which a GPU runs with a FlashAttention kernel, as MPT's Triton FlashAttention did.
"""

import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

TINY = dict(n_layers=2, d_model=64, d_ffn=256, n_heads=4, vocab=512, seq_len=64, micro_batch=8)
REQUIRED = ("n_layers", "d_model", "d_ffn", "n_heads", "vocab", "seq_len")
DEFAULTS = dict(tied_embeddings=True, ffn_type="gelu", norm="layernorm", pos="learned", bias=True, micro_batch=1)
CHOICES = dict(ffn_type=("gelu", "swiglu"), norm=("layernorm", "rmsnorm"), pos=("learned", "rope"))
ROPE_THETA = 10000.0  # RoFormer (Su et al. 2021), eq. 15
NORM_EPS = 1e-5


def config() -> dict:
    """The shape from ``SHARD_PLANNER_SHAPE`` (a JSON file's path or JSON text), defaults filled in."""
    raw = os.environ.get("SHARD_PLANNER_SHAPE", "").strip()
    if not raw:
        given = dict(TINY)
    elif raw.startswith("{"):
        given = json.loads(raw)
    else:
        with open(raw) as f:
            given = json.load(f)
    missing = [k for k in REQUIRED if k not in given]
    if missing:
        raise ValueError(f"SHARD_PLANNER_SHAPE lacks {', '.join(missing)} (needs {', '.join(REQUIRED)})")
    unknown = set(given) - set(REQUIRED) - set(DEFAULTS) - {"n_kv_heads"}
    if unknown:
        raise ValueError(f"SHARD_PLANNER_SHAPE has unknown keys {', '.join(sorted(unknown))}")
    cfg = {**DEFAULTS, "n_kv_heads": given["n_heads"], **given}
    for key, allowed in CHOICES.items():
        if cfg[key] not in allowed:
            raise ValueError(f"SHARD_PLANNER_SHAPE {key}={cfg[key]!r} is not one of {', '.join(allowed)}")
    if cfg["d_model"] % cfg["n_heads"] or cfg["n_heads"] % cfg["n_kv_heads"]:
        raise ValueError("SHARD_PLANNER_SHAPE: d_model must divide by n_heads and n_heads by n_kv_heads")
    return cfg


def mpt_param_count(n_layers: int, d_model: int, vocab: int, seq_len: int) -> int:
    """MPT with a 4x GELU MLP, biases, LayerNorm, learned positions, tied embeddings:
    12·L·d² + 13·L·d + V·d + S·d + 2·d (published_fsdp_runs.csv notes; llm-foundry's NumParams)."""
    L, d = n_layers, d_model
    return 12 * L * d * d + 13 * L * d + vocab * d + seq_len * d + 2 * d


def _norm(cfg: dict) -> nn.Module:
    if cfg["norm"] == "layernorm":
        return nn.LayerNorm(cfg["d_model"], eps=NORM_EPS)
    return nn.RMSNorm(cfg["d_model"], eps=NORM_EPS)


def rotary_cos_sin(seq_len: int, head_dim: int, device):
    """cos and sin of the rotary angles, each (T, head_dim / 2), fp32."""
    freqs = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)  # (T, hd/2)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    """Rotate the halves of the last dim (GPT-NeoX layout). x: (B, H, T, hd); cos, sin: (T, hd/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, H, T, hd/2) each
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)  # (B, H, T, hd)


class Attention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        d, self.n_heads, self.n_kv = cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"]
        self.head_dim = d // self.n_heads
        self.rope = cfg["pos"] == "rope"
        self.wqkv = nn.Linear(d, (self.n_heads + 2 * self.n_kv) * self.head_dim, bias=cfg["bias"])
        self.out_proj = nn.Linear(d, d, bias=cfg["bias"])

    def forward(self, x):
        B, T, C = x.shape
        hd = self.head_dim
        q, k, v = self.wqkv(x).split((self.n_heads * hd, self.n_kv * hd, self.n_kv * hd), dim=2)
        q = q.view(B, T, self.n_heads, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_kv, hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(B, T, self.n_kv, hd).transpose(1, 2)  # (B, nkv, T, hd)
        if self.rope:
            cos, sin = rotary_cos_sin(T, hd, x.device)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class FeedForward(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        d, f, bias = cfg["d_model"], cfg["d_ffn"], cfg["bias"]
        self.swiglu = cfg["ffn_type"] == "swiglu"
        if self.swiglu:
            self.gate = nn.Linear(d, f, bias=bias)
        self.up = nn.Linear(d, f, bias=bias)
        self.down = nn.Linear(f, d, bias=bias)

    def forward(self, x):
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))  # (B, T, f) -> (B, T, d)
        return self.down(F.gelu(self.up(x), approximate="tanh"))  # (B, T, f) -> (B, T, d)


class Block(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.norm_1, self.attn, self.norm_2, self.ffn = _norm(cfg), Attention(cfg), _norm(cfg), FeedForward(cfg)

    def forward(self, x):
        x = x + self.attn(self.norm_1(x))  # (B, T, d)
        return x + self.ffn(self.norm_2(x))  # (B, T, d)


class Decoder(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        d, V = cfg["d_model"], cfg["vocab"]
        self.wte = nn.Embedding(V, d)
        self.wpe = nn.Embedding(cfg["seq_len"], d) if cfg["pos"] == "learned" else None
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg["n_layers"])])
        self.norm_f = _norm(cfg)
        self.lm_head = nn.Linear(d, V, bias=False)
        if cfg["tied_embeddings"]:
            self.lm_head.weight = self.wte.weight
        for m in self.modules():  # N(0, 0.02) as GPT-2 / MPT; a no-op cost on the meta device
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        B, T = idx.shape
        x = self.wte(idx)  # (B, T, d)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))  # (T, d) broadcast
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm_f(x))  # (B, T, V)


def build_model() -> nn.Module:
    return Decoder(config())


def make_batch(batch_size: int):
    """Random token ids: inputs (B, T), next-token targets (B, T)."""
    cfg = config()
    tokens = torch.randint(0, cfg["vocab"], (batch_size, cfg["seq_len"] + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(output, targets):
    """Next-token cross-entropy, in fp32: output (B, T, V), targets (B, T)."""
    return F.cross_entropy(output.flatten(0, -2).float(), targets.flatten())


_cfg = config()
TRAINING = {"micro_batch": _cfg["micro_batch"], "seq_len": _cfg["seq_len"], "optimizer": "adamw", "lr": 3e-4}
del _cfg
