"""Tier 1: the memory walk's FSDP2 buffers as a sequence (cost/alloc_sequence.py) and the comparison that
the real-run check (tests/execute/test_alloc_sequence.py) uses, on tests/models/cost_mlp.py's hand-written
trace."""

from dataclasses import replace

import pytest

from shard_planner.cost import CostModel
from shard_planner.cost.alloc_sequence import (
    ACTIVATION_TOLERANCE, AG_OUTPUT, ALLOC, FREE, RS_INPUT, SHARDED_GRAD, UNSHARDED, SeqEvent, canonical,
    compare_sequences, walk_sequence,
)
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit
from tests.models import cost_mlp

L = cost_mlp.LAYERS


def _plan(reshard=True) -> Plan:
    units = [Unit(("",), False)] + [Unit((f"blocks.{i}",), reshard) for i in range(L)]
    return Plan(ModelRef("cost_mlp.py", "x"), Cluster(2, 2, "cpu-gloo", 2**30), Mesh(2),
                Training(64, "adamw", "bfloat16"), tuple(units), Prefetch(0, 1))


@pytest.fixture(scope="module")
def walked():
    model = CostModel(cost_mlp.analytic_trace(compute_dtype="bfloat16"), _gloo())
    return model, walk_sequence(model, _plan())


def _gloo():
    from shard_planner.hardware.profile import load_profile

    return load_profile("cpu-gloo")


def test_walk_sequence_of_a_block_unit(walked):
    model, seq = walked
    ub = model.unit_bytes(_plan())[1]  # blocks.0: d x d in bf16 gathered, fp32 reduce-scatter input
    d = cost_mlp.D
    assert ub.unsharded == d * d * 2 and ub.rs_input == d * d * 4
    mine = [(e.op, e.kind, e.size_bytes, e.phase) for e in seq if e.unit == "blocks.0"]
    assert mine == [
        (ALLOC, AG_OUTPUT, d * d * 2, "forward"), (ALLOC, UNSHARDED, d * d * 2, "forward"),
        (FREE, UNSHARDED, d * d * 2, "forward"), (FREE, AG_OUTPUT, d * d * 2, "forward"),  # held to blocks.1's copy-out
        (ALLOC, AG_OUTPUT, d * d * 2, "backward"), (ALLOC, UNSHARDED, d * d * 2, "backward"),
        (FREE, AG_OUTPUT, d * d * 2, "backward"), (FREE, UNSHARDED, d * d * 2, "backward"),
        (ALLOC, RS_INPUT, d * d * 4, "backward"), (ALLOC, SHARDED_GRAD, d * d * 2, "backward"),  # fp32, 1/2
        (FREE, RS_INPUT, d * d * 4, "backward"), (FREE, SHARDED_GRAD, d * d * 2, "optimizer"),
    ]
    first = next(e for e in seq if e.unit == "blocks.0")
    assert first.scratch_bytes == d * d * 2 // 2  # the bf16 cast of this rank's fp32 shard


def test_every_allocation_is_freed_once(walked):
    _, seq = walked
    live: dict = {}
    for e in seq:
        k = (e.kind, e.unit, e.size_bytes)
        live[k] = live.get(k, 0) + (1 if e.op == ALLOC else -1)
        assert live[k] in (0, 1), e
    assert set(live.values()) == {0}


def test_identical_sequences_match(walked):
    _, seq = walked
    check = compare_sequences(list(seq), seq)
    assert (check.events_matched, check.first_mismatch, check.failures()) == (len(seq), None, frozenset())


def test_a_swapped_pair_is_the_first_mismatch(walked):
    _, seq = walked
    perturbed = list(seq)
    perturbed[5], perturbed[6] = perturbed[6], perturbed[5]
    check = compare_sequences(perturbed, seq)
    assert check.events_matched == 5 and check.first_mismatch.startswith("event 5: real ")
    assert check.failures() == {"buffers"}


def test_one_byte_more_and_a_missing_event_are_mismatches(walked):
    _, seq = walked
    bigger = list(seq)
    bigger[3] = replace(bigger[3], size_bytes=bigger[3].size_bytes + 1)
    assert compare_sequences(bigger, seq).events_matched == 3
    shorter = compare_sequences(list(seq[:-1]), seq)
    assert shorter.events_matched == len(seq) - 1 and "(none: the real step ends)" in shorter.first_mismatch


def test_gradients_are_exact_and_activations_within_the_tolerance(walked):
    _, seq = walked
    i = next(i for i, e in enumerate(seq) if e.grad_bytes)
    grads = list(seq)
    grads[i] = replace(grads[i], grad_bytes=grads[i].grad_bytes + 2)
    check = compare_sequences(grads, seq)
    assert check.failures() == {"grads"} and check.first_grad_mismatch.startswith(f"event {i}:")
    top = max(e.activation_bytes for e in seq)
    j = next(j for j, e in enumerate(seq) if e.activation_bytes == top)
    for shift, failing in ((0.9, frozenset()), (1.1, {"activations"})):
        acts = list(seq)
        acts[j] = replace(acts[j], activation_bytes=int(top * (1 + shift * ACTIVATION_TOLERANCE)))
        assert compare_sequences(acts, seq).failures() == failing


def test_zero_grad_frees_are_compared_as_a_set():
    def event(op, kind, unit):
        return SeqEvent(op, kind, unit, 8, "optimizer")

    events = [event(ALLOC, RS_INPUT, "x"), event(FREE, SHARDED_GRAD, "b"), event(FREE, SHARDED_GRAD, "a"),
              event(FREE, RS_INPUT, "x"), event(FREE, SHARDED_GRAD, "c")]
    assert [e.unit for e in canonical(events)] == ["x", "a", "b", "x", "c"]  # each run sorted, not across
