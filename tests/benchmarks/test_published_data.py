"""benchmarks/data/llm_foundry_2023_h100_a100.csv (llm-foundry's later H100 and A100 tables) as
bench_published.py reads it: each row's shape has the parameter count the table publishes, the sharding
strategy reaches the plan, and each GPU's profile prices the attention kernel its runs used."""

import re
from types import SimpleNamespace

import bench_published as bp  # noqa: E402
import pytest

from tests.paths import REPO

DATA = REPO / "benchmarks" / "data" / "llm_foundry_2023_h100_a100.csv"


@pytest.fixture(scope="module")
def runs():
    return bp.load_runs(DATA)


def test_every_row_has_its_published_parameter_count(runs):
    """The notes carry the table's NumParams; the MPT formula of examples/shape.py at the row's shape gives it."""
    import csv

    with DATA.open() as f:
        notes = [r["notes"] for r in csv.DictReader(f)]
    assert len(runs) == len(notes) == 129
    for run, note in zip(runs, notes):
        published = int(re.match(r"NumParams (\d+)", note).group(1))
        s = run.shape
        L, d, V, S = s["n_layers"], s["d_model"], s["vocab"], s["seq_len"]
        assert 12 * L * d * d + 13 * L * d + V * d + S * d + 2 * d == published, run


def test_gpus_and_sharding(runs):
    assert {r.gpu for r in runs} == {"H100-80GB", "A100-80GB"}
    assert sum(r.gpu == "H100-80GB" for r in runs) == 70
    grad_op = [r for r in runs if not r.reshard]
    assert len(grad_op) == 6 and all(r.model in ("MPT-1b", "MPT-3b") and r.n_gpus >= 128 for r in grad_op)


@pytest.mark.parametrize("reshard", [True, False])
def test_plan_mirrors_the_sharding_strategy(runs, reshard):
    run = next(r for r in runs if r.reshard is reshard)
    plan = bp.plan_for(run, SimpleNamespace(fingerprint="f"), "h100-80gb", 80 << 30)
    blocks = [u for u in plan.units if not u.is_root]
    assert len(blocks) == run.shape["n_layers"]
    assert all(u.reshard_after_forward is reshard for u in blocks)
    assert next(u for u in plan.units if u.is_root).reshard_after_forward is False


def test_attention_kernel_per_gpu():
    """A100 rows: Triton FlashAttention's measured A100 speed; H100 rows: the profile's own figures."""
    a100 = bp.stack_profile("a100-80gb", "roofline")
    h100 = bp.stack_profile("h100-80gb", "roofline")
    assert a100.kernels["attention_fwd_efficiency"] == bp.TRITON_FLASH_ATTENTION["attention_fwd_efficiency"]
    assert h100.kernels["attention_fwd_efficiency"] == bp.load_profile("h100-80gb").kernels["attention_fwd_efficiency"]
    assert not h100.fsdp_copies and h100.compute_model == "roofline"
