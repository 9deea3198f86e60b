"""Data-dependent routing (mixture of experts) under fake tensors: traced as balanced routing at top-k.

[Note: balanced routing] An MoE layer picks each token's experts with ``torch.topk`` over the router's
scores and then asks questions whose answers are values, not shapes: which experts got a token
(``aten.nonzero``, which under fake tensors raises DynamicOutputShapeException), which tokens each
expert got (``torch.where``), whether an index equals a sentinel (``bool(t)``). transformers' Mixtral
with ``experts_implementation="eager"`` does all three. A fake tensor has no values, so the tracer
assumes them: the indices ``torch.topk`` returns in a traced forward are a balanced assignment (row r's
j-th choice is expert ``(r * k + j) mod n`` for k of n), so every expert gets ``rows * k / n`` tokens
(to within one), which is the routing an auxiliary load-balancing loss aims for. From there
:class:`KnownValues` carries real values alongside the fake tensors that derive only from them (integer
work on a (tokens, k) index: one-hot, sums, comparisons, nonzero, select), computes each such op on
the real values as well, and answers a data-dependent op from them. Ops that also read a tensor without
known values run under fake mode as usual (a gather of the hidden states by a known index keeps its
shape), so only the routing decisions are assumed; activations, FLOPs and peaks follow from them. A
real run with unbalanced routing differs by the imbalance (its busiest expert holds more tokens).
"""

from __future__ import annotations

import logging

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           unset_fake_temporarily)
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

logger = logging.getLogger(__name__)

aten = torch.ops.aten
ASSUMPTION = ("MoE routing traced as balanced routing at the configured top-k (torch.topk's indices in forward: "
              "row r's j-th choice is expert (r*k + j) mod n, so each of n experts gets rows*k/n tokens)")


class KnownValues:
    """Real values carried alongside fake tensors that derive only from balanced routing indices."""

    def __init__(self):
        self.values = WeakTensorKeyDictionary()  # fake tensor -> its real (CPU) value
        self.answered = 0  # data-dependent ops answered from known values

    def dispatch(self, func, args, kwargs):
        """Run ``func`` (under the fake mode below the caller) keeping known values where they follow."""
        if self.values and _tensors_all_known(self, args, kwargs):
            return self._run_known(func, args, kwargs)
        out = func(*args, **kwargs)
        if func is aten.topk.default and isinstance(out[1], FakeTensor):
            with unset_fake_temporarily():
                self.values[out[1]] = balanced_indices(out[1].shape, _dim(args, kwargs), args[0].shape)
        elif self.values and _integer_factory(func, args, kwargs, out):  # one_hot's arange: known too
            with unset_fake_temporarily():
                self.values[out] = func(*args, **kwargs)
        elif self.values and args and isinstance(args[0], torch.Tensor) and args[0] in self.values:
            if func._schema.arguments and (alias := func._schema.arguments[0].alias_info) is not None \
                    and alias.is_write:
                del self.values[args[0]]  # written from values not known: forget it
        return out

    def _run_known(self, func, args, kwargs):
        real_args, real_kwargs = tree_map(self._real, (args, kwargs))
        with unset_fake_temporarily():
            real = func(*real_args, **real_kwargs)
        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            self.answered += 1
            fake_mode = next(a.fake_mode for a in tree_flatten((args, kwargs))[0] if isinstance(a, FakeTensor))
            out = tree_map(lambda r: fake_mode.from_tensor(r) if isinstance(r, torch.Tensor) else r, real)
        flat_out, _ = tree_flatten(out)
        flat_real, _ = tree_flatten(real)
        for o, r in zip(flat_out, flat_real):
            if isinstance(o, FakeTensor) and isinstance(r, torch.Tensor):
                self.values[o] = r
        return out

    def _real(self, x):
        return self.values[x] if isinstance(x, torch.Tensor) else x


def _tensors_all_known(known: KnownValues, args, kwargs) -> bool:
    leaves = tree_flatten((args, kwargs))[0]
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    return bool(tensors) and all(x in known.values for x in tensors)


MAX_FACTORY_NUMEL = 1 << 20  # integer tensors made from Python numbers alone that are given real values


def _integer_factory(func, args, kwargs, out) -> bool:
    """Whether ``out`` is a small integer or bool tensor made from Python values alone (``arange(n)``)."""
    if not isinstance(out, FakeTensor) or out.is_floating_point() or out.is_complex():
        return False
    if out.numel() > MAX_FACTORY_NUMEL or torch.Tag.nondeterministic_seeded in func.tags:
        return False
    return not any(isinstance(x, torch.Tensor) for x in tree_flatten((args, kwargs))[0])


def _dim(args, kwargs) -> int:
    return kwargs.get("dim", args[2] if len(args) > 2 else -1)


def balanced_indices(shape, dim: int, input_shape) -> torch.Tensor:
    """A (real, int64) topk index of ``shape`` along ``dim`` over ``input_shape[dim]`` choices: row r's
    j-th pick is ``(r * k + j) mod n``; see [Note: balanced routing]."""
    dim = dim % len(shape)
    n, k = input_shape[dim], shape[dim]
    moved = list(shape)
    moved.append(moved.pop(dim))
    rows = 1
    for s in moved[:-1]:
        rows *= s
    picks = (torch.arange(rows).unsqueeze(1) * k + torch.arange(k).unsqueeze(0)) % n  # (rows, k)
    return picks.reshape(moved).movedim(-1, dim).contiguous()
