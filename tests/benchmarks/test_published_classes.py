"""benchmarks/published_classes.py: each row's priced device time by kernel class, and the least-squares
reading of where the published set's error sits."""

import json
import math

import pytest

from shard_planner.trace import trace_model
from tests.paths import EXAMPLES

import bench_published as bp  # noqa: E402
import published_classes as pc  # noqa: E402

TINY = dict(n_layers=2, d_model=128, d_ffn=512, n_heads=2, n_kv_heads=2, vocab=512, seq_len=256,
            tied_embeddings=True, ffn_type="gelu", norm="layernorm", pos="learned", bias=True)


@pytest.fixture(scope="module")
def trace():
    import os

    os.environ["SHARD_PLANNER_SHAPE"] = json.dumps(TINY)
    try:
        return trace_model(str(EXAMPLES / "shape.py"), dtype="bfloat16")
    finally:
        del os.environ["SHARD_PLANNER_SHAPE"]


def test_shares_cover_the_priced_time_and_recomputation_adds_forward_work(trace):
    profile = bp.stack_profile("a100-80gb", "roofline")
    plain = pc.class_shares(trace, 2, profile, None)
    assert set(plain) == {f"share_{k}" for k in pc.CLASSES}
    assert sum(plain.values()) == pytest.approx(1.0, abs=1e-3)
    assert all(v > 0 for v in plain.values())
    recomputed = pc.class_shares(trace, 2, profile, "blocks.")
    # the recomputed forward runs GEMMs and attention forward, never attention's backward
    assert recomputed != plain
    assert sum(recomputed.values()) == pytest.approx(1.0, abs=1e-3)


def test_no_kernel_table_no_shares(trace):
    from dataclasses import replace

    assert pc.class_shares(trace, 2, replace(bp.stack_profile("a100-80gb", "flops"), kernels={}), None) == {}


def test_attribution_recovers_a_class_priced_too_fast():
    # rows whose GEMMs alone were priced 10% too fast: ln(pred / published) = 0.10 x matmul share
    shares = [(0.8, 0.1, 0.1), (0.5, 0.4, 0.1), (0.3, 0.6, 0.1), (0.6, 0.1, 0.3), (0.2, 0.7, 0.1), (0.7, 0.2, 0.1)]
    rows = [dict(share_matmul=m, share_attention=a, share_memory_bound=b, error_pct=math.expm1(0.10 * m) * 100)
            for m, a, b in shares]
    out = pc.attribution(rows, "synthetic")
    assert out["matmul_pct"] == pytest.approx(10.0, abs=0.1)
    assert out["attention_pct"] == pytest.approx(0.0, abs=0.1)
    assert out["memory_bound_pct"] == pytest.approx(0.0, abs=0.1)
    assert out["median_abs_residual_pct"] < 0.01
    assert pc.attribution(rows[:2], "too few") == dict(group="too few", rows=2)
