"""A stack of blocks numbered as transformers numbers its layers (``self.layer_idx = i`` on the block's
attention), a plain tensor attribute made from Python data and then filled in place (a constant fake mode tracks),
and a weight initialised in place: the tracer reuses the blocks and keeps the filled constant.

Module names: embed, layers.{0..3}.{attn.{proj}, mlp}, head
"""

import torch
import torch.nn as nn

DIM, VOCAB, SEQ = 16, 32, 8


class Attn(nn.Module):
    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx  # numbers the block; a training step does not read it
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        return torch.softmax(self.proj(x), dim=-1)


class Block(nn.Module):
    def __init__(self, layer_idx: int):
        super().__init__()
        self.attn = Attn(layer_idx)
        self.mlp = nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + self.mlp(self.attn(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.layers = nn.ModuleList([Block(i) for i in range(4)])
        self.head = nn.Linear(DIM, VOCAB)
        self.repeats = torch.tensor(1)  # a constant under fake mode
        self.repeats.fill_(2)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers[: 2 + int(self.repeats.item())]:  # all 4 once the fill_ ran
            x = layer(x)
        return self.head(x)


def build_model():
    return Net()


def make_batch(batch_size):
    return torch.randint(0, VOCAB, (batch_size, SEQ)), torch.randint(0, VOCAB, (batch_size, SEQ))


TRAINING = {"micro_batch": 2, "seq_len": SEQ}
