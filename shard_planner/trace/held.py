"""Storages the forward's output holds beyond its tensors: a cache, kept until the output is dropped.

[Note: Storages the forward's output holds]
  A module's activations reach the memory walk as what its ops save for backward and what it outputs
  (trace/capture.py). A transformers decoder built with ``use_cache=True`` keeps a third kind: its
  attention layers append their keys and values to a cache object in the forward's output
  ([Note: A forward that builds a cache], trace/cache.py; ``DynamicLayer.update`` concatenates, so each
  is a new storage), which no op saves (the math attention saves its own casts of them) and which is no
  tensor of any module's output. They live from the attention's forward until the output is dropped
  after the loss, so the walk missed them wherever the root is split into blocks (a plan with a unit
  inside the model): measured on the zoo's T5 (tests/hf/zoo.py, bf16, 2 ranks, its decoder's last block a
  unit), the storage tracker found the 8 cached keys and values (32,768 B) live at the loss, inside the
  forward, where the walk predicted 52,928 B less than the measured forward peak (2,454,656 B against
  2,507,584 B). A model traced whole already saw them in its root's peak rise.

  They are found in the trace's own log: storages freed when the run drops the forward's output (between
  the loss's forward and the backward: ``Step.run``'s ``del out``) that are not tensors of the output
  (those, the logits, are the last block's output, which the walk holds already). Each is counted for the
  call whose own op allocated it (the innermost call open at its allocation); a twin counts its template's
  (trace/replay.py). The walk (cost/memory.py ``_MemoryWalk.forward``) adds them after their block and
  drops them all after the loss. A storage the output holds longer (past the backward) is not counted.
"""

from __future__ import annotations

from shard_planner.trace.records import ALLOC, ENTER, EXIT, FREE, Call


def held_by_output(events: list[tuple], root: Call | None, loss: Call, output_sids: frozenset[int]) -> dict[int, int]:
    """id(call) -> bytes of the storages its own forward ops allocated that the forward's output held until it
    was dropped ([Note: Storages the forward's output holds]). ``output_sids``: the storages of the output's
    tensors (not counted)."""
    if root is None or root.fwd is None or loss.fwd is None or loss.bwd is None:
        return {}
    dropped = {ev[1]: -ev[2] for ev in events[loss.fwd.end + 1:loss.bwd.start]
               if ev[0] == FREE and ev[2] < 0 and ev[1] not in output_sids}
    if not dropped:
        return {}
    out: dict[int, int] = {}
    stack: list[Call] = []
    for ev in events[root.fwd.start:root.fwd.end + 1]:
        kind = ev[0]
        if kind == ENTER and ev[1].kind == "fwd":
            stack.append(ev[1].call)
        elif kind == EXIT and ev[1].kind == "fwd":
            stack.pop()
        elif kind == ALLOC and ev[1] in dropped and stack:
            key = id(stack[-1])
            out[key] = out.get(key, 0) + dropped.pop(ev[1])
    return out
