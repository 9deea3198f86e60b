"""Plans the ecosystem tests export: Llama 8B (examples/llama.py, SHARD_PLANNER_SIZE=8b) on 8 GPUs at
40 GB, 40 GB with a global batch of 512, 24 GB and 16 GB (CPU offload) — the plans issue 26 names — made
once per session with the planner's CLI (3-5 s each), and a tiny Llama plan with one unit per block for
the steps that run (DeepSpeed's initialize, the FSDP2 snippet). Install the libraries with
``pip install -e '.[ecosystem]'``."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import replace

import pytest

from shard_planner.plan import Unit, load_plan
from tests.paths import REPO

LLAMA = str(REPO / "examples" / "llama.py")
PLANS_8B = {"40GB": ["--mem", "40GB"], "40GB-global512": ["--mem", "40GB", "--global-batch", "512"],
            "24GB": ["--mem", "24GB"], "16GB-offload": ["--mem", "16GB"]}
INSTALL = "pip install -e '.[ecosystem]'"


@contextmanager
def llama_size(size: str):
    """examples/llama.py reads SHARD_PLANNER_SIZE whenever it builds a model."""
    old = os.environ.get("SHARD_PLANNER_SIZE")
    os.environ["SHARD_PLANNER_SIZE"] = size
    try:
        yield
    finally:
        if old is None:
            del os.environ["SHARD_PLANNER_SIZE"]
        else:
            os.environ["SHARD_PLANNER_SIZE"] = old


@pytest.fixture(scope="session")
def llama_8b_exports(tmp_path_factory):
    """name -> (plan, {target: Export}) for the four 8B plans."""
    from shard_planner.cli.main import main
    from shard_planner.report.export import TARGETS, export_plan, model_info_for_plan

    folder = tmp_path_factory.mktemp("plans-8b")
    out = {}
    with llama_size("8b"):
        for name, args in PLANS_8B.items():
            path = folder / f"{name}.json"
            assert main(["plan", LLAMA, "--gpus", "8", *args, "-o", str(path), "--no-report"]) == 0
            plan = load_plan(path)
            info = model_info_for_plan(plan)
            out[name] = plan, {t: export_plan(plan, t, info) for t in TARGETS}
    return out


@pytest.fixture(scope="session")
def tiny_llama_plan(tmp_path_factory):
    """A tiny Llama plan on 2 GPUs with one unit per block, the root kept gathered, and lr 3e-4."""
    from shard_planner.cli.main import main

    path = tmp_path_factory.mktemp("plan-tiny") / "plan.json"
    with llama_size("tiny"):
        assert main(["plan", LLAMA, "--gpus", "2", "--mem", "2GB", "-o", str(path), "--no-report"]) == 0
    plan = load_plan(path)
    units = (Unit(("",), False), *(Unit((f"layers.{i}",), True, i == 0) for i in range(2)))
    return replace(plan, units=units, training=replace(plan.training, lr=3e-4, micro_batch=2))


@pytest.fixture(scope="session")
def llama_8b_tp_exports():
    """name -> (plan, {target: Export}) for tensor-parallel plans of the 8B Llama (tests/report/tp_plans.py):
    dp 32 x tp 8 with sequence and loss parallelism, and HSDP 2 x 4 x tp 8 without either."""
    from shard_planner.report.export import TARGETS, export_plan, model_info_for_plan
    from tests.report.tp_plans import llama_tp_plan

    out = {}
    with llama_size("8b"):
        for name, plan in {"dp32-tp8": llama_tp_plan("8b"),
                           "hsdp2x4-tp8-plain": llama_tp_plan("8b", shard=4, replicate=2, sequence_parallel=False,
                                                              loss_parallel=False)}.items():
            info = model_info_for_plan(plan)
            out[name] = plan, {t: export_plan(plan, t, info) for t in TARGETS}
    return out
