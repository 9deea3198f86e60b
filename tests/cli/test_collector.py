"""The cyclic collector during ``shard-planner plan`` (shard_planner/cli/collector.py): stretches without
collections, survivors frozen, and everything as it was after the command, so an in-process caller
keeps no garbage; and the planner is imported when the command runs, not to build the parser."""

import gc
import subprocess
import sys
import weakref

from shard_planner.cli.collector import command_collector, without_collections
from tests.paths import REPO


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_without_collections_pauses_the_collector_and_freezes_what_it_built():
    assert gc.isenabled()
    with command_collector():
        with without_collections():
            assert not gc.isenabled()
            kept = [_Node() for _ in range(10)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= len(kept)
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_garbage_made_during_the_command_is_collected_after_it():
    with command_collector():
        with without_collections():
            node = _Node()
            ref = weakref.ref(node)
            del node
        gc.collect()
        assert ref() is not None  # frozen with the survivors of the stretch: not collected during the command
    gc.collect()
    assert ref() is None  # given back at the end of the command: collected as before


def test_the_collector_is_restored_after_an_error():
    try:
        with command_collector():
            with without_collections():
                raise ValueError("boom")
    except ValueError:
        pass
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_caller_that_froze_objects_keeps_them_frozen():
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        with command_collector():
            pass
        assert gc.get_freeze_count() >= before > 0
    finally:
        gc.unfreeze()


def test_building_the_plan_parser_imports_neither_torch_nor_the_solver():
    code = ("import sys; from shard_planner.cli.main import build_parser; build_parser(['plan']); "
            "print(sorted(m for m in ('torch', 'ortools', 'matplotlib', 'shard_planner.solve') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_time_line_names_the_imports():
    from shard_planner.cli.plan import time_line
    from shard_planner.solve.request import PlanTimings

    timings = PlanTimings(screen_s=0.1, solve_s=0.2, frontier_s=0.3, baselines_s=0.0, polish_s=0.4, simplify_s=0.0,
                          other_s=0.0, total_s=1.0, cpsat_s=0.1, hints_s=0.0, simulate_s=0.2, simulated_plans=3,
                          cpsat_solves=1)
    result = type("Result", (), {"timings": timings})()
    line = time_line(result, 2.0, 0.5, 1.25)
    assert line.startswith("imports 1.25 s, trace 2.00 s, screen 0.10 s") and "report 0.50 s" in line
    assert not time_line(result, 2.0, None).startswith("imports")
