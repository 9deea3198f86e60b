"""What a transformers model keeps in its forward beyond saved tensors and outputs (trace/held.py [Note:
Storages the forward's output holds]; cost/memory.py [Note: A container's own code]):

- a decoder built with its KV cache holds each attention layer's cached keys and values until the output is
  dropped: where no op saves them (T5), the trace counts them for the attention module that made them,
  exactly the cache's bytes, and none without the cache;
- the root computes the loss inside its forward: a plan that splits the root into units prices the forward's
  peak at the loss, where it used to miss the logits' fp32 copy.
"""

from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (the optional extra: "
                    "pip install 'shard-planner[hf]')")

from shard_planner.cost import estimate  # noqa: E402
from shard_planner.plan import Unit  # noqa: E402
from shard_planner.hardware.profile import load_profile  # noqa: E402
from shard_planner.solve import plan_model  # noqa: E402
from shard_planner.solve.request import PlanRequest  # noqa: E402
from shard_planner.trace import trace_model  # noqa: E402
from tests.hf.zoo import ALL, PROFILE, ROOMY_BYTES, SEQ_LEN, load_arch, write_arch  # noqa: E402

ARCHS = {arch.name: arch for arch in ALL}


def _traced(name, tmp_path):
    arch = ARCHS[name]
    path = write_arch(arch, Path(tmp_path) / name)
    return arch, path, trace_model(load_arch(arch, path))


@pytest.mark.parametrize("name", ["t5", "t5-nocache", "llama"])
def test_the_kv_cache_is_held_by_the_attention_that_made_it(name, tmp_path):
    """T5's attention runs SDPA's math path, which saves fp32 copies of the keys and values: the cached bf16
    ones are held by the cache alone, 2 x heads x tokens x d_kv x 2 bytes per sample for each decoder
    self-attention and cross-attention. Llama's SDPA saves the very tensors the cache holds: nothing extra."""
    arch, _path, trace = _traced(name, tmp_path)
    held = {m.fqn: m.held_bytes_self.at(1) for m in trace.modules if m.held_bytes_self.at(1)}
    if name != "t5":
        assert held == {}
        return
    kw = arch.kwargs
    per_attention = 2 * kw["num_heads"] * SEQ_LEN * kw["d_kv"] * 2  # keys and values, bf16, one sample
    assert held == {f"decoder.block.{i}.layer.{j}.{attn}": per_attention for i in range(kw["num_layers"])
                    for j, attn in ((0, "SelfAttention"), (1, "EncDecAttention"))}
    assert all(m.held_bytes_self.at(2) == 2 * m.held_bytes_self.at(1) for m in trace.modules)


def test_a_split_root_prices_the_loss_inside_its_forward(tmp_path):
    """The root's own code (the loss) reaches at least its logits, their fp32 copy and the log-softmax above
    what the blocks saved: the forward's largest event is at the root's own code, above the last block's."""
    _arch, path, trace = _traced("llama-nocache", tmp_path)
    profile = load_profile(PROFILE)
    roomy = plan_model(trace, PlanRequest(gpus=2, mem_budget_bytes=ROOMY_BYTES, profile=profile, model_path=path))
    units = (Unit(("",), False), *(Unit((f"model.layers.{i}",), True) for i in range(2)))
    plan = replace(roomy.plan, units=units, frontier=(), baselines=())
    forward = [ev for ev in estimate(trace, plan, profile).memory.timeline if ev.label.startswith("forward: ")]
    at = {ev.label: ev.total_bytes for ev in forward}
    root_code, head = at["forward: :self"], at["forward: lm_head"]
    logits_bf16 = 256 * SEQ_LEN * 2  # vocabulary x tokens x 2 bytes, one sample
    assert root_code - head >= logits_bf16 * 2 + logits_bf16 * 2  # the fp32 copy and the fp32 log-softmax
    assert root_code == max(at.values())
