"""A small residual network for the executor's tests (a shard-planner model file).

Modules: embed, blocks.{0..5}.{norm, mlp.{up, act, down}}, norm, head. Dropout-free and deterministic,
so an FSDP2 run and a single-process run of the same batches give the same losses.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, SEQ, LAYERS = 64, 32, 8, 6


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.down(self.act(self.up(x)))  # (B, T, D)


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x):
        return x + self.mlp(self.norm(x))  # (B, T, D)


class Net(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM, layers: int = LAYERS):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.embed(idx)  # (B, T, D)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (B, T, VOCAB)


def build_model():
    return Net()


def make_batch(batch_size: int):
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(output, targets):
    return F.cross_entropy(output.flatten(0, -2).float(), targets.flatten())


TRAINING = {"micro_batch": 4, "seq_len": SEQ, "optimizer": "adamw", "lr": 0.01}
