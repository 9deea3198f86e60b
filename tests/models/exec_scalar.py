"""A small residual network with 0-d parameters (like CLIP's ``logit_scale``), for the executor's and the
cost model's tests: one on the root (``logit_scale``) and one per block (``gate``).

Modules: embed, blocks.{0..3}.{norm, mlp.{up, act, down}}, norm, head. Dropout-free and deterministic."""

import importlib.util
from pathlib import Path

import torch
import torch.nn as nn

# exec_net.py beside this file, loaded by path (the tool loads model files by path, not as a package):
# its MLP, batch, loss and training defaults; this file adds the 0-d parameters.
_spec = importlib.util.spec_from_file_location("exec_net", Path(__file__).with_name("exec_net.py"))
exec_net = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exec_net)

VOCAB, DIM, SEQ, LAYERS = exec_net.VOCAB, exec_net.DIM, exec_net.SEQ, 4
make_batch, loss_fn, TRAINING = exec_net.make_batch, exec_net.loss_fn, exec_net.TRAINING


class Block(exec_net.Block):
    def __init__(self, dim: int):
        super().__init__(dim)  # norm, mlp
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
