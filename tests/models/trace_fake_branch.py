"""A model whose code behaves differently when traced, as transformers' Llama does (DESIGN.md, "FSDP2
facts"): under fake tensors it materialises a (T, T) causal mask and hands it to SDPA, where a real run
uses SDPA's built-in causal handling. Only a comparison with a real run shows the difference."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

DIM, HEADS, VOCAB, SEQ = 32, 4, 64, 32


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, C // HEADS).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, hd)
        if isinstance(x, FakeTensor):  # "am I being traced?"
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril().expand(B, HEADS, T, T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.contiguous())
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = Attention()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        return self.head(x + self.attn(x))


def build_model():
    return Net()


def make_batch(batch_size):
    return torch.randint(0, VOCAB, (batch_size, SEQ)), torch.randint(0, VOCAB, (batch_size, SEQ))
