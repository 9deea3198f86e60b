"""The tracer on models with frozen parameters (issue 28): the trainable and frozen parameters of each module,
and the saved bytes and backward FLOPs of what autograd runs when weights are frozen, against numbers computed
by hand (docs/frozen_facts.md, [Note: A frozen Linear saves no activation and runs one GEMM in backward]).

Hand numbers, per sample (tests/models/trace_frozen.py, ``chain``: x (B, 16, 64) -> l0 64->64 -> l1 64->32 ->
l2 32->8, no bias, fp32): one GEMM of a linear in->out is 2 * 16 * in * out FLOPs; a linear saves its input
(16 * in * 4 B) only when its weight trains, and runs its input-gradient GEMM only when its input needs one.
"""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from shard_planner.cli.trace import summary_table
from shard_planner.errors import ModelFileError
from shard_planner.trace import compare_with_real_run, trace_model
from shard_planner.trace.types import ModelTrace, ModuleTrace
from tests.paths import EXAMPLES, MODELS

FROZEN_MODELS = str(MODELS / "trace_frozen.py")
LLAMA_LORA = str(EXAMPLES / "llama_lora.py")
T = 16


def gemm(d_in: int, d_out: int) -> int:
    return 2 * T * d_in * d_out


def per_sample(m: ModuleTrace) -> tuple[float, float]:
    """(saved bytes, backward FLOPs) per sample; neither has a fixed part in these models."""
    assert m.saved_bytes_self.fixed == 0 and m.bwd_flops_self.fixed == 0
    return m.saved_bytes_self.per_sample, m.bwd_flops_self.per_sample


def chain(monkeypatch, frozen: str) -> ModelTrace:
    monkeypatch.setenv("TRACE_FROZEN_MODEL", "chain")
    monkeypatch.setenv("TRACE_FROZEN", frozen)
    return trace_model(FROZEN_MODELS, dtype="float32")


# (saved bytes, backward FLOPs) per sample of l0, l1, l2
CHAIN_EXPECTED = {
    # l0's input (the batch) needs no gradient: its weight GEMM only; l1 and l2: both GEMMs
    "": ((T * 64 * 4, gemm(64, 64)), (T * 64 * 4, 2 * gemm(64, 32)), (T * 32 * 4, 2 * gemm(32, 8))),
    # l1 frozen: saves nothing (its weight is a parameter, not an activation), its input-gradient GEMM only
    "l1": ((T * 64 * 4, gemm(64, 64)), (0, gemm(64, 32)), (T * 32 * 4, 2 * gemm(32, 8))),
    # l0 and l1 frozen: nothing upstream of l2 needs a gradient; l2 runs its weight GEMM only
    "l0,l1": ((0, 0), (0, 0), (T * 32 * 4, gemm(32, 8))),
}


@pytest.mark.parametrize("frozen", list(CHAIN_EXPECTED))
def test_frozen_linears_save_nothing_and_run_only_the_input_gradient_gemm(monkeypatch, frozen):
    trace = chain(monkeypatch, frozen)
    assert tuple(per_sample(trace.module(n)) for n in ("l0", "l1", "l2")) == CHAIN_EXPECTED[frozen]
    for name, d_in, d_out in (("l0", 64, 64), ("l1", 64, 32), ("l2", 32, 8)):  # the forward is the same
        assert trace.module(name).fwd_flops_self.per_sample == gemm(d_in, d_out)


@pytest.mark.parametrize("frozen", list(CHAIN_EXPECTED))
def test_trainable_and_frozen_parameters_per_module(monkeypatch, frozen):
    trace = chain(monkeypatch, frozen)
    sizes = {"l0": 64 * 64, "l1": 64 * 32, "l2": 32 * 8}
    names = set(filter(None, frozen.split(",")))
    for name, n in sizes.items():
        m = trace.module(name)
        assert m.param_count == n and m.param_bytes_by_dtype == {"float32": 4 * n} and m.param_tensors == 1
        if name in names:
            assert (m.frozen_param_count, m.frozen_param_tensors) == (n, 1)
            assert m.frozen_param_bytes_by_dtype == {"float32": 4 * n} and m.trainable_param_bytes_by_dtype == {}
            assert (m.trainable_param_count, m.trainable_param_tensors, m.trainable_param_bytes) == (0, 0, 0)
        else:
            assert (m.frozen_param_count, m.frozen_param_tensors, m.frozen_param_bytes_by_dtype) == (0, 0, {})
            assert m.trainable_param_bytes_by_dtype == m.trainable_sharded_param_bytes_by_dtype == {"float32": 4 * n}
    assert trace.param_count == sum(sizes.values())
    assert trace.trainable_param_count == sum(n for name, n in sizes.items() if name not in names)
    assert trace.has_frozen_params == bool(names)
    assert trace.subtree_trainable_param_count("") == trace.trainable_param_count
    assert trace.subtree_trainable_param_bytes("l2") == 4 * sizes["l2"]


