"""The report of a single-device plan (plan/engine.py ``SINGLE``: one device, plain PyTorch, no sharding) says
what that step does, in report/engine_words.py's words: no sharding, reshard, prefetch, all-gather,
reduce-scatter or communication anywhere FSDP2 would name them, every floating parameter in the stored dtype,
regions that are checkpointed or not. An FSDP2 plan of the same model on the same device keeps its words.

The model is examples/llama_lora.py (tiny, every parameter built in fp32, the base frozen): on one device the
parameters are held in bfloat16 (2 bytes each, cost/engines/single.py), under FSDP2 as built (4 bytes each)."""

from __future__ import annotations

import pytest

from shard_planner.cli.main import main
from shard_planner.cost import estimate
from shard_planner.hardware.profile import load_profile
from shard_planner.model.modelfile import load_model_file
from shard_planner.plan import load_plan
from shard_planner.plan.engine import DESCRIPTIONS, SINGLE
from shard_planner.report import build_sections
from shard_planner.report.engine_words import engine_words
from shard_planner.report.plots import plot_units
from shard_planner.report.rows import unit_rows
from shard_planner.trace.tracer import trace_for_plan
from tests.paths import EXAMPLES

MODEL = str(EXAMPLES / "llama_lora.py")
MIB = 2**20

# What only FSDP2 does, as the report says it (the frontier table's plan descriptions and recipe names are the
# solver's and plan/recipes.py's, not the report's: they are left out of the check)
FSDP2_ONLY = ("FSDP", "-way sharding", "sharded", "reshard", "prefetch", "all-gather", "reduce-scatter",
               "exposed comm", "collectives", "gradients reduced in")


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """{engine: (plan file, the folder ``report`` wrote, the folder ``plan`` wrote)} for the same model on one
    CPU rank (gloo), planned for each engine."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:  # as tests/conftest.py's autouse fixture, for a module's fixture
        for name in ("SHARD_PLANNER_SIZE", "SHARD_PLANNER_SEQ", "SHARD_PLANNER_FINETUNE"):
            mp.delenv(name, raising=False)
        mp.setenv("SHARD_PLANNER_TRACE_CACHE", "off")
        for engine in ("single", "fsdp2"):
            d = tmp_path_factory.mktemp(engine)
            plan = d / "p.json"
            assert main(["plan", MODEL, "--gpus", "1", "--mem", "2GB", "--profile", "cpu-gloo", "--engine", engine,
                         "--time-limit", "0.5", "-o", str(plan)]) == 0
            assert main(["report", str(plan), "-o", str(d / "r")]) == 0
            out[engine] = (plan, d / "r", d / "p.report")
    return out


def _report_text(md: str) -> str:
    """report.md without the lines that quote the solver's plan descriptions and the recipes' names."""
    quoting = ("| frontier |", "| recipe |", "| vs recipes |")
    return "\n".join(line for line in md.splitlines() if not line.startswith(quoting))


def _summary(md: str) -> dict[str, str]:
    rows = [line.split(" | ", 1) for line in md.split("\n## ", 1)[0].splitlines() if line.startswith("| ")]
    return {k.removeprefix("| "): v.removesuffix(" |") for k, v in rows if k != "|"}  # not the header "| | |"


def _table(md: str) -> list[dict[str, str]]:
    """The units (regions) table's rows, each by column."""
    lines = md.split("\n## Regions\n" if "\n## Regions\n" in md else "\n## Units\n", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines.splitlines() if line.startswith("| ")]
    return [dict(zip(rows[0], r)) for r in rows[1:]]


def _per_model(table: list[dict[str, str]], column: str) -> float:
    """A per-unit column summed over the model (rows' figures are per unit: times their count)."""
    return sum(int(r["count"]) * float(r[column].replace(",", "")) for r in table)


