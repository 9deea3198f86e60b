"""A model that stresses the tracer's reuse of identical blocks: blocks that take keyword arguments and
return a tuple (one output needs no gradient), a module called twice (shared), a plain tensor attribute,
and two blocks with the same parameters but a different flag (not twins).

Module names: embed, blocks.{0..3}.{norm, proj, gate}, odd.{norm, proj, gate}, head
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, VOCAB, SEQ = 32, 64, 16


class Block(nn.Module):
    def __init__(self, dim: int, squared: bool = False):
        super().__init__()
        self.squared = squared
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, 2 * dim)
        self.gate = nn.Linear(dim, dim, bias=False)

    def forward(self, x, *, scale):
        a, b = self.proj(self.norm(x)).chunk(2, dim=-1)  # (B, T, dim) each, views of one storage
        y = F.relu(a) * torch.sigmoid(self.gate(b))
        if self.squared:
            y = y * y
        count = (y > 0).sum(dim=-1)  # (B, T) int64: needs no gradient
        return x + scale * y, count


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(DIM) for _ in range(4)])
        self.odd = Block(DIM, squared=True)
        self.head = nn.Linear(DIM, VOCAB)
        self.scale = torch.tensor(0.5)  # a plain attribute, not a buffer

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x, _count = block(x, scale=self.scale)
        x, _ = self.odd(x, scale=self.scale)
        x, _ = self.blocks[0](x, scale=self.scale)  # a shared block, called a second time
        return self.head(x)


def build_model():
    return Net()


def make_batch(batch_size):
    # Separate tensors: at batch size 1, tokens[:, :-1].contiguous() would be a view of a (1, SEQ + 1)
    # storage (already contiguous), which makes the bytes not linear in the batch size.
    return torch.randint(0, VOCAB, (batch_size, SEQ)), torch.randint(0, VOCAB, (batch_size, SEQ))


TRAINING = {"micro_batch": 4, "seq_len": SEQ}
