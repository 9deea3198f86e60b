"""Replay: from a finished step's log to per-module numbers, and from two batch sizes to a ModelTrace.

After the backward the parameter gradients are known; they and the parameters are excluded and every
span's peak rise (``max(live) - live at entry``) and net change are recomputed from the log
(:meth:`Replay.span_stats`). A twin's spans count as its template's (see [Note: twins]).

A module called several times in a step (a shared module) sums its calls' bytes and FLOPs and keeps
the largest peak. ``forward_order`` is by first entry into the wrapped ``forward`` (where a
forward-pre-hook would fire), ``backward_order`` by the first gradient of an output. Two traced batch
sizes give every per-micro-batch quantity as an :class:`Affine` in the batch size (exact where the bytes
are linear in it; a batch maker whose batch-1 tensors are views of a larger storage, e.g.
``tokens[:, :-1].contiguous()``, bends the line by those few bytes).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.nn as nn

from shard_planner.trace.capture import Step
from shard_planner.trace.held import held_by_output
from shard_planner.trace.kernel_ops import fit_records
from shard_planner.trace.params import OwnParams, own_params
from shard_planner.trace.records import ENTER, EXIT, Call, ModuleRecord, Span, StepResult, join_fqn, rel_fqn
from shard_planner.trace.tp_local import fit_collectives
from shard_planner.trace.types import Affine, ModuleTrace

logger = logging.getLogger(__name__)


class Replay:
    """Per-span statistics and per-module records of one finished :class:`Step`."""

    def __init__(self, step: Step):
        self.step = step
        self._stats: dict[tuple[int, int], tuple[int, int]] = {}
        # id(call) -> bytes the forward's output held: [Note: Storages the forward's output holds]
        self.held = held_by_output(step.log.events, step.root_call, step.loss_call, step.output_sids)

    def span_stats(self, span: Span | None) -> tuple[int, int]:
        """(peak rise above the level at entry, net change) of live non-parameter bytes over a span."""
        if span is None:
            return 0, 0
        if span.call.template is not None:  # a twin counts as its template
            t = span.call.template
            return self.span_stats(t.fwd if span.kind == "fwd" else t.bwd)
        return self.replay(span.start + 1, span.end)

    def replay(self, start: int, end: int) -> tuple[int, int]:
        """(peak, final level) of live non-static bytes over log positions [start, end), from 0."""
        key = (start, end)
        if key in self._stats:
            return self._stats[key]
        log, static = self.step.log.events, self.step.log.static
        level = peak = 0
        i = start
        while i < end:
            ev = log[i]
            kind = ev[0]
            if kind == ENTER:
                inner = ev[1]
                if inner.call.template is not None and inner.end > 0:
                    rise, net = self.span_stats(inner)
                    peak = max(peak, level + rise)
                    level += net
                    i = inner.end + 1
                    continue
            elif kind != EXIT and ev[1] not in static:
                level += ev[2]
                if level > peak:
                    peak = level
            i += 1
        self._stats[key] = (peak, level)
        return peak, level

    def tail_rise(self, call: Call) -> int:
        """ModuleTrace.fwd_tail_rise_bytes of one call: the highest level of live non-parameter bytes while its
        own code runs after its last child returned, above the level at its entry (0 without children)."""
        if not call.children or call.fwd is None or call.fwd.end < 0:
            return 0
        last = call.children[-1].fwd.end  # the last child's EXIT
        _, at_last = self.replay(call.fwd.start + 1, last + 1)
        tail_peak, _ = self.replay(last + 1, call.fwd.end)
        return at_last + tail_peak

    def head_rise(self, call: Call) -> int:
        """ModuleTrace.bwd_head_rise_bytes of one call: the highest level of live non-parameter bytes while its
        own code's backward runs before the first of its children's backward begins, above the level at its
        backward's entry (0 without children, or without a backward): the mirror of :meth:`tail_rise`, e.g. the
        backward of a loss computed inside the root's forward."""
        if not call.children or call.bwd is None or call.bwd.end < 0:
            return 0
        starts = [c.bwd.start for c in call.children if c.bwd is not None]
        first = min(starts) if starts else call.bwd.end
        peak, _ = self.replay(call.bwd.start + 1, first)
        return peak

    def records(self, call: Call, memo: dict) -> list[ModuleRecord]:
        """The call's numbers and its subtree's, per module (twins expanded from their templates)."""
        cached = memo.get(id(call))
        if cached is not None:
            return cached
        out = self._own_records(call, memo) if call.template is None else self._twin_records(call, memo)
        for rel, nbytes in call.save_adjust:
            out.append(ModuleRecord(join_fqn(call.fqn, rel), saved=nbytes))
        memo[id(call)] = out
        return out

    def _own_records(self, call: Call, memo: dict) -> list[ModuleRecord]:
        own = ModuleRecord(
            call.fqn, calls=1, saved=call.saved_bytes, fwd_flops=call.fwd_flops, bwd_flops=call.bwd_flops,
            input_bytes=call.input_bytes, output_bytes=call.output_bytes,
            fwd_rise=self.span_stats(call.fwd)[0], bwd_rise=self.span_stats(call.bwd)[0],
            fwd_key=(call.fwd.start,), bwd_key=(call.bwd.start,) if call.bwd is not None else None,
            fwd_ops=call.fwd_ops, bwd_ops=call.bwd_ops, input_shared_bytes=call.input_shared_bytes,
            fwd_kernels=call.fwd_kernels, bwd_kernels=call.bwd_kernels, output_by_class=call.output_by_class,
            fwd_tail_kernels=call.fwd_tail, input_grad=call.input_grad, tp_collectives=call.tp_collectives,
            held=self.held.get(id(call), 0), fwd_tail_rise=self.tail_rise(call), bwd_head_rise=self.head_rise(call),
            forward_grad=call.forward_grad_bytes,
        )
        out = [own]
        for child in call.children:
            out.extend(self.records(child, memo))
        return out

    def _twin_records(self, call: Call, memo: dict) -> list[ModuleRecord]:
        t = call.template
        out = []
        for r in self.records(t, memo):
            out.append(ModuleRecord(
                join_fqn(call.fqn, rel_fqn(r.fqn, t.fqn)), r.calls, r.saved, r.fwd_flops, r.bwd_flops,
                call.input_bytes if r.fqn == t.fqn else r.input_bytes, r.output_bytes,
                r.fwd_rise, r.bwd_rise,
                (call.fwd.start,) + r.fwd_key if r.fwd_key is not None else None,
                (call.bwd.start,) + r.bwd_key if call.bwd is not None and r.bwd_key is not None else None,
                r.fwd_ops, r.bwd_ops,
                call.input_shared_bytes if r.fqn == t.fqn else r.input_shared_bytes,
                r.fwd_kernels, r.bwd_kernels, r.output_by_class, r.fwd_tail_kernels,
                call.input_grad if r.fqn == t.fqn else r.input_grad,
                call.tp_collectives if r.fqn == t.fqn else r.tp_collectives,  # its own style ran for real
                r.held, r.fwd_tail_rise, r.bwd_head_rise, r.forward_grad,
            ))
        return out


