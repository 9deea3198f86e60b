"""The FSDP2 export trains: the tiny Llama, 3 steps on 2 gloo ranks, sharded by the exported
apply_sharding with the optimizer its usage line builds (the plan's, lr 3e-4); the 8B exports compile
and name the plan's lr. Needs only torch."""

import json
import os
import subprocess
import sys

import pytest

from tests.ecosystem.conftest import LLAMA, PLANS_8B, llama_size
from tests.paths import REPO

pytestmark = [pytest.mark.ecosystem, pytest.mark.multiprocess]


def test_fsdp2_snippet_trains_three_steps_on_two_ranks(tiny_llama_plan, tmp_path):
    from shard_planner.report.export import export_plan

    with llama_size("tiny"):
        snippet = export_plan(tiny_llama_plan, "fsdp2").text
    path = tmp_path / "apply_sharding.py"
    path.write_text(snippet)
    env = {**os.environ, "SHARD_PLANNER_SIZE": "tiny", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(REPO / "tests" / "ecosystem" / "fsdp2_steps.py"), LLAMA, str(path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result["losses"]) == 3 and all(loss == loss for loss in result["losses"])
    assert result["lr"] == 3e-4


@pytest.mark.parametrize("name", list(PLANS_8B))
def test_fsdp2_8b_snippets_compile(name, llama_8b_exports):
    plan, exports = llama_8b_exports[name]
    namespace: dict = {}
    exec(compile(exports["fsdp2"].text, "apply_sharding.py", "exec"), namespace)
    assert [tuple(m) for m, _, _ in namespace["UNITS"]] == [u.modules for u in plan.units]
    assert f"lr={plan.training.lr!r}" in namespace["__doc__"]


def test_fsdp2_tp_snippet_trains_three_steps_on_four_ranks(tmp_path):
    """dp 2 x tp 2 (sequence and loss parallelism, torchtitan's Llama styles) of the tiny Llama on 4 gloo ranks:
    the exported snippet's init_device_mesh, apply_sharding and loss_context train 3 steps to finite losses."""
    from shard_planner.report.export import export_plan
    from tests.report.tp_plans import llama_tp_plan

    with llama_size("tiny"):
        plan = llama_tp_plan("tiny", shard=2, tp=2, lr=3e-4)
        snippet = export_plan(plan, "fsdp2").text
    path = tmp_path / "apply_sharding_tp.py"
    path.write_text(snippet)
    env = {**os.environ, "SHARD_PLANNER_SIZE": "tiny", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(REPO / "tests" / "ecosystem" / "fsdp2_steps.py"), LLAMA, str(path), "29571"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["world"] == 4 and len(result["losses"]) == 3
    assert all(loss == loss and loss < 1e4 for loss in result["losses"]) and result["lr"] == 3e-4
