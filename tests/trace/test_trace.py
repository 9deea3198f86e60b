"""The tracer against the real thing: parameter counts, bytes saved for backward in a real CPU run,
analytic FLOPs, reuse of identical blocks, JSON round trip, the module graph and the CLI."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import fields

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import saved_tensors_hooks

from shard_planner.cli.main import main
from shard_planner.errors import UserError
from shard_planner.model.modelfile import load_model_file
from shard_planner.trace import load_trace, trace_model, trace_or_load
from shard_planner.trace.flops import EXTRA_FLOP_FORMULAS, FlopCounter
from shard_planner.trace import compare_with_real_run
from shard_planner.trace.types import ModelTrace
from tests.paths import REPO  # noqa: E402

ROOT = REPO
EXAMPLES = ["gpt2", "llama", "vit", "encdec", "unet"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def example(name: str) -> str:
    return str(ROOT / "examples" / f"{name}.py")


_TRACES: dict = {}


def traced(name: str, dtype: str = "bfloat16", reuse: bool = True) -> ModelTrace:
    """Tiny-size traces are shared between tests (each takes a fraction of a second)."""
    key = (name, dtype, reuse)
    if key not in _TRACES:
        _TRACES[key] = trace_model(example(name), dtype=dtype, reuse=reuse)
    return _TRACES[key]


# ---- parameters ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", EXAMPLES)
def test_parameter_counts_exact(name):
    trace = traced(name)
    model = load_model_file(example(name)).build()
    assert trace.param_count == sum(p.numel() for p in model.parameters())
    assert sum(m.param_bytes for m in trace.modules) == sum(p.numel() * p.element_size() for p in model.parameters())
    for fqn, module in model.named_modules():
        assert trace.module(fqn).buffer_bytes == sum(b.numel() * b.element_size() for b in module.buffers(recurse=False))


@pytest.mark.parametrize("size", ["8b", "70b"])
def test_parameter_counts_llama_large_under_meta(size, monkeypatch):
    monkeypatch.setenv("SHARD_PLANNER_SIZE", size)
    mf = load_model_file(example("llama"))
    with torch.device("meta"):
        model = mf.build()
    trace = trace_model(mf)
    assert trace.param_count == sum(p.numel() for p in model.parameters())
    assert trace.tokens_per_sample == 4096
    n_layers = {"8b": 32, "70b": 80}[size]
    assert trace.reused_modules == 12 * (n_layers - 1)  # every block after the first is a twin


# ---- saved activations against a real CPU run ---------------------------------------------------


def real_model_and_batch(path: str, dtype: torch.dtype, batch: int):
    """The model file's model built for real (seed 0) with its floating parameters in ``dtype``, and one
    batch of ``batch`` samples as the file makes it (inputs not cast)."""
    mf = load_model_file(path)
    torch.manual_seed(0)
    model = mf.build()
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    inputs, targets = mf.batch(batch)
    return mf, model, inputs, targets


def real_saved_bytes(path: str, dtype: torch.dtype, batch: int) -> dict:
    """Bytes saved for backward in a real CPU run, per innermost module (deduplicated by storage;
    parameters and buffers are not activations), counted independently of the tracer."""
    mf, model, inputs, targets = real_model_and_batch(path, dtype, batch)
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
    static = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    stack: list[str] = []
    handles = []

    def enter(fqn):
        def hook(module, args):
            stack.append(fqn)

        return hook

    def leave(module, args, output):
        stack.pop()

    for fqn, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(fqn)))
        handles.append(module.register_forward_hook(leave))
    seen: set = set()
    saved: dict = defaultdict(int)

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in static and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            saved[stack[-1] if stack else "<loss>"] += st.nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out = model(*inputs)
        loss = mf.loss(out, targets)
    loss.backward()
    for h in handles:
        h.remove()
    assert torch.isfinite(loss)
    return saved


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", EXAMPLES)
def test_saved_bytes_match_real_run(name, dtype):
    batch = 3  # not a traced size: checks the fit as well
    trace = traced(name, dtype)
    real = real_saved_bytes(example(name), DTYPES[dtype], batch)
    assert sum(real.values()) > 0
    for m in trace.modules:
        got, want = m.saved_bytes_self.at(batch), real.get(m.fqn, 0)
        assert abs(got - want) <= 0.02 * want, (m.fqn, got, want)
    got, want = trace.loss_saved_bytes.at(batch), real.get("<loss>", 0)
    assert abs(got - want) <= 0.02 * want, ("loss", got, want)


# ---- FLOPs ----------------------------------------------------------------------------------------


def analytic_transformer_flops(model: nn.Module, batch: int, seq: int, n_layers: int, d_attn: int):
    """(forward, forward + backward) FLOPs of a decoder-only transformer step.

    Matmuls: 2·N·T forward and 4·N·T backward, N = the weights of every Linear (the LM head included,
    the embedding lookup not), T = batch·seq tokens: the 6·N·T of Kaplan et al. 2020 (Scaling Laws,
    §2.1) and PaLM (Chowdhery et al. 2022, Appendix B). Attention: 4·b·s·s·d per layer forward (QK^T and
    PV, 2 FLOPs per multiply-add; causal counted as full, as FlopCounterMode does), and 2.5x that in
    backward, since FlopCounterMode's SDPA backward counts the recomputed scores (5 matmuls, where
    PaLM's 12·L·H·Q·T per token assumes 4).
    """
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    tokens = batch * seq
    attn_fwd = 4 * batch * seq * seq * d_attn * n_layers
    return 2 * n * tokens + attn_fwd, 6 * n * tokens + 3.5 * attn_fwd


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_flops_match_analytic(name):
    mf = load_model_file(example(name))
    cfg = mf.build_model.__globals__["config"]()
    model = mf.build()
    n_layers = cfg.get("n_layers", cfg.get("n_layer"))
    d_attn = cfg.get("dim", cfg.get("n_embd"))
    trace = traced(name)
    for batch in (1, 4):
        fwd, total = analytic_transformer_flops(model, batch, cfg["seq_len"], n_layers, d_attn)
        got_fwd = trace.subtree_sum("", "fwd_flops_self").at(batch)
        got_total = got_fwd + trace.subtree_sum("", "bwd_flops_self").at(batch) + trace.loss_flops.at(batch)
        assert got_fwd == pytest.approx(fwd, rel=0.02)
        assert got_total == pytest.approx(total, rel=0.02)


def test_flops_are_self_not_inclusive():
    trace = traced("llama")
    block = trace.module("layers.0")
    assert block.fwd_flops_self.at(1) == 0  # a block's own code runs only the residual adds
    assert trace.subtree_sum("layers.0", "fwd_flops_self").at(1) > 0
    assert trace.module("layers.0.attention.wq").fwd_flops_self.at(1) > 0


def test_sdpa_kernels_have_flop_formulas():
    """Every attention kernel in aten is counted, or deliberately not (listed with the reason). Every op
    the dispatcher has registered, not ``dir(torch.ops.aten)``, which lists only the ops some code has
    looked up so far (the test passed or failed by which tests ran before it)."""
    not_counted = {
        "_native_multi_head_attention": "inference-only fast path of nn.MultiheadAttention (no grad)",
        "_scaled_dot_product_attention_math_for_mps": "MPS only",
        "_flash_attention_forward_no_dropout_inplace": "CUDA inference with a KV cache",
        "_triton_multi_head_attention": "inference-only Triton path of nn.MultiheadAttention",
        "_triton_scaled_dot_attention": "inference-only Triton path of nn.MultiheadAttention",
        "scaled_dot_product_attention": "composite: dispatches to one of the counted kernels",
        "_scaled_dot_product_attention_math": "composite: decomposes into counted matmuls",
    }
    for name in ("_cudnn_attention_forward", "_cudnn_attention_backward"):
        not_counted[name] = "varlen cuDNN kernel (torch.nn.attention.varlen, nested tensors): the tracer runs dense SDPA"
    registered = {full.split("::")[1].split(".")[0] for full in torch._C._dispatch_get_all_op_names()
                  if full.startswith("aten::") and "attention" in full}
    assert "_scaled_dot_product_flash_attention" in registered
    counter = FlopCounter()
    for name in sorted(registered - set(not_counted)):
        assert getattr(torch.ops.aten, name) in counter, name
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in EXTRA_FLOP_FORMULAS


def test_cpu_flash_attention_flops_under_fake_mode():
    b, h, h_kv, s, d = 2, 8, 2, 128, 16
    with FakeTensorMode():
        q = torch.randn(b, h, s, d, requires_grad=True)
        kv = torch.randn(b, h_kv, s, d, requires_grad=True)
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as fc:
            out = F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        fwd = fc.get_total_flops()
        with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as fc:
            out.sum().backward()
        bwd = fc.get_total_flops()
    assert fwd == 4 * b * h * s * s * d  # causal counted as full
    assert bwd == 2.5 * fwd


# ---- reuse of identical blocks ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_reuse_equals_full_trace(dtype):
    """GPT-2 tiny has 4 identical blocks: blocks 1-3 are twins of block 0."""
    fast, full = traced("gpt2", dtype, reuse=True), traced("gpt2", dtype, reuse=False)
    assert fast.reused_modules == 3 * 10 and full.reused_modules == 0
    assert fast.modules == full.modules
    for f in fields(ModelTrace):
        if f.name not in ("trace_seconds", "reused_modules"):
            assert getattr(fast, f.name) == getattr(full, f.name), f.name


def test_reuse_equals_full_trace_llama_gqa_rotary():
    """Llama blocks share the rotary cos/sin inputs that block 0 already saved."""
    fast, full = traced("llama", reuse=True), traced("llama", reuse=False)
    assert fast.reused_modules > 0
    assert fast.modules == full.modules
    assert fast.forward_order == full.forward_order and fast.backward_order == full.backward_order
    assert fast.module("layers.0").saved_bytes_self == fast.module("layers.1").saved_bytes_self
    assert fast.subtree_sum("layers.0", "saved_bytes_self").at(1) > fast.subtree_sum("layers.1", "saved_bytes_self").at(1)


# ---- orders, peaks, fits -------------------------------------------------------------------------------


def test_orders_and_structure():
    trace = traced("llama")
    assert trace.forward_order[0] == "" and trace.forward_order[1] == "tok_embeddings"
    assert trace.forward_order[-1] == "output"
    bwd = trace.backward_order
    assert bwd.index("output") < bwd.index("norm") < bwd.index("layers.1") < bwd.index("layers.0")
    assert bwd.index("layers.0") < bwd.index("tok_embeddings")
    assert bwd.index("layers.1.feed_forward") < bwd.index("layers.1.attention")
    called = {m.fqn for m in trace.modules if m.calls > 0}
    assert set(trace.forward_order) == called
    for m in trace.modules:
        for c in m.children:
            assert trace.module(c).parent == m.fqn


def test_peaks_and_scaling():
    trace = traced("llama")
    root = trace.module("")
    saved_total = trace.subtree_sum("", "saved_bytes_self")
    for b in (1, 8):
        assert root.fwd_peak_rise_bytes.at(b) >= saved_total.at(b)  # all saved tensors are live at the end
        assert trace.loss_peak_rise_bytes.at(b) > 0
    assert saved_total.per_sample > 0
    assert trace.batch_input_bytes.at(2) == 2 * 2 * 64 * 8  # inputs and targets, (2, 64) int64
    # The traced sizes are reproduced exactly by the fit; activations are linear in the batch.
    assert trace.module("layers.0.feed_forward").output_bytes.fixed == 0


# ---- JSON, graph, CLI -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "unet"])
def test_json_round_trip(name, tmp_path):
    trace = traced(name)
    assert ModelTrace.from_json(trace.to_json()) == trace
    path = tmp_path / "trace.json"
    path.write_text(trace.to_json())
    assert load_trace(path) == trace
    assert trace_or_load(path) == trace
    with pytest.raises(UserError, match="traced in bfloat16"):
        trace_or_load(path, dtype="fp32")


def test_op_counts_and_traces_without_them_load():
    trace = traced("gpt2")
    block = trace.subtree("h.0") if "h.0" in trace else trace.subtree(trace.modules[0].children[-1])
    assert sum(m.fwd_ops_self for m in trace.modules) > 0 and sum(m.bwd_ops_self for m in trace.modules) > 0
    assert sum(m.fwd_ops_self for m in block) > 0
    assert trace.loss_ops > 0
    assert sum(m.param_tensors for m in trace.modules) == len(list(load_model_file(example("gpt2")).build().parameters()))
    old = json.loads(trace.to_json())  # a trace written before op counts existed
    del old["loss_ops"]
    for m in old["modules"]:
        del m["fwd_ops_self"], m["bwd_ops_self"], m["param_tensors"]
    loaded = ModelTrace.from_dict(old)
    assert loaded.loss_ops == 0 and all(m.fwd_ops_self == m.bwd_ops_self == 0 for m in loaded.modules)
    assert loaded.modules[0].fwd_flops_self == trace.modules[0].fwd_flops_self



def test_tied_with_records_shared_parameters():
    trace = traced("gpt2")  # lm_head.weight is wte.weight
    assert trace.module("wte").tied_with == ("lm_head",) and trace.module("lm_head").tied_with == ("wte",)
    assert [m.fqn for m in trace.modules if m.tied_with] == ["wte", "lm_head"]
    assert trace.module("lm_head").param_count == 0  # the shared parameter counts once, at wte
    assert all(not m.tied_with for m in traced("unet").modules)
    d = json.loads(trace.to_json())
    assert ModelTrace.from_dict(d).module("wte").tied_with == ("lm_head",)  # lists back to tuples
    for m in d["modules"]:  # a trace written before tied_with existed
        del m["tied_with"]
    assert all(m.tied_with == () for m in ModelTrace.from_dict(d).modules)


def test_input_shared_bytes_skip_connections():
    """U-Net: the up blocks take a down block's input again as their skip connection (the same
    storage); that part of their input is held already (what a checkpointed unit must not add twice)."""
    trace = traced("unet")
    b = 8
    shared = {m.fqn: m.input_shared_bytes.at(b) for m in trace.modules if m.input_shared_bytes.at(b)}
    # the root takes the batch's images; ups.{i} the input of downs.{1-i} again (ups.0 the bottleneck's)
    assert 0 < shared.pop("") < trace.batch_input_bytes.at(b)
    assert shared == {"ups.0": trace.module("bottleneck").input_bytes.at(b),
                      "ups.1": trace.module("downs.1").input_bytes.at(b),
                      "ups.2": trace.module("downs.0").input_bytes.at(b)}
    assert shared["ups.2"] < trace.module("ups.2").input_bytes.at(b)  # the upsampled path is new
    # a plain stack shares nothing but the batch's token ids, which the embedding takes
    gpt2 = traced("gpt2")
    assert {m.fqn for m in gpt2.modules if m.input_shared_bytes.at(b)} == {"", "wte"}
    assert gpt2.module("wte").input_shared_bytes == gpt2.module("wte").input_bytes
    # a trace written before the field loads with none
    d = json.loads(trace.to_json())
    for m in d["modules"]:
        del m["input_shared_bytes"]
    assert all(m.input_shared_bytes.at(b) == 0 for m in ModelTrace.from_dict(d).modules)


def test_input_shared_bytes_counts_batch_tensors():
    """fp32 (no input cast): the stem takes the batch's own image storage, held by the batch already."""
    trace = traced("unet", dtype="float32")
    assert trace.module("inc").input_shared_bytes.at(8) == trace.module("inc").input_bytes.at(8) > 0


