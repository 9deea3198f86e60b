"""Repeated blocks in the forward that finds the tensor-parallel styles (tp_styles.trace_calls): run once each.

    with call_twins(model, trace):      # around the recorded forward
        model(*inputs)

[Note: Twin blocks in the styles' forward]
  The styles are read off one recorded forward of the whole model (tp_styles.trace_calls: each module's first
  call, its order, input and output shapes, each SDPA call's owner and heads), 80 blocks of Llama 3 70B run
  under FakeTensorMode one after another: most of the styles' derivation (0.9 of 1.1 CPU-s at 8B). Blocks of one
  structure called the same way record the same thing, so, as the tracer does (trace/twins.py [Note: twins]), a
  module whose structural hash, plain attributes (trace/twins.py ``attribute_signatures``: a block's number is
  its position, not its configuration) and input signature (shapes, strides, dtypes, grad mode, non-tensor
  arguments) equal those of a module already run in this forward (its template) is not run: the template's
  records are copied with the fqns moved to the twin's and the call order shifted to where the twin starts,
  and the twin returns fresh tensors of the template's output layout (fake, or meta on a meta model: no
  memory). What the forward records is then the same as with every block run (tests/trace/test_tp_call_twins.py
  compares both for the example model and transformers configs).
  A module is a template only where its records are its subtree's alone and complete: every record made
  while it ran belongs to a module of its subtree (no module outside it, e.g. one shared by all blocks and
  reached by reference, recorded a first call inside it), and it returned a tensor or a tuple or list of
  tensors and Nones (anything else, a cache object, is not recreated). A twin must have none of its modules
  recorded yet and share no module or parameter with its template (a module called twice, tied weights);
  otherwise it runs for real. As for the tracer, a block whose forward branches on its number rather than on
  its attributes or inputs would be copied wrongly.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from shard_planner.trace.records import is_under, join_fqn, rel_fqn
from shard_planner.trace.structure import structural_hashes
from shard_planner.trace.twins import input_signature, reuse_facts

_CLASS_FORWARD = object()  # a module without a forward of its own on the instance


@dataclass(frozen=True)
class _Template:
    """What a module recorded while it ran: (fqn relative to it, ModuleCall) and (owner relative to it,
    AttentionCall) in call order, how many ticks of the call order that took, its output's layout, and the ids of
    its subtree's modules and parameters."""

    calls: tuple
    attention: tuple
    ticks: int
    outputs: tuple  # per element of the output: None, or its (shape, stride, dtype, device)
    is_sequence: type | None  # tuple or list when the output was one, else None (a tensor)
    module_ids: frozenset[int]
    param_ids: frozenset[int]


@contextmanager
def call_twins(model: nn.Module, trace) -> Iterator[None]:
    """Within the block, each module of ``model`` that has a twin elsewhere in it (same structural hash) runs
    through :func:`_twin_forward`, which records a twin from its template ([Note: Twin blocks in the styles'
    forward]); ``trace`` is the tp_styles.CallTrace the forward records into."""
    facts = reuse_facts(model, structural_hashes(model), reuse=True)
    modules = dict(model.named_modules())
    templates: dict[tuple, _Template | None] = {}
    patched = {fqn: modules[fqn].__dict__.get("forward", _CLASS_FORWARD) for fqn in modules
               if fqn and fqn not in facts.leaves and facts.hashes[fqn] in facts.twin_hashes}
    for fqn in patched:
        modules[fqn].forward = _twin_forward(modules[fqn], fqn, facts, templates, trace)
    try:
        yield
    finally:
        for fqn, own in patched.items():  # the forward it had: its class's, or one set on the instance
            if own is _CLASS_FORWARD:
                del modules[fqn].forward
            else:
                modules[fqn].forward = own


def _twin_forward(module: nn.Module, fqn: str, facts, templates: dict, trace):
    """``module.forward``, replaced by one that records a twin from its template, or runs and offers itself as
    the template of the modules called as it was."""
    original = module.forward
    module_ids = frozenset(id(m) for m in module.modules())
    param_ids = frozenset(id(p) for p in module.parameters())

    def forward(*args, **kwargs):
        leaves, spec = tree_flatten((args, kwargs))
        key = (facts.hashes[fqn], facts.attr_sigs[fqn], input_signature(leaves, spec))
        template = templates.get(key)
        if template is not None and _may_stand_in(template, fqn, module_ids, param_ids, trace):
            return _replay(template, fqn, trace)
        start = trace.counter
        out = original(*args, **kwargs)
        if key not in templates:
            templates[key] = _recorded(fqn, start, trace, out, module_ids, param_ids)
        return out

    return forward


def _may_stand_in(template: _Template, fqn: str, module_ids: frozenset[int], param_ids: frozenset[int],
                  trace) -> bool:
    """Whether the call of ``fqn`` may be recorded from ``template``: none of its modules recorded yet, no
    module or parameter shared with the template."""
    if template.module_ids & module_ids or template.param_ids & param_ids:
        return False
    return not any(join_fqn(fqn, rel) in trace.calls for rel, _ in template.calls)


def _recorded(fqn: str, start: int, trace, out, module_ids, param_ids) -> _Template | None:
    """The template of the call of ``fqn`` that began at tick ``start`` and returned ``out``, or None when it
    cannot be one ([Note: Twin blocks in the styles' forward])."""
    calls = [(f, c) for f, c in trace.calls.items() if c.order > start]
    attention = [(f, a) for f, a in trace.attention.items() if a.order > start]
    if not all(is_under(f, fqn) and f != fqn for f, _ in calls) or not all(is_under(f, fqn) for f, _ in attention):
        return None
    is_sequence = type(out) if type(out) in (tuple, list) else None
    elements = out if is_sequence else (out,)
    if out is None or not all(e is None or isinstance(e, torch.Tensor) for e in elements):
        return None
    layouts = tuple(None if e is None else (tuple(e.shape), tuple(e.stride()), e.dtype, e.device) for e in elements)
    return _Template(tuple((rel_fqn(f, fqn), replace(c, order=c.order - start)) for f, c in calls),
                     tuple((rel_fqn(f, fqn), replace(a, order=a.order - start)) for f, a in attention),
                     trace.counter - start, layouts, is_sequence, module_ids, param_ids)


def _replay(template: _Template, fqn: str, trace):
    """Record ``template``'s calls as ``fqn``'s, at the current tick, and return fresh tensors of its output
    layout (under the forward's FakeTensorMode: fake)."""
    start = trace.counter
    for rel, call in template.calls:
        trace.calls[join_fqn(fqn, rel)] = replace(call, order=call.order + start)
    for rel, att in template.attention:
        trace.attention[join_fqn(fqn, rel)] = replace(att, order=att.order + start)
    trace.counter = start + template.ticks
    made = [None if lay is None else torch.empty_strided(lay[0], lay[1], dtype=lay[2], device=lay[3])
            for lay in template.outputs]
    return template.is_sequence(made) if template.is_sequence else made[0]