def test_the_single_device_report_names_nothing_fsdp2_does(plans):
    plan_file, report_dir, _ = plans["single"]
    plan = load_plan(plan_file)
    assert plan.engine == SINGLE and plan.training.stored_dtype == "bfloat16"
    md = (report_dir / "report.md").read_text()
    text = _report_text(md)
    assert [w for w in FSDP2_ONLY if w in text] == []
    summary = _summary(md)
    assert summary["mesh"] == DESCRIPTIONS[SINGLE]
    assert "every floating parameter cast to bfloat16 and trained in it" in summary["training"]
    assert "no gradient reduction" in summary["training"]
    checkpointed = sum(1 for u in plan.inner_units if u.activation_checkpoint)
    assert summary["regions"] == f"{len(plan.inner_units)} regions, {checkpointed} checkpointed"
    assert "units" not in summary and "prefetch" not in summary
    assert "exposed communication" not in summary["predicted step"]
    assert ("after each event of the single-device step (each region's forward and backward, a checkpointed one's "
            "recomputation, the loss, the optimizer step)") in md
    assert "\n## Regions\n" in md and "\n## Units\n" not in md
    assert "frozen: held like the others, with no gradient or optimizer state." in md
    assert "apply_plan(model, plan) casts the model" in md and "torchtitan and deepspeed cannot run" in md


def test_the_regions_table_holds_what_the_device_holds(plans):
    """One device: a region's parameters in bfloat16 (the engine's rule, cost/engines/single.py), no unsharded
    copy, no reshard and no communication columns; FSDP2 on one rank: sharded as built (fp32) and gathered."""
    single = _table((plans["single"][1] / "report.md").read_text())
    fsdp2 = _table((plans["fsdp2"][1] / "report.md").read_text())
    assert list(single[0]) == ["region", "count", "modules per region", "activation checkpoint", "params",
                               "trainable params", "params (MiB)", "activations kept (MiB)", "compute (ms)"]
    params = _per_model(single, "params")
    assert params == _per_model(fsdp2, "params") > 0
    assert _per_model(single, "params (MiB)") == pytest.approx(params * 2 / MIB, rel=1e-2)  # bfloat16
    assert _per_model(fsdp2, "sharded params/rank (MiB)") == pytest.approx(params * 4 / MIB, rel=1e-2)  # fp32
    assert {"reshard after forward", "unsharded params (MiB)", "FSDP collectives (ms)", "exposed comm. (ms)"} <= set(
        fsdp2[0])


def test_an_fsdp2_plan_keeps_its_words(plans):
    md = (plans["fsdp2"][1] / "report.md").read_text()
    summary = _summary(md)
    assert summary["mesh"] == "1-way sharding" and "gradients reduced in float32" in summary["training"]
    assert "units + root" in summary["units"] and "reshard after forward" in summary["units"]
    assert "prefetch" in summary and "exposed communication" in summary["predicted step"]
    assert "after each event of the FSDP2 schedule (all-gathers, unit forward and backward, reduce-scatters" in md
    assert "\n## Units\n" in md and "One row per FSDP unit" in md
    assert "all-gathered like the others, with no gradient, reduce-scatter or optimizer state" in md
    assert "apply_plan(model, plan, mesh)" in md


def test_plan_writes_the_same_single_device_report(plans):
    _, by_report, by_plan = plans["single"]
    assert (by_plan / "report.md").read_text() == (by_report / "report.md").read_text()


def test_the_figures_name_parameters_and_no_collectives(plans):
    """The memory timeline's legend names the parameters as held (not sharded); the regions figure draws no
    unsharded copy and no collective or exposed bar, and tags no row with reshard."""
    plan = load_plan(plans["single"][0])
    profile = load_profile("cpu-gloo")
    trace = trace_for_plan(load_model_file(MODEL), plan)
    est = estimate(trace, plan, profile)
    sections = {s.title: s for s in build_sections(plan, trace=trace, profile=profile, estimate=est)}
    legend = [t.get_text() for t in sections["Memory over one step"].figure.legends[0].get_texts()]
    assert "parameters" in legend and "sharded params" not in legend
    fig = plot_units(unit_rows(plan, trace, est), words=engine_words(plan))
    gids = {str(a.get_gid()) for a in fig.findobj() if a.get_gid()}
    assert "mem:sharded_param_bytes" in gids and "time:compute" in gids
    assert not [g for g in gids if g.startswith(("mem:unsharded", "time:comm", "time:exposed"))]
    labels = [t.get_text() for ax in fig.axes for t in ax.get_yticklabels()]
    assert labels and not [t for t in labels if "reshard" in t]
    assert "region" in fig._suptitle.get_text() and "FSDP" not in fig._suptitle.get_text()
