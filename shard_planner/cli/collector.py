"""The cyclic garbage collector during one command: what the imports and the trace leave alive is frozen
out of the collections, the stretches that build it run without collections, and the interpreter's
last collection at exit is skipped.

[Note: the collector during a command] Importing torch (and, with FakeTensorMode, torch._dynamo and
sympy), CP-SAT, pandas and matplotlib leaves some 400,000 long-lived objects. With the collector as
Python sets it, every full collection walks all of them again: on ``shard-planner plan`` of Llama 8B,
about 7 full and 100 middle collections during the command (0.9 s) and one more at interpreter exit
(0.8 s), which free almost nothing. :func:`gc.freeze` is CPython's tool for this ("move all objects
tracked by the garbage collector into a permanent generation, i.e. ignore them in all the future
collections", https://docs.python.org/3/library/gc.html#gc.freeze). So:

- :func:`command_collector` wraps the command: what is alive when it starts is frozen; at its end
  everything frozen is given back (:func:`gc.unfreeze`) and the collector is as before, so an in-process
  caller (the tests) loses nothing: cyclic garbage made during the command is collected later, as it
  would have been. At interpreter exit everything is frozen again: the process ends and the operating
  system takes its memory back, so the final collection would only cost time (reference counting still
  frees everything it frees today; objects are not kept alive by this).
- :func:`without_collections` wraps the stretches that mostly build objects that stay (the heavy imports,
  the trace with its import of torch._dynamo, the report with matplotlib): no collections during them,
  and what they leave is frozen at their end. Their cyclic garbage waits for the end of the command: the
  process's peak memory grows by about 2% (447 -> 456 MB planning Llama 70B, 466 -> 475 MB for
  transformers' Llama 8B).

Measured on ``plan`` of Llama 8B / 8 GPUs / 40GB: 7.9 -> 6.2 s of CPU for the whole command, the plan and
the report unchanged; the collector then runs about 0.1 s in all.

The same holds for what arrives after the command's start and stays: the traces of each tensor-parallel
degree and the screens that come back from the helpers (cli/background.py unpickles every message without
collections, and each helper runs its calls so), and the planner's search, whose memos (tables, schedules,
unit costs, thousands of estimates) live until the report (cli/plan.py). Before, ``plan`` of Llama 3 70B on
64 GPUs at 80GB (warm trace cache) ran 10 full collections taking 0.86 s in the command's process alone; after,
none during the search, and the command's peak memory grew 316 -> 324 MB (with an empty trace cache, the helpers
tracing the degrees without collections: 480 -> 508 MB, the largest process's). With the per-unit cost memo
(cost/model.py ``unit_costs_of``) the command went 7.77 -> 6.14 s wall and 12.6 -> 10.0 CPU-s (medians of 3,
benchmarks/bench_planner_speed.py, reports/benchmarks/planner_speed.md).
"""

from __future__ import annotations

import atexit
import gc
from contextlib import contextmanager

_exit_hook_registered = False


def _freeze_at_exit() -> None:
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(gc.freeze)
        _exit_hook_registered = True


@contextmanager
def command_collector():
    """The collector during one command (see [Note: the collector during a command]): objects alive at
    its start are frozen out of collections until its end; at interpreter exit, all are."""
    _freeze_at_exit()
    caller_froze = gc.get_freeze_count() > 0  # then leave the permanent generation as it finds it
    gc.freeze()
    try:
        yield
    finally:
        if not caller_froze:
            gc.unfreeze()


@contextmanager
def without_collections():
    """No collections while the block runs; what it leaves alive is frozen at its end (inside
    :func:`command_collector`, given back at the command's end). See [Note: the collector during a command]."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