def step_result(step: Step) -> StepResult:
    """Per-module numbers (summed over each module's calls), the orders, and the loss's numbers."""
    replay = Replay(step)
    per_module: dict[str, ModuleRecord] = {}
    for r in replay.records(step.root_call, {}):
        _accumulate(per_module.setdefault(r.fqn, ModuleRecord(r.fqn)), r)
    forward_order = _order(per_module, lambda r: r.fwd_key)
    backward_order = _order(per_module, lambda r: r.bwd_key)
    reused = sum(1 for r in per_module.values() if r.fwd_key is not None and len(r.fwd_key) > 1)
    loss = step.loss_call
    loss_rise = (replay.replay(loss.fwd.start + 1, loss.bwd.end)[0] if loss.bwd is not None
                 else replay.span_stats(loss.fwd)[0])
    return StepResult(
        per_module=per_module,
        forward_order=forward_order,
        backward_order=backward_order,
        batch_input_bytes=step.batch_input_bytes,
        loss_saved_bytes=loss.saved_bytes,
        loss_peak_rise_bytes=loss_rise,
        loss_flops=loss.fwd_flops + loss.bwd_flops,
        reused_modules=reused,
        loss_ops=loss.fwd_ops + loss.bwd_ops,
        loss_kernels=tuple(loss.fwd_kernels + loss.bwd_kernels),
        forward_cache=step.forward_cache,
        loss_tp_collectives=tuple(loss.tp_collectives),
    )


