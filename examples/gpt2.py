"""GPT-2 style decoder-only language model (nanoGPT shape), as a shard-planner model file.

Token + learned position embeddings, a stack of pre-LayerNorm blocks (causal self-attention through
``F.scaled_dot_product_attention(is_causal=True)``, GELU MLP), a final LayerNorm and an ``lm_head``
whose weight is tied to the token embedding, as in GPT-2.

Module names (FSDP units are chosen by fully-qualified name)::

    wte, wpe, blocks.{i}.{ln_1, attn.{c_attn, c_proj}, ln_2, mlp.{c_fc, c_proj}}, ln_f, lm_head
    (lm_head.weight is wte.weight)

Sizes, chosen with the environment variable ``SHARD_PLANNER_SIZE`` (read each time ``build_model()``
and ``make_batch()`` are called; ``TRAINING`` is computed when the file is imported):

    tiny    4 layers,  4 heads,  d=64,   vocab 512,   context 64     (~0.24M params, the default)
    small   12 layers, 12 heads, d=768,  vocab 50257, context 1024   (GPT-2 124M)
    medium  24 layers, 16 heads, d=1024, vocab 50257, context 1024   (GPT-2 350M)
    large   36 layers, 20 heads, d=1280, vocab 50257, context 1024   (GPT-2 774M)
    xl      48 layers, 25 heads, d=1600, vocab 50257, context 1024   (GPT-2 1.5B)

``SHARD_PLANNER_SEQ`` (optional) overrides the tokens per sample of ``make_batch`` and ``TRAINING``;
it must not exceed the context length (the position embedding has that many rows).
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIGS = {
    #        n_layer n_head n_embd vocab  block (context length)
    "tiny": dict(n_layer=4, n_head=4, n_embd=64, vocab_size=512, block_size=64),
    "small": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024),
    "medium": dict(n_layer=24, n_head=16, n_embd=1024, vocab_size=50257, block_size=1024),
    "large": dict(n_layer=36, n_head=20, n_embd=1280, vocab_size=50257, block_size=1024),
    "xl": dict(n_layer=48, n_head=25, n_embd=1600, vocab_size=50257, block_size=1024),
}
MICRO_BATCH = {"tiny": 8, "small": 8, "medium": 4, "large": 4, "xl": 2}


def config() -> dict:
    """The configuration chosen by ``SHARD_PLANNER_SIZE`` (default "tiny") and ``SHARD_PLANNER_SEQ``."""
    size = os.environ.get("SHARD_PLANNER_SIZE", "tiny")
    if size not in CONFIGS:
        raise ValueError(f"SHARD_PLANNER_SIZE={size!r} is not a GPT-2 size; choose one of {', '.join(CONFIGS)}")
    cfg = dict(CONFIGS[size], size=size)
    seq = int(os.environ.get("SHARD_PLANNER_SEQ") or cfg["block_size"])
    if not 0 < seq <= cfg["block_size"]:
        raise ValueError(f"SHARD_PLANNER_SEQ={seq} must be in 1..{cfg['block_size']} (the context length)")
    cfg["seq_len"] = seq
    return cfg


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        assert n_embd % n_head == 0
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))  # (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


class GPT(nn.Module):
    def __init__(self, n_layer: int, n_head: int, n_embd: int, vocab_size: int, block_size: int):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)  # token embedding
        self.wpe = nn.Embedding(block_size, n_embd)  # position embedding
        self.blocks = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        # GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer).
        self.apply(self._init_weights)
        for block in self.blocks:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        x = self.ln_f(x)  # (B, T, C)
        return self.lm_head(x)  # (B, T, vocab)


def build_model() -> nn.Module:
    cfg = config()
    return GPT(cfg["n_layer"], cfg["n_head"], cfg["n_embd"], cfg["vocab_size"], cfg["block_size"])


def make_batch(batch_size: int):
    """Random token ids: inputs (B, T), next-token targets (B, T)."""
    cfg = config()
    tokens = torch.randint(0, cfg["vocab_size"], (batch_size, cfg["seq_len"] + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(output, targets):
    """Next-token cross-entropy, in fp32: output (B, T, vocab), targets (B, T)."""
    return F.cross_entropy(output.flatten(0, -2).float(), targets.flatten())


_cfg = config()
TRAINING = {
    "micro_batch": MICRO_BATCH[_cfg["size"]],
    "seq_len": _cfg["seq_len"],
    "optimizer": "adamw",
    "lr": 1e-3 if _cfg["size"] == "tiny" else 6e-4,
}
del _cfg
