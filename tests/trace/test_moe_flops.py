"""MoE: a traced transformers Mixtral counts its experts' FLOPs as the analytic 6 x N_active x T (issue 12).

transformers 5.x runs Mixtral's experts through ``aten._grouped_mm`` (FlopCounterMode has no formula for it;
shard_planner/trace/flops.py maps it). Each token goes to top-k of the E experts, each expert a SwiGLU MLP of
three (hidden x intermediate) matrices, so N_active = k x 3 x hidden x intermediate parameters per token,
forward 2 x N_active x T FLOPs and backward twice that (Kaplan et al. 2020, sec. 2.1: C = 6 N per token).
The router's linear layer (``mlp.gate``, hidden x E) is counted apart.
"""

import pytest

pytest.importorskip("transformers",
                    reason="the MoE FLOP check traces a transformers Mixtral; transformers is not installed")

from shard_planner.trace.tracer import trace_model  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K, LAYERS, SEQ, VOCAB = 64, 96, 4, 2, 2, 64, 128

MODEL_FILE = f'''
import torch
from transformers import MixtralConfig, MixtralForCausalLM

CONFIG = MixtralConfig(vocab_size={VOCAB}, hidden_size={HIDDEN}, intermediate_size={INTER}, num_hidden_layers={LAYERS},
                       num_attention_heads=4, num_key_value_heads=2, num_local_experts={EXPERTS},
                       num_experts_per_tok={TOP_K}, max_position_embeddings={SEQ}, router_aux_loss_coef=0.0,
                       output_router_logits=False, tie_word_embeddings=False)

def build_model():
    torch.manual_seed(0)
    return MixtralForCausalLM(CONFIG)

def make_batch(batch_size):
    tokens = torch.randint(0, {VOCAB}, (batch_size, {SEQ}))
    return (tokens,), tokens

def loss_fn(out, target):
    return torch.nn.functional.cross_entropy(out.logits.reshape(-1, {VOCAB}).float(), target.reshape(-1))
'''


@pytest.fixture(scope="module")
def mixtral_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "mixtral_tiny.py"
    path.write_text(MODEL_FILE)
    # bf16: the grouped GEMM's meta kernel (torch/_meta_registrations.py _meta_grouped_mm_common) takes bf16 only
    return trace_model(str(path), dtype="bfloat16")


def test_expert_flops_match_six_n_active_t(mixtral_trace):
    n_active = TOP_K * 3 * HIDDEN * INTER  # parameters a token runs through in one layer's experts
    analytic = 6 * n_active * SEQ  # forward + backward, per sample of SEQ tokens
    total = 0.0
    for i in range(LAYERS):
        experts = mixtral_trace.module(f"model.layers.{i}.mlp.experts")
        fwd, bwd = experts.fwd_flops_self, experts.bwd_flops_self
        assert fwd.fixed == 0 and bwd.fixed == 0  # every expert FLOP scales with the tokens
        assert abs(fwd.per_sample - 2 * n_active * SEQ) <= 0.02 * 2 * n_active * SEQ, (i, fwd)
        assert abs(bwd.per_sample - 4 * n_active * SEQ) <= 0.02 * 4 * n_active * SEQ, (i, bwd)
        total += fwd.per_sample + bwd.per_sample
    assert abs(total - LAYERS * analytic) <= 0.02 * LAYERS * analytic


def test_router_flops_are_its_linear_layer(mixtral_trace):
    gate = mixtral_trace.module("model.layers.0.mlp.gate")
    assert gate.fwd_flops_self.per_sample == pytest.approx(2 * HIDDEN * EXPERTS * SEQ, rel=0.02)
    assert gate.bwd_flops_self.per_sample == pytest.approx(4 * HIDDEN * EXPERTS * SEQ, rel=0.02)
