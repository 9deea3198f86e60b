"""MoE: traced transformers Mixtral and Qwen2-MoE count their experts' FLOPs as the analytic 6 x N_active x T
(issue 12).

transformers 5.x runs the routed experts through ``aten._grouped_mm`` (FlopCounterMode has no formula for it;
shard_planner/trace/flops.py maps it). Each token goes to top-k of the E experts, each expert a SwiGLU MLP of
three (hidden x intermediate) matrices; Qwen2-MoE adds a shared expert every token runs (three hidden x
shared-intermediate matrices). So N_active = k x 3 x hidden x moe_intermediate (+ 3 x hidden x
shared_intermediate) parameters per token and layer, forward 2 x N_active x T FLOPs and backward twice that
(Kaplan et al. 2020, sec. 2.1: C = 6 N per token). The routers' linear layers (``mlp.gate``, hidden x E;
Qwen's ``shared_expert_gate``, hidden x 1) are counted apart.
"""

import pytest

pytest.importorskip("transformers",
                    reason="the MoE FLOP check traces transformers MoE models; transformers is not installed")

from shard_planner.trace.tracer import trace_model  # noqa: E402

HIDDEN, EXPERTS, TOP_K, LAYERS, SEQ, VOCAB = 64, 4, 2, 2, 64, 128
MOE_INTER = {"mixtral": 96, "qwen2_moe": 48}  # each routed expert's intermediate size
SHARED_INTER = {"mixtral": 0, "qwen2_moe": 80}  # Qwen2-MoE's shared expert

CONFIGS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                f"intermediate_size={MOE_INTER['mixtral']}, num_local_experts={EXPERTS}"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  f"intermediate_size=96, moe_intermediate_size={MOE_INTER['qwen2_moe']}, "
                  f"shared_expert_intermediate_size={SHARED_INTER['qwen2_moe']}, num_experts={EXPERTS}, "
                  "decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False"),
}

MODEL_FILE = '''
import torch
from transformers import {config}, {model}

CONFIG = {config}(vocab_size={vocab}, hidden_size={hidden}, num_hidden_layers={layers}, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok={top_k}, max_position_embeddings={seq},
                  router_aux_loss_coef=0.0, output_router_logits=False, tie_word_embeddings=False, {extra})

def build_model():
    torch.manual_seed(0)
    return {model}(CONFIG)

def make_batch(batch_size):
    tokens = torch.randint(0, {vocab}, (batch_size, {seq}))
    return (tokens,), tokens

def loss_fn(out, target):
    return torch.nn.functional.cross_entropy(out.logits.reshape(-1, {vocab}).float(), target.reshape(-1))
'''


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def moe_trace(request, tmp_path_factory):
    config, model, extra = CONFIGS[request.param]
    path = tmp_path_factory.mktemp("moe") / f"{request.param}_tiny.py"
    path.write_text(MODEL_FILE.format(config=config, model=model, extra=extra, vocab=VOCAB, hidden=HIDDEN,
                                      layers=LAYERS, top_k=TOP_K, seq=SEQ))
    # bf16: the grouped GEMM's meta kernel (torch/_meta_registrations.py _meta_grouped_mm_common) takes bf16 only
    return request.param, trace_model(str(path), dtype="bfloat16")


def test_expert_flops_match_six_n_active_t(moe_trace):
    name, trace = moe_trace
    n_active = TOP_K * 3 * HIDDEN * MOE_INTER[name] + 3 * HIDDEN * SHARED_INTER[name]  # per token and layer
    total = 0.0
    for i in range(LAYERS):
        routed = trace.module(f"model.layers.{i}.mlp.experts")
        fwd, bwd = routed.fwd_flops_self, routed.bwd_flops_self
        if SHARED_INTER[name]:  # the shared expert: gate_proj, up_proj, down_proj under it
            fwd = fwd + trace.subtree_sum(f"model.layers.{i}.mlp.shared_expert", "fwd_flops_self")
            bwd = bwd + trace.subtree_sum(f"model.layers.{i}.mlp.shared_expert", "bwd_flops_self")
        assert fwd.fixed == 0 and bwd.fixed == 0  # every expert FLOP scales with the tokens
        assert abs(fwd.per_sample - 2 * n_active * SEQ) <= 0.02 * 2 * n_active * SEQ, (name, i, fwd)
        assert abs(bwd.per_sample - 4 * n_active * SEQ) <= 0.02 * 4 * n_active * SEQ, (name, i, bwd)
        total += fwd.per_sample + bwd.per_sample
    analytic = LAYERS * 6 * n_active * SEQ  # forward + backward, per sample of SEQ tokens
    assert abs(total - analytic) <= 0.02 * analytic


def test_router_flops_are_its_linear_layer(moe_trace):
    _, trace = moe_trace
    gate = trace.module("model.layers.0.mlp.gate")
    assert gate.fwd_flops_self.per_sample == pytest.approx(2 * HIDDEN * EXPERTS * SEQ, rel=0.02)
    assert gate.bwd_flops_self.per_sample == pytest.approx(4 * HIDDEN * EXPERTS * SEQ, rel=0.02)