def _order(per_module: dict[str, ModuleRecord], key) -> tuple[str, ...]:
    """The modules that have ``key`` (entered forward, or reached in backward), by it."""
    return tuple(r.fqn for r in sorted((r for r in per_module.values() if key(r)), key=key))


def _fit_by_class(rec1: ModuleRecord | None, rec2: ModuleRecord | None, b1: int, b2: int) -> dict[str, Affine]:
    """ModuleTrace.output_bytes_by_class: each class's output bytes fitted over the two batch sizes."""
    if not rec1 or not rec2:
        return {}
    classes = sorted({*rec1.output_by_class, *rec2.output_by_class})
    return {c: Affine.fit(b1, float(rec1.output_by_class.get(c, 0)), b2, float(rec2.output_by_class.get(c, 0)))
            for c in classes}


def _accumulate(agg: ModuleRecord, r: ModuleRecord) -> None:
    """Add one call's record to a module's: sums, except peaks (the largest) and keys (the first)."""
    agg.calls += r.calls
    agg.saved += r.saved
    agg.fwd_flops += r.fwd_flops
    agg.bwd_flops += r.bwd_flops
    agg.fwd_ops += r.fwd_ops
    agg.bwd_ops += r.bwd_ops
    agg.fwd_kernels = agg.fwd_kernels + r.fwd_kernels  # a twin's lists are its template's: never extended
    agg.bwd_kernels = agg.bwd_kernels + r.bwd_kernels
    agg.fwd_tail_kernels = agg.fwd_tail_kernels + r.fwd_tail_kernels
    agg.input_bytes += r.input_bytes
    agg.input_shared_bytes += r.input_shared_bytes
    agg.input_grad = agg.input_grad or r.input_grad
    agg.tp_collectives = agg.tp_collectives + r.tp_collectives
    agg.output_bytes += r.output_bytes
    agg.held += r.held
    agg.forward_grad += r.forward_grad
    agg.fwd_tail_rise = max(agg.fwd_tail_rise, r.fwd_tail_rise)
    agg.bwd_head_rise = max(agg.bwd_head_rise, r.bwd_head_rise)
    agg.output_by_class = {c: agg.output_by_class.get(c, 0) + r.output_by_class.get(c, 0)
                           for c in {*agg.output_by_class, *r.output_by_class}}
    agg.fwd_rise = max(agg.fwd_rise, r.fwd_rise)
    agg.bwd_rise = max(agg.bwd_rise, r.bwd_rise)
    if r.fwd_key is not None and (agg.fwd_key is None or r.fwd_key < agg.fwd_key):
        agg.fwd_key = r.fwd_key
    if r.bwd_key is not None and (agg.bwd_key is None or r.bwd_key < agg.bwd_key):
        agg.bwd_key = r.bwd_key


# ---------------------------------------------------------------------------------------------------
# Assembling the ModuleTraces


@dataclass(frozen=True)
class StaticFacts:
    """Per module, as built: its own parameters (trace/params.py), buffers, ties."""

    fqns: frozenset[str]
    params: dict[str, OwnParams]  # fqn -> its own parameters (a shared parameter at its first module)
    buffer_bytes: dict[str, int]
    tied_with: dict[str, tuple[str, ...]]  # fqn -> other modules registering one of its parameters


