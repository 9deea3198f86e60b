"""U-Net for per-pixel image segmentation, as a shard-planner model file.

Not a uniform stack: every stage has its own width and resolution (channels double on the way down
and halve on the way up, so parameters and activations are distributed very unevenly), and the up
path concatenates the matching down-path feature map (skip connections). Each stage is a double
3x3 convolution with GroupNorm (no running statistics, so no batch-size-dependent buffers) and ReLU;
downsampling is 2x2 max-pooling, upsampling a 2x2 transposed convolution. The output is per-pixel
class logits.

Module names (FSDP units are chosen by fully-qualified name)::

    inc, downs.{i}, bottleneck, ups.{i}.{up, conv}, outc
    (each double convolution has conv1, norm1, conv2, norm2)

Sizes, chosen with the environment variable ``SHARD_PLANNER_SIZE`` (read each time ``build_model()``
and ``make_batch()`` are called; ``TRAINING`` is computed when the file is imported):

    tiny  32x32 images,   channels 8-16-32,      bottleneck 64,   4 classes  (the default)
    base  256x256 images, channels 64-128-256-512, bottleneck 1024, 21 classes (Ronneberger et al. 2015
          widths, ~31M params)

Inputs are images (B, 3, H, W); targets are class ids per pixel (B, H, W).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIGS = {
    "tiny": dict(img_size=32, channels=(8, 16, 32), bottleneck=64, n_classes=4),
    "base": dict(img_size=256, channels=(64, 128, 256, 512), bottleneck=1024, n_classes=21),
}
MICRO_BATCH = {"tiny": 8, "base": 8}
IN_CHANNELS = 3


def config() -> dict:
    """The configuration chosen by ``SHARD_PLANNER_SIZE`` (default "tiny")."""
    size = os.environ.get("SHARD_PLANNER_SIZE", "tiny")
    if size not in CONFIGS:
        raise ValueError(f"SHARD_PLANNER_SIZE={size!r} is not a U-Net size; choose one of {', '.join(CONFIGS)}")
    return dict(CONFIGS[size], size=size)


class DoubleConv(nn.Module):
    """(conv 3x3 -> GroupNorm -> ReLU) x 2; keeps the resolution."""

    def __init__(self, in_ch: int, out_ch: int):
        super().__init__()
        groups = min(8, out_ch)
        self.conv1 = nn.Conv2d(in_ch, out_ch, kernel_size=3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(groups, out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, kernel_size=3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(groups, out_ch)

    def forward(self, x):
        x = F.relu(self.norm1(self.conv1(x)))  # (B, out, H, W)
        return F.relu(self.norm2(self.conv2(x)))  # (B, out, H, W)


class Down(nn.Module):
    """Halve the resolution, then a double convolution."""

    def __init__(self, in_ch: int, out_ch: int):
        super().__init__()
        self.conv = DoubleConv(in_ch, out_ch)

    def forward(self, x):
        return self.conv(F.max_pool2d(x, 2))  # (B, in, H, W) -> (B, out, H/2, W/2)


class Up(nn.Module):
    """Double the resolution, concatenate the skip connection, then a double convolution."""

    def __init__(self, in_ch: int, out_ch: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(in_ch, out_ch, kernel_size=2, stride=2)
        self.conv = DoubleConv(2 * out_ch, out_ch)

    def forward(self, x, skip):
        x = self.up(x)  # (B, in, H, W) -> (B, out, 2H, 2W)
        x = torch.cat([skip, x], dim=1)  # (B, 2 * out, 2H, 2W)
        return self.conv(x)  # (B, out, 2H, 2W)


class UNet(nn.Module):
    def __init__(self, channels, bottleneck: int, n_classes: int, in_channels: int = IN_CHANNELS):
        super().__init__()
        channels = list(channels)
        self.inc = DoubleConv(in_channels, channels[0])
        self.downs = nn.ModuleList([Down(a, b) for a, b in zip(channels[:-1], channels[1:])])
        self.bottleneck = Down(channels[-1], bottleneck)
        widths = channels[::-1]  # deepest first
        self.ups = nn.ModuleList([Up(a, b) for a, b in zip([bottleneck] + widths[:-1], widths)])
        self.outc = nn.Conv2d(channels[0], n_classes, kernel_size=1)

    def forward(self, images):
        x = self.inc(images)  # (B, c0, H, W)
        skips = [x]
        for down in self.downs:
            x = down(x)  # (B, c_{i+1}, H / 2^(i+1), W / 2^(i+1))
            skips.append(x)
        x = self.bottleneck(x)  # (B, bottleneck, H / 2^L, W / 2^L), L = number of levels
        for up, skip in zip(self.ups, reversed(skips)):
            x = up(x, skip)  # back up one level: channels halve, resolution doubles
        return self.outc(x)  # (B, n_classes, H, W)


def build_model() -> nn.Module:
    cfg = config()
    return UNet(cfg["channels"], cfg["bottleneck"], cfg["n_classes"])


def make_batch(batch_size: int):
    """Random images (B, 3, H, W) and per-pixel class ids (B, H, W)."""
    cfg = config()
    size = cfg["img_size"]
    assert size % 2 ** len(cfg["channels"]) == 0, "the image size must be divisible by 2^levels"
    images = torch.randn(batch_size, IN_CHANNELS, size, size)
    masks = torch.randint(0, cfg["n_classes"], (batch_size, size, size))
    return images, masks


def loss_fn(output, targets):
    """Per-pixel cross-entropy over the class (channel) dim, in fp32: output (B, K, H, W), targets (B, H, W)."""
    return F.cross_entropy(output.float(), targets)


_cfg = config()
TRAINING = {
    "micro_batch": MICRO_BATCH[_cfg["size"]],
    "optimizer": "adamw",
    "lr": 1e-3 if _cfg["size"] == "tiny" else 3e-4,
}
del _cfg
