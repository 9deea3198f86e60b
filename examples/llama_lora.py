"""examples/llama.py fine-tuned: frozen base weights, as a shard-planner model file that freezes them itself.

The model is examples/llama.py's (imported from beside this file; same sizes, batches, loss and module
names), with its base weights frozen (``requires_grad_(False)``) in ``build_model()``. Which parameters
train is chosen with the environment variable ``SHARD_PLANNER_FINETUNE`` (read each time
``build_model()`` is called):

    lora    the default: LoRA adapters (Hu et al. 2021, arXiv:2106.09685) on every block's
            ``attention.wq`` and ``attention.wv``, in peft's layout: the linear becomes a
            :class:`LoRALinear` whose ``base_layer`` is the frozen original and whose ``lora_A`` (in -> r,
            Kaiming-uniform as peft's default) and ``lora_B`` (r -> out, zero-initialised, so the model
            starts as the base) train; ``y = base_layer(x) + lora_B(lora_A(x)) * alpha / r``.
            Rank ``SHARD_PLANNER_LORA_RANK`` (default 8), alpha = 2 r. All parameters stay fp32.
    wq_wv   no adapters: only every block's ``attention.wq.weight`` and ``attention.wv.weight`` train.
    none    nothing frozen (examples/llama.py as it is, for comparison).

Module names: examples/llama.py's; with ``lora``, ``layers.{i}.attention.{wq, wv}`` each hold
``base_layer``, ``lora_A`` and ``lora_B``. ``SHARD_PLANNER_SIZE`` and ``SHARD_PLANNER_SEQ`` are
examples/llama.py's.
"""

import importlib.util
import math
import os
import sys
from pathlib import Path

import torch.nn as nn


def _import_llama():
    """examples/llama.py beside this file, under a fixed module name (the structural hash names classes
    by module: a fixed name keeps the fingerprint equal in every process)."""
    name = "_shard_planner_examples_llama"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("llama.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


llama = _import_llama()
FINETUNES = ("lora", "wq_wv", "none")
TARGETS = ("wq", "wv")  # attention projections that get adapters (lora) or train (wq_wv)


def finetune() -> tuple[str, int]:
    """``SHARD_PLANNER_FINETUNE`` (default "lora") and ``SHARD_PLANNER_LORA_RANK`` (default 8)."""
    kind = os.environ.get("SHARD_PLANNER_FINETUNE", "lora")
    if kind not in FINETUNES:
        raise ValueError(f"SHARD_PLANNER_FINETUNE={kind!r}: choose one of {', '.join(FINETUNES)}")
    rank = int(os.environ.get("SHARD_PLANNER_LORA_RANK") or 8)
    if rank <= 0:
        raise ValueError(f"SHARD_PLANNER_LORA_RANK={rank} must be positive")
    return kind, rank


class LoRALinear(nn.Module):
    """A frozen linear plus a trainable low-rank update, as peft's ``lora.Linear`` lays it out."""

    def __init__(self, base: nn.Linear, rank: int):
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)  # (r, in)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)  # (out, r)
        self.scaling = 2.0  # alpha / r with alpha = 2 r
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # peft's default for A
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling  # (..., out)


def build_model() -> nn.Module:
    kind, rank = finetune()
    model = llama.build_model()
    if kind == "none":
        return model
    model.requires_grad_(False)
    for layer in model.layers:
        for name in TARGETS:
            linear = getattr(layer.attention, name)
            if kind == "lora":
                setattr(layer.attention, name, LoRALinear(linear, rank))
            else:
                linear.weight.requires_grad_(True)
    return model


make_batch = llama.make_batch
loss_fn = llama.loss_fn
TRAINING = dict(llama.TRAINING)
