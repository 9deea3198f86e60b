"""Repeated blocks whose callers modify a sub-block's output in place, as transformers' Falcon does
(``mlp_output += attention_output``): ``Mlp`` returns a view of a larger storage (the first half of a
projection), and ``Block`` adds to it in place; ``Gate`` returns a whole storage that ``Block`` scales
in place. Reusing ``Mlp`` or ``Gate`` of a later block would hand the caller a stand-in output to modify
(trace/twins.py): the tracer must trace those blocks themselves. The blocks differ in a constant
(``residual_scale``), so they are not twins of each other, while their ``mlp`` and ``gate`` are.

Module names: embed, blocks.{0..3}.{attn, mlp.proj, gate.proj}, head
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, VOCAB, SEQ = 32, 64, 16


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, 2 * DIM)

    def forward(self, x):
        return F.gelu(self.proj(x))[..., :DIM]  # (B, T, DIM): a view of a (B, T, 2 DIM) storage


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        return torch.tanh(self.proj(x)) * 2


class Block(nn.Module):
    def __init__(self, depth: int):
        super().__init__()
        self.residual_scale = 1.0 / (1 + depth)  # differs per block: blocks are not twins, their children are
        self.attn = nn.Linear(DIM, DIM)
        self.mlp = Mlp()
        self.gate = Gate()

    def forward(self, x):
        out = self.mlp(x)
        out += self.attn(x)  # in place, on a sub-module's output (a view)
        g = self.gate(x)
        g *= 0.5  # in place, on a sub-module's output (a whole storage)
        return x + self.residual_scale * out * g


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(i) for i in range(4)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model():
    return Net()


def make_batch(batch_size):
    return torch.randint(0, VOCAB, (batch_size, SEQ)), torch.randint(0, VOCAB, (batch_size, SEQ))


TRAINING = {"micro_batch": 2, "seq_len": SEQ}
