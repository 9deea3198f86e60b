"""One numerics policy (shard_planner/plan/numerics.py, issue 37 item 5): every stage reads the step's dtypes from
``Training.numerics``, and what the policy says is what cost prices.

- No module outside the plan's vocabulary reads ``.param_dtype`` or ``.reduce_dtype`` off an object (the AST of
  every module, so a comment or a string is not a hit); the few that do, each with why, are listed.
- The policy's rules are FSDP2's (MixedPrecisionPolicy, FSDPParam.init_dtype_attrs).
- Changing the policy in one place changes what the cost model prices: a module's GEMM dtype moves that block's
  compute time and nothing else (the seam float8 on chosen Linears extends), the activation dtype the
  activations, the gathered dtype the all-gathered bytes.
"""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

import shard_planner
from shard_planner.cost import CostModel
from shard_planner.cost.comm_bytes import ParamShape, collective_bytes_per_step
from shard_planner.hardware.profile import load_profile
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit
from shard_planner.plan.numerics import Numerics

PACKAGE_DIR = Path(shard_planner.__file__).resolve().parent
RAW_FIELDS = frozenset({"param_dtype", "reduce_dtype"})

# Modules (relative to shard_planner/) that read those fields, each with why.
ALLOWED: dict[str, str] = {
    "plan/__init__.py": "Training's own fields (the plan file's names) and the policy built from them",
    "solve/context.py": "the request's dtypes become the plan's Training (whose numerics every stage reads)",
    "hardware/timings.py": "ModuleTimings.param_dtype: the dtype a calibration measured in (a fact of the file)",
    "cli/calibrate.py": "prints and prices a calibration's measured dtype (ModuleTimings.param_dtype)",
}


def _reads(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    return [(node.lineno, ast.unparse(node)) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in RAW_FIELDS and isinstance(node.ctx, ast.Load)]


def test_no_module_reads_the_raw_dtypes_but_the_listed():
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        rel = path.relative_to(PACKAGE_DIR).as_posix()
        sites = _reads(path)
        if sites and rel not in ALLOWED:
            found[rel] = sites
    assert not found, ("read the dtypes from Training.numerics (plan/numerics.py), not param_dtype / reduce_dtype: "
                       f"{found}")
    stale = [rel for rel in ALLOWED if not _reads(PACKAGE_DIR / rel)]
    assert not stale, f"allowed but no longer reading the fields (drop them from ALLOWED): {stale}"


def test_the_policy_is_fsdp2s_mixed_precision():
    n = Training(micro_batch=1, param_dtype="bfloat16", reduce_dtype="float32").numerics
    assert n == Numerics("bfloat16", "float32")
    assert n.gathered_dtype("float32") == "bfloat16"  # and the unsharded gradient's
    assert n.gathered_dtype("uint8") == "uint8"  # a non-floating parameter is gathered as stored
    assert n.casts("float32") and not n.casts("bfloat16") and not n.casts("uint8")
    assert n.sharded_dtype("float32") == "float32"  # shards, sharded gradients, optimizer states as stored
    assert n.activation_dtype == n.gemm_dtype("layers.0.attention.wq") == n.gemm_dtype(None) == "bfloat16"
    assert n.reduce_casts and not Numerics("bfloat16", "bfloat16").reduce_casts  # equal: FSDP2 reduces as computed
    assert n.mixed_precision() == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}


@pytest.fixture(scope="module")
def priced():
    """A hand-written trace (tests/models) and its per-block plan on one profile."""
    from tests.models.cost_mlp import analytic_trace

    trace = analytic_trace(compute_dtype="float32")
    blocks = [m.fqn for m in trace.modules if m.fqn.startswith("blocks.") and m.fqn.count(".") == 1]
    units = (Unit(("",)),) + tuple(Unit((f,)) for f in blocks)
    plan = Plan(model=ModelRef(path="cost_mlp", fingerprint=trace.fingerprint),
                cluster=Cluster(gpus=4, gpus_per_node=8, profile="h100-80gb", mem_budget_bytes=80 * 2**30),
                mesh=Mesh(shard=4), training=Training(micro_batch=4, param_dtype="float32"),
                prefetch=Prefetch(), units=units)
    return trace, plan, load_profile("h100-80gb"), blocks


def test_a_modules_gemm_dtype_moves_its_block_alone(priced, monkeypatch):
    trace, plan, profile, blocks = priced
    cm = CostModel(trace, profile)
    before = cm.block_compute_s(cm.tables(plan.units), 4, plan.training.numerics)
    fast = blocks[0]
    monkeypatch.setattr(Numerics, "gemm_dtype", lambda self, fqn: "bfloat16" if fqn == fast else self.compute_dtype)
    after = CostModel(trace, profile).block_compute_s(cm.tables(plan.units), 4, plan.training.numerics)
    i = [b.fqn for b in cm.tables(plan.units).blocks].index(fast)
    ratio = profile.flops_per_s("float32") / profile.flops_per_s("bfloat16")
    assert after.device_fwd_s[i] == pytest.approx(before.device_fwd_s[i] * ratio)
    assert [s for j, s in enumerate(after.device_fwd_s) if j != i] == [
        s for j, s in enumerate(before.device_fwd_s) if j != i]


def test_activation_and_gathered_dtypes_are_what_cost_prices(priced, monkeypatch):
    trace, plan, profile, _ = priced
    acts = CostModel(trace, profile).block_activations(plan)
    monkeypatch.setattr(Numerics, "activation_dtype", property(lambda self: "bfloat16"))
    halved = CostModel(trace, profile).block_activations(plan)
    assert halved.saved == pytest.approx(tuple(x / 2 for x in acts.saved))
    params = [[ParamShape(dim0=8, numel=64, dtype="float32", trainable=True)]]
    one_unit = replace(plan, units=(Unit(("",)),))
    gathered = {c.collective: c.bytes for c in collective_bytes_per_step(one_unit, params, ())}
    monkeypatch.setattr(Numerics, "gathered_dtype", lambda self, stored: "bfloat16")
    assert {c.collective: c.bytes for c in collective_bytes_per_step(one_unit, params, ())}["all_gather"] == (
        gathered["all_gather"] / 2)