def static_facts(modules: list[tuple[str, nn.Module]]) -> StaticFacts:
    """Parameter counts and bytes (a shared parameter at its first module), buffer bytes, ties, as built."""
    owners: dict[int, list[str]] = {}  # id of a Parameter -> modules registering it directly
    for fqn, module in modules:
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(fqn)
    tied_with = {fqn: tuple(sorted({o for p in module.parameters(recurse=False) for o in owners[id(p)]} - {fqn}))
                 for fqn, module in modules}
    buffer_bytes = {fqn: sum(b.numel() * b.element_size() for b in module.buffers(recurse=False))
                    for fqn, module in modules}
    return StaticFacts(frozenset(fqn for fqn, _ in modules), own_params(modules), buffer_bytes, tied_with)


def module_traces(modules: list[tuple[str, nn.Module]], static: StaticFacts, hashes: dict[str, str],
                  batch_sizes: tuple[int, int], r1: StepResult, r2: StepResult) -> tuple[ModuleTrace, ...]:
    """One ModuleTrace per module, every per-micro-batch quantity fitted over the two batch sizes."""
    b1, b2 = batch_sizes
    out = []
    for fqn, module in modules:
        rec1, rec2 = r1.per_module.get(fqn), r2.per_module.get(fqn)

        def fit(name, rec1=rec1, rec2=rec2):
            v1, v2 = (float(getattr(rec, name)) if rec else 0.0 for rec in (rec1, rec2))
            return Affine.fit(b1, v1, b2, v2)

        children = tuple(join_fqn(fqn, name) for name, _ in module.named_children())
        out.append(ModuleTrace(
            fqn=fqn,
            type_name=type(module).__name__,
            parent=None if fqn == "" else fqn.rpartition(".")[0],
            children=tuple(c for c in children if c in static.fqns),
            structural_hash=hashes[fqn],
            **_param_fields(static.params[fqn]),
            buffer_bytes=static.buffer_bytes[fqn],
            calls=rec1.calls if rec1 else 0,
            input_bytes=fit("input_bytes"),
            input_shared_bytes=fit("input_shared_bytes"),
            output_bytes=fit("output_bytes"),
            saved_bytes_self=fit("saved"),
            forward_grad_bytes=fit("forward_grad"),
            held_bytes_self=fit("held"),
            fwd_tail_rise_bytes=fit("fwd_tail_rise"),
            bwd_head_rise_bytes=fit("bwd_head_rise"),
            fwd_flops_self=fit("fwd_flops"),
            bwd_flops_self=fit("bwd_flops"),
            fwd_peak_rise_bytes=fit("fwd_rise"),
            bwd_peak_rise_bytes=fit("bwd_rise"),
            tied_with=static.tied_with[fqn],
            fwd_ops_self=rec1.fwd_ops if rec1 else 0,  # op counts do not depend on the batch size
            bwd_ops_self=rec1.bwd_ops if rec1 else 0,
            fwd_kernels=fit_records(rec1.fwd_kernels, rec2.fwd_kernels, b1, b2) if rec1 and rec2 else (),
            bwd_kernels=fit_records(rec1.bwd_kernels, rec2.bwd_kernels, b1, b2) if rec1 and rec2 else (),
            fwd_tail_kernels=fit_records(rec1.fwd_tail_kernels, rec2.fwd_tail_kernels, b1, b2) if rec1 and rec2 else (),
            output_bytes_by_class=_fit_by_class(rec1, rec2, b1, b2),
            input_requires_grad=bool(rec1 and rec1.input_grad),
            tp_collectives=fit_collectives(rec1.tp_collectives, rec2.tp_collectives, b1, b2) if rec1 and rec2 else (),
        ))
    return tuple(out)


def _param_fields(own: OwnParams) -> dict:
    """The ModuleTrace fields of a module's own parameters."""
    return dict(param_count=own.count, param_tensors=own.tensors, param_bytes_by_dtype=own.bytes_by_dtype,
                scalar_param_bytes_by_dtype=own.scalar_bytes_by_dtype, frozen_param_count=own.frozen_count,
                frozen_param_tensors=own.frozen_tensors, frozen_param_bytes_by_dtype=own.frozen_bytes_by_dtype,
                frozen_scalar_param_bytes_by_dtype=own.frozen_scalar_bytes_by_dtype,
                quantized_param_bytes_by_dtype=own.quantized_bytes_by_dtype,
                sharded_param_shapes=tuple(own.sharded_shapes))
