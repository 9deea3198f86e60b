"""What the trace records of a fine-tuned transformers config (tests/hf/finetune.py's tiny Llama): LoRA adapters
in fp32 on a frozen bf16 base (peft), NF4 weights by what they store (shard_planner/model/param_storage.py [Note: NF4
parameters as stored]; built by shape under fake tensors: trace/build.py [Note: NF4 weights under fake
tensors]), modules frozen by --freeze, and fingerprints that tell the fine-tunes apart."""

from __future__ import annotations

import pytest
import torch

from shard_planner.plan.finetune import ALL_LINEAR, FineTune
from shard_planner.plan.numerics import Numerics
from tests.hf.finetune import CONFIG, load, need_finetune_extra, write_config

HIDDEN, MLP, VOCAB = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
KV = HIDDEN * CONFIG["num_key_value_heads"] // CONFIG["num_attention_heads"]
LAYER_LINEARS = (HIDDEN * HIDDEN, KV * HIDDEN, KV * HIDDEN, HIDDEN * HIDDEN, 3 * MLP * HIDDEN)  # q, k, v, o, MLP


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("tiny_llama"))


def test_lora_trace_records_fp32_adapters_on_a_frozen_bf16_base(config):
    need_finetune_extra()
    from shard_planner.trace import trace_model

    trace = trace_model(load(config, FineTune(lora_rank=8, lora_targets=("q_proj", "v_proj"))))
    adapters = 2 * 8 * ((HIDDEN + HIDDEN) + (HIDDEN + KV))  # per layer: q (A: 8 x in, B: out x 8), v
    assert trace.trainable_param_count == adapters
    root = trace.module("")
    assert trace.subtree_param_count("") == trace.param_count
    base = sum(m.frozen_param_bytes_by_dtype.get("bfloat16", 0) for m in trace.modules)
    assert base == 2 * (trace.param_count - adapters)
    trainable_fp32 = sum(m.param_bytes_by_dtype.get("float32", 0) for m in trace.modules)
    assert trainable_fp32 == 4 * adapters and root.type_name == "PeftModel"


