"""Sibling modules called in another order than registered, as transformers' BertEmbeddings (registers
word, position, token_type embeddings; calls word, token_type, position). Module names: embed.{word,
position, kind}, norm, head."""

import torch
import torch.nn as nn

DIM, VOCAB, SEQ = 16, 32, 8


class Embeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.word = nn.Embedding(VOCAB, DIM)
        self.position = nn.Embedding(SEQ, DIM)
        self.kind = nn.Embedding(2, DIM)

    def forward(self, tokens):
        x = self.word(tokens)
        x = x + self.kind(torch.zeros_like(tokens))  # called second, registered third
        return x + self.position(torch.arange(tokens.shape[1], device=tokens.device))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = Embeddings()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        return self.head(self.norm(self.embed(tokens)))


def build_model():
    return Net()


def make_batch(batch_size):
    return torch.randint(0, VOCAB, (batch_size, SEQ)), torch.randint(0, VOCAB, (batch_size, SEQ))


TRAINING = {"micro_batch": 2, "seq_len": SEQ}