def test_load_trace_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="taken for a trace.json .* but it is not JSON"):
        load_trace(bad)
    with pytest.raises(UserError, match="but there is no such file"):
        load_trace(tmp_path / "missing.json")
    old = json.loads(traced("unet").to_json())
    old["schema_version"] = 0
    bad.write_text(json.dumps(old))
    with pytest.raises(UserError, match="schema version"):
        load_trace(bad)


def test_cli_trace_writes_file_and_table(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["trace", example("llama"), "--batch-size", "3", "--dtype", "fp32", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    trace = load_trace(out)
    assert trace.compute_dtype == "float32" and trace.batch_sizes == (1, 2)
    assert "saved act (b=3)" in text and "total" in text and "layers.0" in text
    lines = text.splitlines()
    # the largest modules come first
    assert lines.index(next(l for l in lines if l.startswith("layers.0"))) < lines.index(
        next(l for l in lines if l.startswith("norm"))
    )


def test_bad_arguments():
    with pytest.raises(UserError, match="compute dtype"):
        trace_model(example("unet"), dtype="int8")
    with pytest.raises(UserError, match="two different"):
        trace_model(example("unet"), batch_sizes=(2, 2))


# ---- live-memory peaks against a real CPU run ---------------------------------------------------


def real_forward_peak_rise(path: str, dtype: torch.dtype, batch: int) -> int:
    """Peak of live storages during the real forward (input cast included) above the level at its start,
    with the repository's StorageTracker (shard_planner/execute/memtrack.py), independent of the tracer."""
    from shard_planner.execute.memtrack import StorageTracker

    mf, model, inputs, targets = real_model_and_batch(path, dtype, batch)
    tracker = StorageTracker(track=(model, inputs, targets))
    with tracker:
        entry = tracker.live_bytes
        tracker.reset_peak()
        out = model(*(x.to(dtype) if x.is_floating_point() else x for x in inputs))
        peak = tracker.peak_bytes
    del out
    return peak - entry


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", EXAMPLES)
def test_forward_peak_matches_real_run(name, dtype):
    batch = 3
    trace = traced(name, dtype)
    want = real_forward_peak_rise(example(name), DTYPES[dtype], batch)
    got = trace.module("").fwd_peak_rise_bytes.at(batch)
    assert want > 0
    assert abs(got - want) <= 0.02 * want, (got, want)


# ---- a model that stresses reuse: kwargs, tuple outputs, a shared block, a flag that differs -------

TWINS = str(ROOT / "tests" / "models" / "trace_twins.py")


def test_twins_model_reuse_equals_full_trace():
    fast, full = trace_model(TWINS), trace_model(TWINS, reuse=False)
    # blocks.0 is called twice (shared): it is neither a template nor a twin; blocks.1 is the template
    # of blocks.2 and blocks.3; "odd" has the same parameters but another flag, so it is not a twin.
    assert fast.reused_modules == 2 * 4
    assert fast.module("blocks.0").calls == 2 and fast.module("odd").calls == 1
    assert fast.modules == full.modules
    for f in fields(ModelTrace):
        if f.name not in ("trace_seconds", "reused_modules"):
            assert getattr(fast, f.name) == getattr(full, f.name), f.name


LAYER_IDX = str(ROOT / "tests" / "models" / "trace_layer_idx.py")


def test_numbered_blocks_are_twins_and_initialisers_keep_constants():
    """transformers-style blocks (``attn.layer_idx == i``) are twins; the in-place initialisers skipped
    while building under fake mode do not skip a fill_ of a constant that the forward reads."""
    fast, full = trace_model(LAYER_IDX, dtype="fp32"), trace_model(LAYER_IDX, dtype="fp32", reuse=False)
    assert fast.module("layers.3").calls == 1  # 2 + repeats layers run: the fill_(2) took effect
    assert fast.reused_modules == 3 * 4  # layers.1-3 (block, attn, attn.proj, mlp) reuse layers.0
    assert fast.modules == full.modules
    for f in fields(ModelTrace):
        if f.name not in ("trace_seconds", "reused_modules"):
            assert getattr(fast, f.name) == getattr(full, f.name), f.name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_twins_model_matches_real_run(dtype):
    batch = 3
    trace = trace_model(TWINS, dtype=dtype)
    model = load_model_file(TWINS).build()
    assert trace.param_count == sum(p.numel() for p in model.parameters())
    real = real_saved_bytes(TWINS, DTYPES[dtype], batch)
    for m in trace.modules:
        got, want = m.saved_bytes_self.at(batch), real.get(m.fqn, 0)
        assert abs(got - want) <= 0.02 * want, (m.fqn, got, want)
    want = real_forward_peak_rise(TWINS, DTYPES[dtype], batch)
    assert abs(trace.module("").fwd_peak_rise_bytes.at(batch) - want) <= 0.02 * want


# ---- the same instruments on a real step: fake mode changes nothing for the examples ------------------


@pytest.mark.parametrize("name", EXAMPLES)
def test_real_step_with_the_same_instruments_agrees(name):
    """Every traced number (saved, output, FLOPs, forward and backward peaks, loss) of the fake-mode trace,
    twins included, is what the same instruments measure in a real CPU step."""
    trace = traced(name)
    assert compare_with_real_run(example(name), trace, batch_size=3) == ()


def test_real_step_check_finds_code_that_branches_on_fake_tensors(tmp_path, capsys):
    path = str(ROOT / "tests" / "models" / "trace_fake_branch.py")
    trace = trace_model(path, dtype="fp32")
    diffs = {(d.fqn, d.quantity): d for d in compare_with_real_run(path, trace, batch_size=2)}
    saved = diffs[("attn", "saved_bytes_self")]
    # the (B, H, T, T) mask, converted by SDPA to an additive fp32 mask and saved, under fake mode only
    assert saved.traced - saved.real == 2 * 4 * 32 * 32 * 4
    assert ("head", "saved_bytes_self") not in diffs
    assert main(["trace", path, "--dtype", "fp32", "--check", "2", "-o", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "3 numbers differ" in out and "attn: saved_bytes_self" in out


def test_real_step_check_rejects_another_model(tmp_path):
    with pytest.raises(UserError, match="fingerprints differ"):
        compare_with_real_run(example("gpt2"), traced("llama"))