def test_qlora_trace_records_nf4_weights_by_what_they_store(config):
    need_finetune_extra(qlora=True)
    from shard_planner.trace import trace_model

    lora = trace_model(load(config, FineTune(lora_rank=8, lora_targets=(ALL_LINEAR,))))
    qlora = trace_model(load(config, FineTune(lora_rank=8, lora_targets=(ALL_LINEAR,), qlora=True)))
    assert qlora.param_count == lora.param_count  # elements as the weights they stand for
    assert qlora.fingerprint != lora.fingerprint  # NF4 weights hash with what they store
    n = 2 * sum(LAYER_LINEARS)  # every Linear of both layers
    stored = {dt: sum(m.param_bytes_by_dtype.get(dt, 0) for m in qlora.modules) for dt in ("uint8", "int8")}
    assert stored == {"uint8": n // 2, "int8": n // 64}
    replicated = sum(sum(m.scalar_param_bytes_by_dtype.values()) for m in qlora.modules)
    assert replicated == 7 * 2 * (2 + 16 * 2)  # 14 weights' 0-d mean and 16-entry table, bf16, whole on each rank
    bf16_saved = sum(m.param_bytes_by_dtype.get("bfloat16", 0) for m in lora.modules) - sum(
        m.param_bytes_by_dtype.get("bfloat16", 0) for m in qlora.modules)
    assert bf16_saved == 2 * n - (2 * n // (64 * 256) + replicated)  # factors and metadata stay bf16
    quantized = {dt: sum(m.quantized_param_bytes_by_dtype.get(dt, 0) for m in qlora.modules) for dt in ("uint8", "bfloat16")}
    assert quantized == {"uint8": n // 2, "bfloat16": 2 * n // (64 * 256) + replicated}  # all NF4 stores, nothing else
    assert not any(m.quantized_param_bytes_by_dtype for m in lora.modules)


def test_nf4_built_by_shape_under_fake_tensors_matches_to_nf4():
    need_finetune_extra(qlora=True)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shard_planner.model.hf_finetune import _import_to_nf4
    from shard_planner.model.modelfile import ModelFile
    from shard_planner.model.param_storage import NF4_REPLICATED, NF4_SHARDED
    from shard_planner.trace.build import build_fake

    to_nf4 = _import_to_nf4("test")
    real = to_nf4(torch.randn(128, 256, dtype=torch.bfloat16), 64, 256)
    mf = ModelFile("test", lambda: _nf4_linear(to_nf4), lambda b: None, None, finetune=FineTune(8, qlora=True))
    fake = build_fake(mf, FakeTensorMode(allow_non_fake_inputs=True)).weight
    assert type(fake) is type(real) and fake.shape == real.shape and fake.dtype == real.dtype
    for name in NF4_SHARDED + NF4_REPLICATED:
        a, b = getattr(fake, name), getattr(real, name)
        assert (a.shape, a.dtype) == (b.shape, b.dtype), name
    assert (fake.block_size, fake.n_blocks, fake.scaler_block_size) == (real.block_size, real.n_blocks,
                                                                         real.scaler_block_size)


def _nf4_linear(to_nf4):
    linear = torch.nn.Linear(256, 128, bias=False, dtype=torch.bfloat16)
    linear.weight = torch.nn.Parameter(to_nf4(linear.weight.detach(), 64, 256), requires_grad=False)
    return linear


def test_freeze_patterns_freeze_those_modules_only(config):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'shard-planner[hf]')")
    from shard_planner.trace import trace_model

    trace = trace_model(load(config, FineTune(freeze=("model.embed_tokens", "model.layers.0.*"))))
    frozen = {m.fqn for m in trace.modules if m.frozen_param_count}
    assert "model.embed_tokens" in frozen and "lm_head" not in frozen
    assert all(f == "model.embed_tokens" or f.startswith("model.layers.0.") for f in frozen)
    layer = trace.subtree_param_count("model.layers.0")
    assert trace.param_count - trace.trainable_param_count == VOCAB * HIDDEN + layer


def test_nf4_dequantisation_is_priced_on_a_gpu_profile(config):
    """The 'flops' compute model adds each NF4 module's own memory-bound kernels (its dequantisation) at the
    achieved HBM bandwidth (cost/quantized.py [Note: NF4 dequantisation time]); a LoRA base adds none."""
    need_finetune_extra(qlora=True)
    from shard_planner.cost import CostModel
    from shard_planner.cost.fsdp_copies import copy_bandwidth_bytes_per_s
    from shard_planner.cost.kernels import MEMORY_BOUND
    from shard_planner.hardware.profile import load_profile
    from shard_planner.trace import trace_model

    h100 = load_profile("h100-80gb")
    qlora = trace_model(load(config, FineTune(lora_rank=8, lora_targets=(ALL_LINEAR,), qlora=True)))
    lora = trace_model(load(config, FineTune(lora_rank=8, lora_targets=(ALL_LINEAR,))))
    nf4 = [m for m in qlora.modules if m.quantized_param_bytes_by_dtype]
    assert nf4
    bw = copy_bandwidth_bytes_per_s(h100)
    expected = sum(r.bytes.at(2) for m in nf4 for r in m.fwd_kernels if r.op_class in MEMORY_BOUND) / bw
    rate = h100.flops_per_s("bfloat16")
    cm = CostModel(qlora, h100)
    fwd, _ = cm.module_compute_s("", 2, Numerics())
    assert expected > 0 and fwd == pytest.approx(cm.subtree_sum("", "fwd_flops_self").at(2) / rate + expected)
    lora_cm = CostModel(lora, h100)
    assert lora_cm.module_compute_s("", 2, Numerics())[0] == pytest.approx(
        lora_cm.subtree_sum("", "fwd_flops_self").at(2) / rate)
