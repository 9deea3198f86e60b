"""Structural identity of modules, without running them.

``structural_hashes`` gives each module a hash of its class, its own parameter and buffer shapes and
dtypes, and (recursively) its children's names and hashes: two transformer blocks of the same shape get
the same hash, so the tracer traces one and reuses its numbers for the rest. ``model_fingerprint`` is
the hash of the root plus every module's name, which a plan records and the executor checks against
the real model it is applied to. Both work on meta, fake and real modules alike. A quantised parameter
(an NF4 weight) hashes with what it stores, so a QLoRA model's fingerprint is not its LoRA twin's.
"""

from __future__ import annotations

import hashlib

import torch.nn as nn

from shard_planner.model.param_storage import stored_parts


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _class_module(cls: type) -> str:
    """The class's module name, except for a model file imported by path: modelfile._import names it
    ``_shard_planner_model_<hash of the path>``, with Python's per-process salted ``hash``, so that name
    differs between processes (and between folders); the file's classes are named by qualname alone."""
    name = cls.__module__
    return "<model file>" if name.startswith("_shard_planner_model_") else name


def _stored_as(p) -> str:
    """"" for a plain parameter (hashes as before); a quantised one adds what it stores, so an NF4 weight
    (whose dtype and shape are the bf16 weight's) does not hash like the bf16 weight it stands for."""
    parts = stored_parts(p)
    if len(parts) == 1 and parts[0].numel == p.numel():
        return ""
    return ":" + type(p).__name__ + "".join(f"[{q.dtype}x{q.numel}{'' if q.sharded else 'r'}]" for q in parts)


def structural_hashes(model: nn.Module) -> dict[str, str]:
    """fqn -> structural hash, for every module of ``model`` (the root is ``""``)."""
    hashes: dict[str, str] = {}

    def visit(fqn: str, module: nn.Module) -> str:
        parts = [_class_module(type(module)) + "." + type(module).__qualname__]
        for name, p in module.named_parameters(recurse=False):
            parts.append(f"p:{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}" + _stored_as(p))
        for name, b in module.named_buffers(recurse=False):
            parts.append(f"b:{name}:{tuple(b.shape)}:{b.dtype}")
        for name, child in module.named_children():
            parts.append(f"c:{name}:{visit(f'{fqn}.{name}' if fqn else name, child)}")
        hashes[fqn] = _digest("|".join(parts))
        return hashes[fqn]

    visit("", model)
    return hashes


def model_fingerprint(model: nn.Module) -> str:
    """A short hash of the whole model's structure: module names, classes, parameter shapes and dtypes."""
    hashes = structural_hashes(model)
    return _digest(";".join(f"{fqn}={h}" for fqn, h in sorted(hashes.items())))
