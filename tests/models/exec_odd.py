"""exec_net.py's residual network at sizes no world size of 2 or 4 divides (dim 0 of 61 and 33 rows), so
that FSDP2 pads every rank's shard: for the communication-bytes tests (cost/comm_bytes.py).

Modules: embed, blocks.{0..3}.{norm, mlp.{up, act, down}}, norm, head. Dropout-free and deterministic."""

import importlib.util
from pathlib import Path

import torch

# exec_net.py beside this file, loaded by path (the tool loads model files by path, not as a package).
_spec = importlib.util.spec_from_file_location("exec_net", Path(__file__).with_name("exec_net.py"))
exec_net = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exec_net)

VOCAB, DIM, SEQ, LAYERS = 61, 33, exec_net.SEQ, 4
loss_fn, TRAINING = exec_net.loss_fn, exec_net.TRAINING


def build_model():
    return exec_net.Net(VOCAB, DIM, LAYERS)


def make_batch(batch_size: int):
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
