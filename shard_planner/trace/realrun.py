"""Checking a trace against one real step on the CPU, with the same instruments (small models only)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shard_planner.errors import UserError
from shard_planner.model.modelfile import ModelFile, load_model_file
from shard_planner.trace.capture import Step, run_step
from shard_planner.trace.flops import FlopCounter
from shard_planner.trace.replay import step_result
from shard_planner.trace.structure import model_fingerprint, structural_hashes
from shard_planner.trace.twins import reuse_facts
from shard_planner.trace.types import ModelTrace


@dataclass(frozen=True)
class Difference:
    """A traced quantity that a real CPU step does not reproduce (module ``fqn``; ``"<loss>"``: the loss)."""

    fqn: str
    quantity: str  # a ModuleTrace field ("saved_bytes_self", ...) or a ModelTrace loss_* field
    traced: float
    real: float


# ModuleTrace field -> the per-call record attribute it is fitted from
_CHECKED = (
    ("saved_bytes_self", "saved"), ("output_bytes", "output_bytes"), ("fwd_flops_self", "fwd_flops"),
    ("bwd_flops_self", "bwd_flops"), ("fwd_peak_rise_bytes", "fwd_rise"), ("bwd_peak_rise_bytes", "bwd_rise"),
)


def compare_with_real_run(
    model_file: ModelFile | str, trace: ModelTrace, *, batch_size: int = 1, rel_tol: float = 0.02
) -> tuple[Difference, ...]:
    """Run one real step on the CPU with the same instruments and list where the fake trace differs.

    This builds the model for real (small configurations only). Code that branches on being traced
    (DESIGN.md, "FSDP2 facts": transformers' Llama materialises a causal mask under fake tensors), or a
    kernel that fake mode picks differently, shows up here as a difference.
    """
    mf = load_model_file(model_file) if isinstance(model_file, (str, Path)) else model_file
    compute = getattr(torch, trace.compute_dtype)
    torch.manual_seed(0)
    model = mf.build()
    if model_fingerprint(model) != trace.fingerprint:
        raise UserError(f"{mf.path}: the model it builds is not the one traced in the trace (fingerprints differ)")
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != compute:
            p.data = p.data.to(compute)
    inputs, targets = mf.batch(batch_size)
    step = Step(model, mf, compute, reuse_facts(model, structural_hashes(model), reuse=False), FlopCounter())
    run_step(step, list(model.named_modules()), inputs, targets)
    real = step_result(step)
    diffs = []

    def check(fqn: str, quantity: str, traced: float, measured: float) -> None:
        if abs(traced - measured) > rel_tol * abs(measured) + 0.5:
            diffs.append(Difference(fqn, quantity, traced, float(measured)))

    for m in trace.modules:
        rec = real.per_module.get(m.fqn)
        for name, attr in _CHECKED:
            check(m.fqn, name, getattr(m, name).at(batch_size), getattr(rec, attr) if rec else 0)
    check("<loss>", "loss_saved_bytes", trace.loss_saved_bytes.at(batch_size), real.loss_saved_bytes)
    check("<loss>", "loss_flops", trace.loss_flops.at(batch_size), real.loss_flops)
    check("<loss>", "loss_peak_rise_bytes", trace.loss_peak_rise_bytes.at(batch_size), real.loss_peak_rise_bytes)
    return tuple(diffs)
