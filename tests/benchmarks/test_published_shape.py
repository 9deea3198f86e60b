"""examples/shape.py: a decoder of any published shape (SHARD_PLANNER_SHAPE), checked against the
parameter-count formula the published runs state, traced, and trained one step on a CPU."""

import csv
import json

import pytest
import torch

from shard_planner.model.modelfile import load_model_file
from shard_planner.trace import trace_model
from tests.paths import EXAMPLES

import bench_published  # noqa: E402

SHAPE = str(EXAMPLES / "shape.py")
PUBLISHED = bench_published.DEFAULT_CSV  # where the benchmark looks for ../shared's development set


def _mpt_shapes() -> list[dict]:
    """The distinct MPT shapes of the published set (hard-coded when the shared data is absent)."""
    if PUBLISHED.is_file():
        with PUBLISHED.open() as f:
            rows = list(csv.DictReader(f))
        seen = {}
        for r in rows:
            shape = dict(n_layers=int(r["n_layers"]), d_model=int(r["d_model"]), d_ffn=int(r["d_ffn"]),
                         n_heads=int(r["n_heads"]), vocab=int(r["vocab"]), seq_len=int(r["seq_len"]))
            seen[tuple(shape.values())] = shape
        return list(seen.values())
    return [dict(n_layers=12, d_model=768, d_ffn=3072, n_heads=12, vocab=50368, seq_len=2048),
            dict(n_layers=80, d_model=8192, d_ffn=32768, n_heads=64, vocab=50368, seq_len=2048)]


def _load(monkeypatch, shape: dict):
    monkeypatch.setenv("SHARD_PLANNER_SHAPE", json.dumps(shape))
    return load_model_file(SHAPE)


def test_mpt_param_count_matches_the_published_formula(monkeypatch):
    mf = _load(monkeypatch, _mpt_shapes()[0])
    from_file = mf.build_model.__globals__["mpt_param_count"]
    for shape in _mpt_shapes():
        monkeypatch.setenv("SHARD_PLANNER_SHAPE", json.dumps(shape))
        with torch.device("meta"):
            model = mf.build()
        n = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
        L, d, V, S = shape["n_layers"], shape["d_model"], shape["vocab"], shape["seq_len"]
        assert n == 12 * L * d * d + 13 * L * d + V * d + S * d + 2 * d == from_file(L, d, V, S), shape


def test_published_70b_count_is_the_csv_notes_figure(monkeypatch):
    """MPT-70b at seq 2048: NumParams 64862437376 (published_fsdp_runs.csv notes)."""
    mf = _load(monkeypatch, dict(n_layers=80, d_model=8192, d_ffn=32768, n_heads=64, vocab=50368, seq_len=2048))
    with torch.device("meta"):
        model = mf.build()
    assert sum(p.numel() for p in model.parameters()) == 64862437376


def test_llama_style_shape_counts(monkeypatch):
    """swiglu, rmsnorm, rope, no biases, untied, GQA: Llama 3 8B's 8,030,261,248 parameters."""
    mf = _load(monkeypatch, dict(n_layers=32, d_model=4096, d_ffn=14336, n_heads=32, n_kv_heads=8, vocab=128256,
                                 seq_len=8192, tied_embeddings=False, ffn_type="swiglu", norm="rmsnorm",
                                 pos="rope", bias=False))
    with torch.device("meta"):
        model = mf.build()
    assert sum(p.numel() for p in model.parameters()) == 8030261248


@pytest.mark.parametrize("variant", [{}, dict(ffn_type="swiglu", norm="rmsnorm", pos="rope", bias=False,
                                              n_kv_heads=2, tied_embeddings=False)])
def test_tiny_shape_trains_and_traces(monkeypatch, variant):
    shape = dict(n_layers=2, d_model=32, d_ffn=128, n_heads=4, vocab=64, seq_len=16, **variant)
    mf = _load(monkeypatch, shape)
    torch.manual_seed(0)
    model = mf.build()
    inputs, targets = mf.batch(2)
    loss = mf.loss(model(*inputs), targets)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())
    trace = trace_model(mf, dtype="float32")
    assert trace.tokens_per_sample == 16
    assert trace.param_count == sum(p.numel() for p in model.parameters())
    # attention forward FLOPs 4·b·h·s²·hd per block are in the trace: total forward > 2·N·tokens
    fwd = sum(m.fwd_flops_self.at(1) for m in trace.modules)
    assert fwd > 2 * (trace.param_count - 64 * 32) * 16


def test_bad_shape_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("SHARD_PLANNER_SHAPE", json.dumps(dict(n_layers=2, d_model=32)))
    with pytest.raises(Exception, match="lacks"):
        load_model_file(SHAPE)
