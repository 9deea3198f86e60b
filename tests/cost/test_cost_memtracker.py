"""Tier 2: the predicted peak against the peer, FSDPMemTracker under FakeTensorMode with the fake
process group — a small shape of benchmarks/bench_vs_memtracker.py (which runs Llama 8B at world size
8 and 64): examples/llama.py tiny at world size 8, three ungrouped plans, within 5%."""

import dataclasses

import pytest


from tests.models.cost_memtracker import memtracker_peaks  # noqa: E402

from shard_planner.cost import simulate_memory  # noqa: E402
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit  # noqa: E402
from shard_planner.hardware.profile import load_profile  # noqa: E402
from tests.paths import EXAMPLES  # noqa: E402

LLAMA = str(EXAMPLES / "llama.py")


@pytest.mark.multiprocess
def test_predicted_peak_within_5_percent_of_fsdp_mem_tracker(monkeypatch):
    from shard_planner.trace import trace_model

    monkeypatch.setenv("SHARD_PLANNER_SIZE", "tiny")
    trace = trace_model(LLAMA)
    layers = [m.fqn for m in trace.modules if m.type_name == "TransformerBlock"]
    ws = 8

    def plan(reshard=True, fwd=0, mb=8):
        units = [Unit(("",), False)] + [Unit((fqn,), reshard) for fqn in layers]
        return Plan(ModelRef(LLAMA, trace.fingerprint), Cluster(ws, 8, "h100-80gb", 2**30), Mesh(ws),
                    Training(mb), tuple(units), Prefetch(fwd, 1))

    plans = {"reshard": plan(), "no reshard": plan(reshard=False), "prefetch 1, micro-batch 16": plan(fwd=1, mb=16)}
    peers = memtracker_peaks(LLAMA, list(plans.values()), env={"SHARD_PLANNER_SIZE": "tiny"}, timeout_s=600)
    # FSDPMemTracker counts tensors only: no fixed overhead
    profile = dataclasses.replace(load_profile("h100-80gb"), reserved_bytes=0, per_process_group_bytes=0)
    errors = {}
    for (name, p), peer in zip(plans.items(), peers):
        ours = simulate_memory(trace, p, profile).peak_bytes
        errors[name] = (ours - peer) / peer
    assert all(abs(e) <= 0.05 for e in errors.values()), errors