def test_freezing_changes_the_fingerprint(monkeypatch):
    """A plan made for the fine-tune is refused for the fully trained model (structure.py hashes requires_grad)."""
    assert chain(monkeypatch, "").fingerprint != chain(monkeypatch, "l1").fingerprint


def test_every_parameter_field_of_a_module_with_frozen_and_trainable_ones(monkeypatch):
    """``m``: frozen fp32 weight (32, 64), trainable fp32 bias (32,), frozen 0-d bf16 gate, trainable 0-d fp32
    gain; traced in bf16, bytes as built."""
    monkeypatch.setenv("TRACE_FROZEN_MODEL", "mixed")
    m = trace_model(FROZEN_MODELS, dtype="bfloat16").module("m")
    assert (m.param_count, m.param_tensors) == (32 * 64 + 32 + 2, 4)
    assert (m.frozen_param_count, m.frozen_param_tensors) == (32 * 64 + 1, 2)
    assert (m.trainable_param_count, m.trainable_param_tensors) == (33, 2)
    assert m.param_bytes_by_dtype == {"float32": 4 * (32 * 64 + 32 + 1), "bfloat16": 2}
    assert m.frozen_param_bytes_by_dtype == {"float32": 4 * 32 * 64, "bfloat16": 2}
    assert m.scalar_param_bytes_by_dtype == {"bfloat16": 2, "float32": 4}
    assert m.frozen_scalar_param_bytes_by_dtype == {"bfloat16": 2}
    assert m.trainable_param_bytes_by_dtype == {"float32": 4 * 33}
    assert m.trainable_scalar_param_bytes_by_dtype == {"float32": 4}
    assert m.trainable_sharded_param_bytes_by_dtype == {"float32": 4 * 32}  # the bias: what is reduce-scattered
    assert m.sharded_param_bytes_by_dtype == {"float32": 4 * (32 * 64 + 32)}  # the frozen weight is sharded too
    assert (m.param_bytes, m.frozen_param_bytes, m.trainable_param_bytes) == (4 * 2081 + 2, 4 * 2048 + 2, 4 * 33)


def test_repeated_frozen_blocks_reuse_equals_full_trace(monkeypatch):
    """Four identical blocks of a frozen LayerNorm and base linear beside a trainable low-rank pair, after a
    frozen embedding: block 0's input needs no gradient, blocks 1-3 are twins of block 1 (the input signature
    includes requires_grad), and the reused numbers are the full trace's."""
    monkeypatch.setenv("TRACE_FROZEN_MODEL", "stack")
    fast, full = trace_model(FROZEN_MODELS, dtype="float32"), trace_model(FROZEN_MODELS, dtype="float32", reuse=False)
    assert fast.reused_modules == 2 * 5 and full.reused_modules == 0
    for f in fields(ModelTrace):
        if f.name not in ("trace_seconds", "reused_modules"):
            assert getattr(fast, f.name) == getattr(full, f.name), f.name
    assert fast.trainable_param_count == 4 * 2 * 32 * 4
    b0, b1 = fast.module("blocks.0"), fast.module("blocks.1")
    assert fast.module("blocks.0.base").bwd_flops_self.per_sample == 0  # its input needs no gradient
    assert fast.module("blocks.1.base").bwd_flops_self.per_sample == gemm(32, 32)  # the input gradient only
    assert fast.module("blocks.1.base").saved_bytes_self.per_sample == 0
    assert fast.module("blocks.1.lora_A").saved_bytes_self.per_sample == T * 32 * 4  # the normed input, for A's grad
    assert fast.module("embed").saved_bytes_self.per_sample == 0 and fast.module("embed").bwd_flops_self.per_sample == 0
    assert b0.structural_hash == b1.structural_hash


def traced_lora(monkeypatch, finetune: str) -> ModelTrace:
    monkeypatch.setenv("SHARD_PLANNER_FINETUNE", finetune)
    monkeypatch.delenv("SHARD_PLANNER_SIZE", raising=False)
    return trace_model(LLAMA_LORA, dtype="float32")


