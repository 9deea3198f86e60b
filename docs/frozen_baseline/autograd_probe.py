"""What autograd saves for backward and which GEMMs it runs when a weight is frozen (docs/frozen_facts.md).

    python docs/frozen_baseline/autograd_probe.py     # output: docs/frozen_baseline/autograd_probe.txt

On CPU, real tensors: ``saved_tensors_hooks`` names each saved tensor (the input, the weight, or another
tensor), FlopCounterMode counts the backward's FLOPs. x: (4, 16, 64); Linear(64, 32, bias=False); one GEMM of
the backward is 2 * 64 * 64 * 32 = 262,144 FLOPs.
"""

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.flop_counter import FlopCounterMode


def _name(t, named):
    for name, other in named.items():
        if t.untyped_storage().data_ptr() == other.untyped_storage().data_ptr():
            return name
    return "other"


def probe(title, make_module, weight_grad: bool, x_grad: bool) -> None:
    torch.manual_seed(0)
    module = make_module()
    module.requires_grad_(False)
    for name, p in module.named_parameters():
        p.requires_grad_(weight_grad or name.startswith(("A.", "B.")))  # a LoRA pair always trains
    x = torch.randn(4, 16, 64, requires_grad=x_grad)
    named = {"input": x, **{n: p for n, p in module.named_parameters()}}
    saved = []

    def pack(t):
        saved.append(f"{_name(t, named)} {tuple(t.shape)}")
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        y = module(x)
    line = f"{title}: weight requires_grad={weight_grad}, input requires_grad={x_grad}: saved {saved or 'nothing'}"
    if y.requires_grad:
        with FlopCounterMode(display=False) as fc:
            y.sum().backward()
        counts = {str(op).removeprefix("aten."): n for op, n in fc.get_flop_counts()["Global"].items()}
        line += f"; backward FLOPs {fc.get_total_flops():,} {counts}"
    else:
        line += "; output needs no gradient: no backward"
    print(line)


class LoRA(nn.Module):
    def __init__(self):
        super().__init__()
        self.base, self.A, self.B = nn.Linear(64, 32, bias=False), nn.Linear(64, 8, bias=False), nn.Linear(8, 32, bias=False)

    def forward(self, x):
        return self.base(x) + self.B(self.A(x))


if __name__ == "__main__":
    print(f"torch {torch.__version__}")
    for wg, xg in [(True, True), (False, True), (True, False), (False, False)]:
        probe("Linear", lambda: nn.Linear(64, 32, bias=False), wg, xg)
    probe("Linear with bias", lambda: nn.Linear(64, 32), False, True)
    probe("LoRA (frozen base, trainable A 64->8, B 8->32)", LoRA, False, True)
    probe("LoRA (frozen base, trainable A 64->8, B 8->32)", LoRA, False, False)
