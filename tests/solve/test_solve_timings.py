"""Tier 1: the solver's linear model prices compute from measured module times when the profile has
them (shard_planner/solve/linear.py through cost.module_compute_s), on the hand-written stack of
tests/models/solve_traces.py and hand-made ModuleTimings (as tests/test_module_timings.py builds them).

The stack's blocks are uniform (4e12 forward FLOPs at micro-batch 4 = 8 ms at the test profile's
5e14 FLOP/s, backward 16 ms); the timings keep that for every block but make layers.2 ten times
slower. Its all-gathers (64 MiB at 100 GB/s, ~0.6 ms) hide behind either, so between two candidates
that differ only in the block they cover, the time coefficients differ by the compute alone.
"""

from dataclasses import replace

import pytest

from tests.models.solve_traces import profile, stack_trace
from shard_planner.cost import module_compute_s
from shard_planner.plan import Mesh, Prefetch, Training
from shard_planner.solve import PlanRequest, plan_model
from shard_planner.solve.choice import GlobalChoice
from shard_planner.solve.linear import build_linear_model
from shard_planner.solve.simulate import simulate
from shard_planner.solve.space import build_space
from shard_planner.hardware.timings import ModuleTime, ModuleTimings
from shard_planner.trace.types import Affine
from shard_planner.plan.numerics import Numerics

MS = 1e-3
MB = 4  # micro-batch
LAYERS = 4
SLOW = "layers.2"
BLOCK_FWD_S, BLOCK_BWD_S = 8 * MS, 16 * MS  # the blocks' FLOP times at MB (see the docstring)
SLOW_FACTOR = 10
ROOT_OWN_FWD_S, ROOT_OWN_BWD_S = 1 * MS, 2 * MS  # the root's code outside every item
LOSS_FWD_S, LOSS_BWD_S = 0.3 * MS, 0.7 * MS


def _timings(trace) -> ModuleTimings:
    """Per item its FLOP time, except SLOW x SLOW_FACTOR; the root = items + its own code."""
    items = {"embed": (0.1 * MS, 0.2 * MS), "norm": (0.1 * MS, 0.1 * MS), "head": (2 * MS, 4 * MS)}
    for i in range(LAYERS):
        k = SLOW_FACTOR if f"layers.{i}" == SLOW else 1
        items[f"layers.{i}"] = (k * BLOCK_FWD_S, k * BLOCK_BWD_S)
    mods = {fqn: ModuleTime(Affine(f), Affine(b)) for fqn, (f, b) in items.items()}
    mods[""] = ModuleTime(Affine(sum(f for f, _ in items.values()) + ROOT_OWN_FWD_S),
                          Affine(sum(b for _, b in items.values()) + ROOT_OWN_BWD_S))
    return ModuleTimings(model_path=trace.model_path, fingerprint=trace.fingerprint, param_dtype="bfloat16",
                         device="cuda", device_name="test", threads_per_rank=1, world_size=8, micro_batches=(MB,),
                         date="2026-12-02 12:00 UTC", torch_version="2.13.0", modules=mods,
                         loss_fwd_s=Affine(LOSS_FWD_S), loss_bwd_s=Affine(LOSS_BWD_S), repeats=5)


@pytest.fixture(scope="module")
def models():
    trace = stack_trace(LAYERS)
    space = build_space(trace, shard_group=8, gpus_per_node=8, max_group_size=2)
    choice = GlobalChoice(MB, Prefetch(0, 1), Mesh(8))
    flops = profile()
    timed = flops.with_timings(_timings(trace))
    return (trace, space, build_linear_model(trace, space, choice, Training(MB), flops),
            build_linear_model(trace, space, choice, Training(MB), timed), timed)


def _single(space, fqn):
    """Candidate index by option, for the one-item segments covering ``fqn``."""
    i = next(k for k, it in enumerate(space.items) if it.fqn == fqn)
    return {c.option: k for k, c in enumerate(space.candidates) if (c.start, c.stop) == (i, i + 1)}