def test_llama_lora_example_traces_as_the_fine_tune(monkeypatch):
    """examples/llama_lora.py (tiny: dim 64, 64 tokens, r = 8): frozen bases, trainable adapters on wq and wv."""
    full, wq_wv, lora = (traced_lora(monkeypatch, k) for k in ("none", "wq_wv", "lora"))
    frozen_params = full.param_count
    assert (full.trainable_param_count, full.has_frozen_params) == (frozen_params, False)
    assert wq_wv.trainable_param_count == 2 * (64 * 64 + 64 * 32) and wq_wv.param_count == frozen_params
    assert lora.trainable_param_count == 2 * 8 * (64 + 64 + 64 + 32)
    assert lora.param_count == frozen_params + lora.trainable_param_count
    assert lora.module("layers.1.attention.wq.base_layer").trainable_param_bytes_by_dtype == {}
    tokens, dim = 64, 64
    for trace in (wq_wv, lora):  # a frozen linear after a trainable one: the input-gradient GEMM only, no save
        w1, w1_full = trace.module("layers.1.feed_forward.w1"), full.module("layers.1.feed_forward.w1")
        assert w1.bwd_flops_self.per_sample == w1.fwd_flops_self.per_sample == w1_full.bwd_flops_self.per_sample / 2
        assert w1.saved_bytes_self.per_sample == 0 and trace.module("output").saved_bytes_self.per_sample == 0
    base, a = lora.module("layers.1.attention.wq.base_layer"), lora.module("layers.1.attention.wq.lora_A")
    assert base.bwd_flops_self.per_sample == 2 * tokens * dim * dim and base.saved_bytes_self.per_sample == 0
    assert a.saved_bytes_self.per_sample == tokens * dim * 4  # the adapter saves the input the base does not
    assert lora.module("layers.1.attention.wq.lora_B").saved_bytes_self.per_sample == tokens * 8 * 4
    # the trainable saves less than the full model's: frozen norms keep no normalised input for a weight gradient
    assert lora.subtree_sum("", "saved_bytes_self").per_sample < full.subtree_sum("", "saved_bytes_self").per_sample
    assert lora.module("tok_embeddings").saved_bytes_self.per_sample == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llama_lora_trace_equals_a_real_cpu_step(monkeypatch, dtype):
    """The fake trace of the fine-tune (twins reused) against one real step with the same instruments."""
    monkeypatch.setenv("SHARD_PLANNER_FINETUNE", "lora")
    monkeypatch.delenv("SHARD_PLANNER_SIZE", raising=False)
    assert compare_with_real_run(LLAMA_LORA, trace_model(LLAMA_LORA, dtype=dtype), batch_size=2) == ()


def test_which_units_fsdp2_runs_a_pre_or_post_backward_for(monkeypatch):
    """FSDP2's pre-backward needs an output that requires grad (the module is in backward_order), its
    post-backward from autograd an input that does (input_requires_grad); docs/frozen_facts.md."""
    lora, full = traced_lora(monkeypatch, "lora"), traced_lora(monkeypatch, "none")
    assert "tok_embeddings" not in lora.backward_order and "tok_embeddings" in full.backward_order
    assert {"", "layers.0", "layers.1", "norm", "output"} <= set(lora.backward_order)
    needs = {fqn: lora.module(fqn).input_requires_grad for fqn in ("", "tok_embeddings", "layers.0", "layers.1", "norm")}
    # layers.0 takes the frozen embedding's output: its post-backward runs in the root's final callback
    assert needs == {"": False, "tok_embeddings": False, "layers.0": False, "layers.1": True, "norm": True}
    assert full.module("layers.0").input_requires_grad and not full.module("tok_embeddings").input_requires_grad


def test_frozen_fields_round_trip_and_older_traces_load_as_all_trainable(monkeypatch):
    trace = chain(monkeypatch, "l1")
    assert [trace.module(n).input_requires_grad for n in ("", "l0", "l1", "l2")] == [False, False, True, True]
    again = ModelTrace.from_json(trace.to_json())
    assert again.modules == trace.modules and again.trainable_param_count == trace.trainable_param_count
    old = json.loads(trace.to_json())  # a trace written before frozen parameters were recorded
    for m in old["modules"]:
        for key in ("frozen_param_count", "frozen_param_tensors", "frozen_param_bytes_by_dtype",
                    "frozen_scalar_param_bytes_by_dtype", "input_requires_grad"):
            del m[key]
    loaded = ModelTrace.from_dict(old)
    assert all(m.input_requires_grad is None for m in loaded.modules)  # not recorded then
    assert not loaded.has_frozen_params and loaded.trainable_param_count == loaded.param_count
    assert all(m.trainable_param_bytes_by_dtype == m.param_bytes_by_dtype for m in loaded.modules)
    assert all(m.trainable_sharded_param_bytes_by_dtype == m.sharded_param_bytes_by_dtype for m in loaded.modules)


def test_summary_says_how_many_train(monkeypatch):
    assert f"{64 * 64 + 32 * 8:,} trainable" in summary_table(chain(monkeypatch, "l1"), 1).splitlines()[0]
    assert "trainable" not in summary_table(chain(monkeypatch, ""), 1).splitlines()[0]


def test_a_model_with_every_parameter_frozen_is_refused_in_one_line(monkeypatch):
    with pytest.raises(ModelFileError, match="froze every parameter"):
        chain(monkeypatch, "l0,l1,l2")
