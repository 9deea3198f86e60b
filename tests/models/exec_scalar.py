"""A small residual network with 0-d parameters (like CLIP's ``logit_scale``), for the executor's and the
cost model's tests: one on the root (``logit_scale``) and one per block (``gate``).

Modules: embed, blocks.{0..3}.{norm, mlp.{up, act, down}}, norm, head. Dropout-free and deterministic."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, SEQ, LAYERS = 64, 32, 8, 4


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
        self.gate = nn.Parameter(torch.tensor(0.5))  # 0-d

    def forward(self, x):
        return x + self.gate * self.mlp(self.norm(x))  # (B, T, D)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.logit_scale = nn.Parameter(torch.tensor(0.3))  # 0-d, as CLIP's

    def forward(self, idx):
        x = self.embed(idx)  # (B, T, D)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) * self.logit_scale.exp()  # (B, T, VOCAB)


def build_model():
    return Net()


def make_batch(batch_size: int):
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(output, targets):
    return F.cross_entropy(output.flatten(0, -2).float(), targets.flatten())


TRAINING = {"micro_batch": 4, "seq_len": SEQ, "optimizer": "adamw", "lr": 0.01}
