"""Vision Transformer (ViT) image classifier, as a shard-planner model file.

A convolutional patch embedding, a learned class token and position embedding (``nn.Parameter``s on
the root module), a stack of pre-LayerNorm encoder blocks (bidirectional self-attention through
``F.scaled_dot_product_attention``, GELU MLP), a final LayerNorm and a linear classification head on
the class token. Shapes follow Dosovitskiy et al. 2020 / timm, so parameter counts match ViT-B/16 and
ViT-L/16.

Module names (FSDP units are chosen by fully-qualified name)::

    patch_embed.proj, cls_token, pos_embed,
    blocks.{i}.{norm1, attn.{qkv, proj}, norm2, mlp.{fc1, fc2}}, norm, head

Sizes, chosen with the environment variable ``SHARD_PLANNER_SIZE`` (read each time ``build_model()``
and ``make_batch()`` are called; ``TRAINING`` is computed when the file is imported):

    tiny   32x32 images,  patch 8,  dim 64,   4 layers,  4 heads,  10 classes   (the default)
    base   224x224 images, patch 16, dim 768,  12 layers, 12 heads, 1000 classes (ViT-B/16, 86.6M)
    large  224x224 images, patch 16, dim 1024, 24 layers, 16 heads, 1000 classes (ViT-L/16, 304M)

Inputs are images (B, 3, H, W); targets are class ids (B,).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIGS = {
    "tiny": dict(img_size=32, patch_size=8, dim=64, depth=4, n_heads=4, mlp_ratio=4, n_classes=10),
    "base": dict(img_size=224, patch_size=16, dim=768, depth=12, n_heads=12, mlp_ratio=4, n_classes=1000),
    "large": dict(img_size=224, patch_size=16, dim=1024, depth=24, n_heads=16, mlp_ratio=4, n_classes=1000),
}
MICRO_BATCH = {"tiny": 16, "base": 64, "large": 32}
IN_CHANNELS = 3


def config() -> dict:
    """The configuration chosen by ``SHARD_PLANNER_SIZE`` (default "tiny")."""
    size = os.environ.get("SHARD_PLANNER_SIZE", "tiny")
    if size not in CONFIGS:
        raise ValueError(f"SHARD_PLANNER_SIZE={size!r} is not a ViT size; choose one of {', '.join(CONFIGS)}")
    return dict(CONFIGS[size], size=size)


class PatchEmbed(nn.Module):
    def __init__(self, patch_size: int, in_channels: int, dim: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        x = self.proj(x)  # (B, C, H/p, W/p)
        return x.flatten(2).transpose(1, 2)  # (B, N, C), N = (H/p) * (W/p)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        assert dim % n_heads == 0
        self.n_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).view(B, N, 3, self.n_heads, C // self.n_heads)  # (B, N, 3, nh, hs)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, nh, N, hs)
        y = F.scaled_dot_product_attention(q, k, v)  # (B, nh, N, hs)
        y = y.transpose(1, 2).reshape(B, N, C)  # (B, N, C)
        return self.proj(y)  # (B, N, C)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))  # (B, N, hidden) -> (B, N, C)


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, mlp_ratio: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, n_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = MLP(dim, mlp_ratio * dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))  # (B, N, C)
        x = x + self.mlp(self.norm2(x))  # (B, N, C)
        return x


class VisionTransformer(nn.Module):
    def __init__(self, img_size, patch_size, dim, depth, n_heads, mlp_ratio, n_classes, in_channels=IN_CHANNELS):
        super().__init__()
        assert img_size % patch_size == 0
        n_patches = (img_size // patch_size) ** 2
        self.patch_embed = PatchEmbed(patch_size, in_channels, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, n_patches + 1, dim))
        self.blocks = nn.ModuleList([Block(dim, n_heads, mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, n_classes)
        # Plain normal init: nn.init.trunc_normal_ (torch 2.13) rejection-samples with a data-dependent
        # loop, which FakeTensorMode cannot run.
        nn.init.normal_(self.cls_token, std=1e-6)
        nn.init.normal_(self.pos_embed, std=0.02)

    def forward(self, images):
        B = images.shape[0]
        x = self.patch_embed(images)  # (B, N, C)
        cls = self.cls_token.expand(B, -1, -1)  # (B, 1, C)
        x = torch.cat([cls, x], dim=1) + self.pos_embed  # (B, N+1, C)
        for block in self.blocks:
            x = block(x)  # (B, N+1, C)
        x = self.norm(x)  # (B, N+1, C)
        return self.head(x[:, 0])  # (B, n_classes), from the class token


def build_model() -> nn.Module:
    cfg = config()
    return VisionTransformer(
        cfg["img_size"], cfg["patch_size"], cfg["dim"], cfg["depth"], cfg["n_heads"], cfg["mlp_ratio"],
        cfg["n_classes"],
    )


def make_batch(batch_size: int):
    """Random images (B, 3, H, W) and class ids (B,)."""
    cfg = config()
    images = torch.randn(batch_size, IN_CHANNELS, cfg["img_size"], cfg["img_size"])
    labels = torch.randint(0, cfg["n_classes"], (batch_size,))
    return images, labels


def loss_fn(output, targets):
    """Classification cross-entropy, in fp32: output (B, n_classes), targets (B,)."""
    return F.cross_entropy(output.float(), targets)


_cfg = config()
TRAINING = {
    "micro_batch": MICRO_BATCH[_cfg["size"]],
    "optimizer": "adamw",
    "lr": 1e-3 if _cfg["size"] == "tiny" else 3e-4,
}
del _cfg
