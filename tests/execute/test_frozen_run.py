"""Fine-tuning with frozen parameters in real FSDP2 runs (CPU/gloo, world size 2): examples/llama_lora.py
with LoRA adapters on wq/wv (base weights frozen) and with only wq/wv trainable, one unit per top-level
module (the frozen embedding, norm and head included): the predicted peak within 0.5% and the collective
bytes exactly as measured (docs/frozen_facts.md; before frozen parameters were priced: +10.8% and
655.25 KiB of reduce-scatter predicted where 14 KiB ran)."""

from dataclasses import replace

import pytest

from shard_planner.comm import REDUCE_SCATTER
from shard_planner.cost import estimate
from shard_planner.execute import launch_plans
from shard_planner.plan import load_plan
from shard_planner.profile import load_profile
from shard_planner.trace import trace_model
from tests.paths import REPO

MODEL = str(REPO / "examples" / "llama_lora.py")


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["lora", "wq_wv"])
def test_frozen_fine_tune_runs_as_predicted_world_size_2(monkeypatch, kind):
    monkeypatch.setenv("SHARD_PLANNER_FINETUNE", kind)  # the ranks build the same fine-tune
    plan = load_plan(REPO / "docs" / "frozen_baseline" / f"units_{kind}" / "plan.json")
    plan = replace(plan, model=replace(plan.model, path=MODEL))
    trace = trace_model(MODEL, dtype=plan.training.param_dtype)
    plan = replace(plan, predicted=estimate(trace, plan, load_profile("cpu-gloo")).prediction())
    m = launch_plans([plan], steps=2, warmup=1, device="cpu", timeout_s=300).measurements[0]
    assert m.comm_matches, (m.comm_measured, m.comm_predicted)
    reduced = sum(c.bytes for c in m.comm_measured if c.collective == REDUCE_SCATTER)
    trainable_fp32_grads = 4 * trace.trainable_param_count
    assert reduced == trainable_fp32_grads  # (no padding at these shapes on 2 ranks)
    assert m.peak_bytes == pytest.approx(plan.predicted.peak_bytes, rel=0.005)
