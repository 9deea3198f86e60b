"""A tensor-parallel-ready copy of examples/llama.py (tiny by default) for the TP trace tests: its attention
views the projections with ``-1`` heads (``view(B, T, -1, head_dim)``, as torchtitan's and transformers'
attention do), so it runs on a rank's local column shards (tiny: 8 heads, 4 kv heads, so that 4 ranks split whole heads); ``TP_STYLES`` is torchtitan's Llama plan as
shard_planner/tensor_parallel.py styles. Otherwise examples/llama.py.

Llama 3 style decoder-only language model, as a shard-planner model file.

Pre-RMSNorm transformer blocks with rotary position embeddings (computed in each forward with real
cos/sin arithmetic, no complex numbers and no buffers), grouped-query attention (K/V with fewer heads
handed to ``F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)``, no K/V
repetition), a SwiGLU feed-forward (w1, w2, w3), a final RMSNorm and an untied ``output`` projection.
The shapes follow Meta's reference implementation, so parameter counts match the published models.

Module names (FSDP units are chosen by fully-qualified name)::

    tok_embeddings,
    layers.{i}.{attention_norm, attention.{wq, wk, wv, wo}, ffn_norm, feed_forward.{w1, w2, w3}},
    norm, output

Sizes, chosen with the environment variable ``SHARD_PLANNER_SIZE`` (read each time ``build_model()``
and ``make_batch()`` are called; ``TRAINING`` is computed when the file is imported):

    tiny   dim 64,    2 layers,   8 heads,   4 kv heads, ffn 192,   vocab 512, seq 64 (the default)
    1b     dim 2048,  16 layers,  32 heads,  8 kv heads, ffn 8192,  vocab 128256, seq 4096
           (Llama 3.2 1B shapes; the real 1B ties output to tok_embeddings, this file does not)
    8b     dim 4096,  32 layers,  32 heads,  8 kv heads, ffn 14336, vocab 128256, seq 4096  (Llama 3 8B)
    70b    dim 8192,  80 layers,  64 heads,  8 kv heads, ffn 28672, vocab 128256, seq 4096  (Llama 3 70B)
    405b   dim 16384, 126 layers, 128 heads, 8 kv heads, ffn 53248, vocab 128256, seq 4096 (Llama 3.1 405B)
    2-13b  dim 5120,  40 layers,  40 heads,  40 kv heads, ffn 13824, vocab 32000, seq 4096  (Llama 2 13B)
    2-70b  dim 8192,  80 layers,  64 heads,  8 kv heads, ffn 28672, vocab 32000, seq 4096   (Llama 2 70B)
           (Llama 2 rotates with theta 1e4, this file with Llama 3's 5e5: the angles change no shape or cost)

``SHARD_PLANNER_SEQ`` (optional) overrides the tokens per sample (rotary embeddings have no maximum).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIGS = {
    "tiny": dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=192, vocab_size=512, seq_len=64),
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256, seq_len=4096),
    "8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256, seq_len=4096),
    "70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256, seq_len=4096),
    "405b": dict(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248, vocab_size=128256, seq_len=4096
    ),
    "2-13b": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824, vocab_size=32000, seq_len=4096),
    "2-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=32000, seq_len=4096),
}
MICRO_BATCH = {"tiny": 8, "1b": 2, "8b": 1, "70b": 1, "405b": 1, "2-13b": 1, "2-70b": 1}
ROPE_THETA = 500000.0
NORM_EPS = 1e-5


def config() -> dict:
    """The configuration chosen by ``SHARD_PLANNER_SIZE`` (default "tiny") and ``SHARD_PLANNER_SEQ``."""
    size = os.environ.get("SHARD_PLANNER_SIZE", "tiny")
    if size not in CONFIGS:
        raise ValueError(f"SHARD_PLANNER_SIZE={size!r} is not a Llama size; choose one of {', '.join(CONFIGS)}")
    cfg = dict(CONFIGS[size], size=size)
    seq = int(os.environ.get("SHARD_PLANNER_SEQ") or cfg["seq_len"])
    if seq <= 0:
        raise ValueError(f"SHARD_PLANNER_SEQ={seq} must be positive")
    cfg["seq_len"] = seq
    return cfg


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., dim), fp32
        return xf.type_as(x) * self.weight


def rotary_cos_sin(seq_len: int, head_dim: int, device, theta: float = ROPE_THETA):
    """cos and sin of the rotary angles, each (T, head_dim / 2), fp32."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)  # (hd/2,)
    t = torch.arange(seq_len, device=device, dtype=torch.float32)  # (T,)
    angles = torch.outer(t, freqs)  # (T, hd/2)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    """Rotate consecutive pairs (x[2i], x[2i+1]) of the last dim, as Meta's complex-number version does.

    x: (B, H, T, hd); cos, sin: (T, hd/2).
    """
    xf = x.float().unflatten(-1, (-1, 2))  # (B, H, T, hd/2, 2)
    x1, x2 = xf[..., 0], xf[..., 1]  # (B, H, T, hd/2) each
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, H, T, hd/2, 2)
    return out.flatten(-2).type_as(x)  # (B, H, T, hd)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        assert dim % n_heads == 0 and n_heads % n_kv_heads == 0
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, dim)
        return self.wo(y)  # (B, T, dim)


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)  # gate
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)  # down
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)  # up

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, ffn) -> (B, T, dim)


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, ffn_dim: int):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, ffn_dim)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)  # (B, T, dim)
        return h + self.feed_forward(self.ffn_norm(h))  # (B, T, dim)


class Transformer(nn.Module):
    def __init__(self, dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size):
        super().__init__()
        self.head_dim = dim // n_heads
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(
            [TransformerBlock(dim, n_heads, n_kv_heads, ffn_dim) for _ in range(n_layers)]
        )
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        # Small-std init (what torchtitan uses for the linears); a no-op cost on the meta device.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens):
        B, T = tokens.shape
        cos, sin = rotary_cos_sin(T, self.head_dim, tokens.device)  # (T, hd/2) each
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        for layer in self.layers:
            h = layer(h, cos, sin)  # (B, T, dim)
        h = self.norm(h)  # (B, T, dim)
        return self.output(h)  # (B, T, vocab)


def build_model() -> nn.Module:
    cfg = config()
    return Transformer(
        cfg["dim"], cfg["n_layers"], cfg["n_heads"], cfg["n_kv_heads"], cfg["ffn_dim"], cfg["vocab_size"]
    )


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
    "lr": 1e-3 if _cfg["size"] == "tiny" else 3e-4,
}
del _cfg


def tp_styles(n_layers: int | None = None) -> dict[str, str]:
    """torchtitan's Llama tensor-parallel plan (models/llama3/infra/parallelize.py ``apply_tp``) as styles."""
    n = config()["n_layers"] if n_layers is None else n_layers
    styles = {"tok_embeddings": "embedding", "norm": "norm", "output": "head"}
    for i in range(n):
        p = f"layers.{i}"
        styles |= {f"{p}.attention_norm": "norm", f"{p}.attention": "gather_input", f"{p}.attention.wq": "colwise",
                   f"{p}.attention.wk": "colwise", f"{p}.attention.wv": "colwise", f"{p}.attention.wo": "rowwise",
                   f"{p}.ffn_norm": "norm", f"{p}.feed_forward": "gather_input", f"{p}.feed_forward.w1": "colwise",
                   f"{p}.feed_forward.w3": "colwise", f"{p}.feed_forward.w2": "rowwise"}
    return styles
