"""Models whose parameters are partly frozen as built, for the tracer's tests (tests/trace/test_frozen.py).

``TRACE_FROZEN_MODEL`` (read by ``build_model()`` and ``make_batch()``) picks one:

- ``chain`` (the default): three linears without bias, x (B, 16, 64) -> l0 (64 -> 64) -> l1 (64 -> 32) -> l2
  (32 -> 8), fp32; ``TRACE_FROZEN`` names those built frozen, comma-separated ("l1", "l0,l1"; empty: none).
- ``mixed``: one module ``m`` holding a frozen fp32 weight (32, 64), a trainable fp32 bias (32,), a frozen
  0-d bf16 ``gate`` and a trainable 0-d fp32 ``gain``: every parameter field of one module at once.
- ``stack``: a frozen embedding, four identical blocks (a frozen LayerNorm, a frozen base linear and a
  trainable low-rank pair), a frozen head: repeated frozen blocks for the tracer's reuse of identical ones.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

T, D0, D1, D2 = 16, 64, 32, 8
VOCAB, DIM, RANK = 64, 32, 4


def kind() -> str:
    return os.environ.get("TRACE_FROZEN_MODEL", "chain")


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0 = nn.Linear(D0, D0, bias=False)
        self.l1 = nn.Linear(D0, D1, bias=False)
        self.l2 = nn.Linear(D1, D2, bias=False)

    def forward(self, x):  # (B, T, 64) -> (B, T, 8)
        return self.l2(self.l1(self.l0(x)))


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D1, D0), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(D1))
        self.gate = nn.Parameter(torch.tensor(1.0, dtype=torch.bfloat16), requires_grad=False)
        self.gain = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):  # (B, T, 64) -> (B, T, 32)
        return F.linear(x, self.weight, self.bias) * self.gate.to(x.dtype) * self.gain


class MixedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = Mixed()
        self.head = nn.Linear(D1, D2, bias=False)

    def forward(self, x):
        return self.head(self.m(x))


class LoRABlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM).requires_grad_(False)
        self.base = nn.Linear(DIM, DIM, bias=False).requires_grad_(False)
        self.lora_A = nn.Linear(DIM, RANK, bias=False)
        self.lora_B = nn.Linear(RANK, DIM, bias=False)

    def forward(self, x):  # (B, T, DIM)
        h = self.norm(x)
        return x + self.base(h) + self.lora_B(self.lora_A(h))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM).requires_grad_(False)
        self.blocks = nn.ModuleList([LoRABlock() for _ in range(4)])
        self.head = nn.Linear(DIM, VOCAB, bias=False).requires_grad_(False)

    def forward(self, tokens):  # (B, T) -> (B, T, VOCAB)
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_model() -> nn.Module:
    if kind() == "mixed":
        return MixedNet()
    if kind() == "stack":
        return Stack()
    model = Chain()
    for name in filter(None, os.environ.get("TRACE_FROZEN", "").split(",")):
        getattr(model, name).requires_grad_(False)
    return model


def make_batch(batch_size: int):
    if kind() == "stack":
        tokens = torch.randint(0, VOCAB, (batch_size, T + 1))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return torch.randn(batch_size, T, D0), torch.randn(batch_size, T, D2)


def loss_fn(output, targets):
    if kind() == "stack":
        return F.cross_entropy(output.flatten(0, -2), targets.flatten())
    return F.mse_loss(output, targets)