def test_the_blocks_flop_times_are_what_the_timings_assume(models):
    trace, _, _, _, _ = models
    assert module_compute_s(trace, "layers.1", MB, profile(), Numerics()) == pytest.approx((BLOCK_FWD_S, BLOCK_BWD_S))


def test_compute_coefficients_follow_the_timings(models):
    _, space, flops_lm, timed_lm, _ = models
    slow, fast = _single(space, SLOW), _single(space, "layers.1")
    assert slow.keys() == fast.keys() and any(o.activation_checkpoint for o in slow)
    extra_f, extra_b = (SLOW_FACTOR - 1) * BLOCK_FWD_S, (SLOW_FACTOR - 1) * BLOCK_BWD_S
    for option in slow:
        if option.in_root:
            continue
        # recomputation runs the (measured) forward again
        extra_s = extra_f + extra_b + (extra_f if option.activation_checkpoint else 0.0)
        diff_us = timed_lm.coeffs[slow[option]].time_us - timed_lm.coeffs[fast[option]].time_us
        assert diff_us == pytest.approx(extra_s * 1e6, abs=1), option
        # FLOPs see two identical blocks
        assert flops_lm.coeffs[slow[option]].time_us == flops_lm.coeffs[fast[option]].time_us, option
        # the fast block's timings equal its FLOP time: same coefficient either way
        assert timed_lm.coeffs[fast[option]].time_us == flops_lm.coeffs[fast[option]].time_us, option
        assert timed_lm.coeffs[fast[option]].stack_mib == flops_lm.coeffs[fast[option]].stack_mib  # memory unchanged


def test_constant_holds_the_roots_own_code_and_the_loss(models):
    trace, _, flops_lm, timed_lm, _ = models
    # without timings the root has no FLOPs of its own and the loss 1e6 x MB FLOPs (8 ns): only the
    # measured root's own code and the measured loss differ
    flop_loss_s = trace.loss_flops.at(MB) / profile().flops_per_s("bfloat16")
    expected_us = (ROOT_OWN_FWD_S + ROOT_OWN_BWD_S + LOSS_FWD_S + LOSS_BWD_S - flop_loss_s) * 1e6
    assert timed_lm.const_time_us - flops_lm.const_time_us == pytest.approx(expected_us, abs=1)


def test_checkpointing_lands_on_the_fast_blocks(models):
    """At a budget where some, not all, blocks must be checkpointed, the timed solver never checkpoints
    the slow block while a fast one is left uncheckpointed (swapping them frees the same memory and
    saves 9 x 8 ms of recomputation). End to end: the simulators, which see the timings, re-check
    every cover, so this holds with a FLOP-priced linear model too; the coefficients are tested above."""
    trace, _, _, _, timed = models
    # the search alone (allocator_check: this stack is measured in MiB, where the allocator's pages would decide)
    full = plan_model(trace, PlanRequest(gpus=8, mem_budget_bytes=80 * 2**30, profile=timed, micro_batch=MB,
                                         allocator_check=False)).plan
    assert not any(u.activation_checkpoint for u in full.units)
    # 0.85 of the full plan's peak: two of the four blocks must be checkpointed. (At 0.8, once a nested
    # unit's gradients count at its block's backward, three must be, and where the third goes depends on
    # its position in the stack, not only on its speed.)
    tight = plan_model(trace, PlanRequest(gpus=8, mem_budget_bytes=int(full.predicted.peak_bytes * 0.85),
                                          profile=timed, micro_batch=MB, allocator_check=False)).plan
    ac = {m for u in tight.units if u.activation_checkpoint for m in u.modules}
    blocks = {f"layers.{i}" for i in range(LAYERS)}
    assert ac & blocks and not blocks <= ac, ac
    assert SLOW not in ac
    # the plan's prediction is the timed simulator's
    assert tight.predicted.step_time_s == pytest.approx(simulate(trace, replace(tight, predicted=None), timed).time.step_time_s)
