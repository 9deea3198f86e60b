"""The engine seam (cost/engines/ [Note: What an engine owns]; issue 37 item 6): the cost model asks the plan's
engine for the step's events, each unit's bytes and costs and the walks, so a second engine's rules stand
beside FSDP2's. A stand-in engine (FSDP2's rules with every sharded state's bytes doubled: what ZeRO-1/2's
replicated parameters would change) prices the same decisions apart, through every memo; nothing outside
cost/engines/fsdp2.py calls FSDP2's rules by name; a plan file names an engine it has rules for."""

import ast
from dataclasses import replace
from pathlib import Path

import pytest

import shard_planner
from shard_planner.cost import CostModel, model_state_bytes
from shard_planner.cost import engines as engine_registry
from shard_planner.cost.engines import engine_named
from shard_planner.cost.engines.fsdp2 import FSDP2_ENGINE, _FSDP2Engine
from shard_planner.cost.engines.single import SINGLE_ENGINE
from shard_planner.errors import PlanError
from shard_planner.plan import Plan
from shard_planner.plan.engine import ENGINES, FSDP2, SINGLE
from tests.cost.test_memo_queries import _plan
from tests.models.cost_synth import synthetic_trace

PACKAGE_DIR = Path(shard_planner.__file__).resolve().parent


class _DoubledState(_FSDP2Engine):
    """FSDP2's rules, each unit's sharded parameters held twice (a stand-in for a second engine's rules)."""

    name = "doubled"

    def unit_bytes(self, t, q):
        return tuple(replace(x, sharded=2 * x.sharded) for x in super().unit_bytes(t, q))


@pytest.fixture
def two_engines(monkeypatch):
    monkeypatch.setattr(engine_registry, "_engines", lambda: {FSDP2: FSDP2_ENGINE, "doubled": _DoubledState()})


def test_the_plans_engine_prices_it_and_the_memos_keep_engines_apart(two_engines, h100):
    trace = synthetic_trace(4, 1024, 512, 4096)
    fsdp2 = _plan(trace)
    other = replace(fsdp2, engine="doubled")
    shared = CostModel(trace, h100)
    first = shared.estimate(fsdp2)
    second = shared.estimate(other)  # every memo warm with FSDP2's entries for the same decisions
    assert second == CostModel(trace, h100).estimate(other)
    sharded_params = sum(x.sharded for x in shared.unit_bytes(fsdp2))
    assert sum(x.sharded for x in shared.unit_bytes(other)) == 2 * sharded_params
    assert second.memory.peak_bytes == pytest.approx(first.memory.peak_bytes + sharded_params)
    assert shared.estimate(fsdp2) == first  # and FSDP2's answers are unchanged beside it
    assert model_state_bytes(trace, other) != model_state_bytes(trace, fsdp2)


def test_an_engine_is_named_once():
    assert engine_named(FSDP2) is FSDP2_ENGINE and ENGINES == (FSDP2, SINGLE)
    assert engine_named(SINGLE) is SINGLE_ENGINE
    with pytest.raises(PlanError, match="engine 'zero3' is not one of fsdp2, single"):
        engine_named("zero3")


def test_a_plan_file_names_its_engine(h100):
    plan = _plan(synthetic_trace(2, 256, 64, 512))
    d = plan.to_dict()
    assert "engine" not in d and Plan.from_dict(d).engine == FSDP2  # FSDP2's plans read and write as before
    assert Plan.from_dict({**d, "engine": "fsdp2"}).engine == FSDP2
    with pytest.raises(PlanError, match='engine must be one of "fsdp2", "single", got "deepspeed"'):
        Plan.from_dict({**d, "engine": "deepspeed"})


# FSDP2's rules, each called by its own module and by FSDP2's engine alone
FSDP2_RULES = {"build_schedule": "schedule.py", "query_unit_bytes": "unit_bytes.py", "unit_cost": "unit_cost.py",
               "simulate_memory_walk": "memory.py", "simulate_accumulated_memory": "accumulation.py",
               "simulate_time_walk": "time.py", "unit_collectives_s": "time.py", "unit_copies_s": "time.py",
               "accumulated_time": "accumulation.py"}


def _rule_uses(tree: ast.AST) -> set[str]:
    """Each rule of FSDP2_RULES imported by name from its module (``from shard_planner.cost.schedule import
    build_schedule``) or called by a bare name; an engine's method of the same name (``engine.unit_cost``) is
    the seam, not a use."""
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shard_planner.cost"):
            used |= {a.name for a in node.names if a.name in FSDP2_RULES}
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FSDP2_RULES:
            used.add(node.func.id)
    return used


def test_nothing_outside_the_fsdp2_engine_calls_its_rules():
    hits = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        rel = path.relative_to(PACKAGE_DIR).as_posix()
        if rel in ("cost/engines/fsdp2.py", "cost/__init__.py"):  # the engine; the package's face re-exports
            continue
        hits += [f"{rel}: {name}" for name in sorted(_rule_uses(ast.parse(path.read_text())))
                 if rel != f"cost/{FSDP2_RULES[name]}"]
    assert not hits, "FSDP2's rules used past the engine seam (ask engine_named(plan.engine)):\n" + "\n".join(hits)


def test_the_scan_sees_a_use():
    tree = ast.parse("from shard_planner.cost.schedule import build_schedule\ny = unit_cost(p)\nz = e.unit_cost(p)\n")
    assert _rule_uses(tree) == {"build_schedule", "unit_cost"}
    assert _rule_uses(ast.parse("z = engine.unit_cost(p)\n")) == set()
