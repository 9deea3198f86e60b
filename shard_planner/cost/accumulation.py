"""Gradient accumulation: the memory and time of one optimizer step made of several micro-steps.

A plan with ``training.accumulation_steps = n > 1`` runs n forward+backward micro-steps of
``micro_batch`` samples each, then one optimizer step (execute/worker.py; the global batch is
``micro_batch x n x world size``). Two policies change what happens between micro-steps (torch 2.13,
torch/distributed/fsdp/_fully_shard/_fully_shard.py and _fsdp_param_group.py ``post_backward``):

``gradient_sync``
  "every_micro_step": each micro-step reduce-scatters its gradients, as without accumulation; from
  the second micro-step on the 1/N output is added into the sharded gradient already there
  (``foreach_reduce``: ``sharded_param.grad._local_tensor += new_sharded_grad``) and freed.
  "last_micro_step": ``set_requires_gradient_sync(False)`` on every micro-step but the last. See
  [Note: Deferred gradient sync].

``keep_params_gathered``
  ``set_reshard_after_backward(False)`` on every micro-step but the last: a unit's post-backward does
  not reshard, so the next micro-step's forward finds every unit gathered (its pre-forward all-gather
  is a no-op: ``FSDPParamGroup.unshard`` returns when unsharded) and reshards after forward as the
  unit's ``reshard_after_forward`` says. Memory: every unit's unsharded parameters (param dtype) are
  live from the end of one backward until each unit's post-forward reshard in the next micro-step.
  Time: the forward all-gathers of micro-steps 2..n are saved (backward all-gathers stay).

[Note: Deferred gradient sync]
  With ``reduce_grads`` False a unit's post-backward skips the reduce-scatter and keeps its unsharded
  gradients: when the plan's reduce dtype differs from its param dtype, ``to_accumulated_grad_if_needed``
  casts them to the reduce dtype (``unsharded_accumulated_grad``; the param-dtype gradients are freed)
  and later micro-steps add their param-dtype gradients into it at the unit's post-backward
  (``accumulate_unsharded_grad_if_needed``). When the dtypes are equal (FSDP2 clamps the reduce dtype to
  None) the gradients stay in ``unsharded_param.grad`` and autograd adds the next micro-step's into them
  in place (``AccumulateGrad``), so a new gradient is live only during its block's backward. Either
  way every unit holds ``float numel x reduce-dtype bytes`` of unsharded gradients (its reduce-scatter
  input's size) from its first post-backward until the last micro-step's reduce-scatter copies them
  in: these are the "grads" the report's timeline shows growing in micro-step 1 and staying through
  micro-steps 2..n. The last micro-step reduce-scatters the accumulated gradients once. In the in-place
  case a held gradient that garbage from the micro-step before still references (cost/memory.py
  [Note: Measured peaks move by one activation]) makes ``AccumulateGrad`` add out of place, one
  parameter's gradient more for a moment: seen once in a dozen real runs of the fp32 configurations
  of tests/cost/test_accumulation_realrun.py (+64 KiB on both ranks); the simulator predicts the
  prompt case.

[Note: Held through the reduce-scatter]
  Without accumulation one gradient (the last autograd produced for the unit) stays referenced through
  the unit's reduce-scatter (cost/memory.py [Note: Reduce-scatter buffers]). When the last micro-step
  reduce-scatters accumulated reduce-dtype gradients, its param-dtype gradients are freed at the
  accumulation (measured: the live bytes drop by them before ``foreach_reduce``), and what stays through
  the collective is one parameter's accumulated gradient instead (measured with the storage tracker on
  tests/models/cost_mlp.py, bf16/fp32, world size 2, one and two parameters per unit: exactly one
  parameter's fp32 gradient more than the copy-in alone leaves).

Which micro-steps are simulated: the first, one middle one (standing for micro-steps 2..n-1, whose
start states are equal: the same held gradients and gathered parameters) and the last
(:func:`micro_steps`). Memory walks them in order, one rank's state carried across, and the peak is the
largest of any; time sums them, the middle one n-2 times, each micro-step ending with FSDP2's final
callback waiting for its reduce-scatters (``set_is_last_backward`` left True), plus one optimizer step.

The plan's ``predicted.step_time_s`` is one optimizer step (every micro-step and the optimizer), and
``samples_per_s`` = micro_batch x n x world size / step_time_s, so plans with and without accumulation
compare by throughput.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable

from shard_planner.cost.allocations import GRADS, ON_DEFAULT, ON_REDUCE_SCATTER
from shard_planner.cost.memory import _MemoryWalk
from shard_planner.cost.schedule import EventKind, Phase
from shard_planner.cost.types import MemoryEstimate, TimeEstimate
from shard_planner.cost.unit_bytes import UnitBytes
from shard_planner.dtypes import dtype_bytes
from shard_planner.plan import GRADIENT_SYNCS, Training

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MicroStep:
    """One simulated micro-step, standing for ``repeats`` equal ones."""

    number: int  # 1-based, of the optimizer step's n
    repeats: int
    sync: bool  # reduce-scatters its gradients
    gathered: bool  # starts with every unit's parameters gathered (the previous one kept them)
    keep: bool  # keeps parameters gathered after its backward
    last: bool  # the optimizer step follows


def micro_steps(training: Training) -> tuple[MicroStep, ...]:
    """The first, a middle one (n >= 3, standing for n - 2) and the last micro-step of ``training``."""
    n = training.accumulation_steps
    every = training.gradient_sync == GRADIENT_SYNCS[0]
    keep = training.keep_params_gathered
    if n == 1:
        return (MicroStep(1, 1, True, False, False, True),)
    first = MicroStep(1, 1, every, False, keep, False)
    middle = (MicroStep(2, n - 2, every, keep, keep, False),) if n > 2 else ()
    return (first, *middle, MicroStep(n, 1, True, keep, False, True))


def held_between_micro_steps_bytes(model: UnitBytes, training: Training) -> float:
    """What accumulation keeps on top of one step's memory, for the solver's linear model (an upper
    bound: all of it at every moment), of a model whose parameters as one unit's have the bytes
    ``model``: the unsharded gradients accumulated in the reduce dtype (deferred sync: the reduce-scatter
    input the walk accumulates into) and the unsharded parameters (kept gathered). 0 without
    accumulation."""
    if training.accumulation_steps == 1:
        return 0.0
    extra = 0.0
    if training.gradient_sync == "last_micro_step":
        extra += model.rs_input
    if training.keep_params_gathered:
        extra += model.unsharded
    return extra


# ---- memory ----
def simulate_accumulated_memory(trace, t, plan, profile, ub, schedule, acts, *, timeline: bool,
                                selective=None, accountants=()) -> MemoryEstimate:
    """Peak and timeline over the micro-steps of one optimizer step (cost/memory.py's walk, the
    module docstring's policies); the same arguments as ``simulate_memory_walk``."""
    walk = _AccumulationWalk(trace, t, plan, profile, ub, schedule, acts, timeline, accountants)
    if selective is not None:
        walk.stash = selective.stash
    return walk.run()


class _AccumulationWalk(_MemoryWalk):
    """cost/memory.py's walk, once per micro-step, with what the policies change: held gradients
    (``acc``), parameters kept gathered, sharded gradients accumulated in place."""

    def __init__(self, *args):
        super().__init__(*args)
        tr = self.plan.training
        self.steps = micro_steps(tr)
        self.n = tr.accumulation_steps
        numerics = tr.numerics
        self.converts = numerics.reduce_casts  # FSDP2's reduce dtype is not None
        # a reduce-scatter input element per unsharded gradient element (gradients as computed: plan/numerics.py)
        self.reduce_per_param_elem = dtype_bytes(numerics.reduce_scatter_dtype) / dtype_bytes(numerics.compute_dtype)
        self.acc = [0.0] * len(self.units)  # unsharded gradients held between micro-steps, per unit
        self.sharded_held = [False] * len(self.units)
        self.step = self.steps[0]
        # the micro-step of each mark kept in the timeline, and of the peak (the last micro-step in which
        # the totals' peak moved): read after each micro-step's walk, not at every mark (the hot path)
        self.step_of_marks: list[int] = []
        self.step_at_peak = 1

    def walk_step(self) -> None:
        events = self.schedule.events
        without_optimizer = tuple(e for e in events if e.kind is not EventKind.OPTIMIZER)
        for i, step in enumerate(self.steps):
            self.step = step
            if i:  # the previous micro-step's batch and activations are gone; a new batch comes in
                self.saved_sum, self.flow = 0.0, 0.0
                self.activation_level = self.batch_bytes
            peak_before = self.totals.peak_event
            marks_before = len(self.marks.marks) if self.timeline else 0
            self.walk(events if step.last else without_optimizer)
            if self.totals.peak_event is not peak_before:
                self.step_at_peak = step.number
            if self.timeline:
                self.step_of_marks += [step.number] * (len(self.marks.marks) - marks_before)

    def backward(self, ev) -> None:
        """Equal dtypes, gradients held: autograd adds the new gradients into them in place, so they are
        live only during the block's backward ([Note: Deferred gradient sync]). While it runs they are
        counted on top of its traced rise, as without accumulation: exact where the weight gradient meets
        the block's largest temporary (measured: cost_mlp's head), one activation high where that was freed
        first (its GELU blocks: +2.3% at micro-batch 64), never low."""
        blk = self.t.blocks[ev.block]
        held = not self.converts and self.acc[blk.unit]
        if not held:
            return super().backward(ev)
        owners = (blk.unit, *blk.nested)
        grads = [self.units[u].grad_bytes for u in owners]
        super().backward(ev)
        new = (self.acts.own_grads[ev.block] + self.acts.made_grads[ev.block],  # made in forward: added too
               *(self.ub[v].unsharded_grads for v in blk.nested))
        for u, g, size in zip(owners, grads, new):  # added into the held ones, then freed
            if size:
                self.out.on_free(GRADS, size, self.t.unit_names[u], ON_DEFAULT)
            self.units[u].grad_bytes = g

    def post_backward(self, ev) -> None:
        u = ev.unit
        x, st = self.ub[u], self.units[u]
        if not self.step.sync:
            return self.accumulate(ev)
        had_sharded = self.sharded_held[u]
        if self.acc[u]:  # the last micro-step reduce-scatters the accumulated gradients
            # this micro-step's param-dtype gradients are added into them and freed (converted; else
            # they were added in place already); then what is held through the collective is one
            # parameter's accumulated gradient, in the reduce dtype: [Note: Held through the reduce-scatter]
            self.out.on_free(GRADS, st.grad_bytes, self.t.unit_names[u], ON_DEFAULT)
            st.grad_bytes = self.acc[u]
            self.acc[u] = 0.0
            self.reduce_scatter(ev, x.last_grad * self.reduce_per_param_elem)
        else:
            super().post_backward(ev)
        if not self.offload_off_device:
            if had_sharded:  # the 1/N output was added into the sharded gradient and freed
                self.out.on_free(GRADS, x.sharded_grad, self.t.unit_names[u], ON_REDUCE_SCATTER)
            self.sharded_held[u] = True

    def accumulate(self, ev) -> None:
        """Post-backward without gradient sync: reshard (unless kept gathered) and hold the gradients."""
        u, out = ev.unit, self.out
        x, st = self.ub[u], self.units[u]
        name = self.t.unit_names[u]
        self.reshard_after_backward(ev)  # unless kept gathered between micro-steps
        new = st.grad_bytes
        st.grad_bytes = 0.0
        if not self.converts:  # the gradients stay as they are (unsharded_param.grad)
            self.acc[u] += new
            return
        if not self.acc[u]:  # the first: a reduce-dtype copy, the param-dtype gradients then freed
            out.on_alloc(GRADS, x.rs_input, name, ON_DEFAULT)
            self.acc[u] = x.rs_input
            self.record("hold gradients", name, Phase.BACKWARD)
        out.on_free(GRADS, new, name, ON_DEFAULT)

    def reshards_after_backward(self) -> bool:
        return not self.step.keep

    def optimizer(self, ev) -> None:
        super().optimizer(ev)
        self.sharded_held = [False] * len(self.units)

    def result(self) -> MemoryEstimate:
        est = super().result()
        n = self.n

        def label(text: str, number: int) -> str:
            return f"micro-step {number}/{n} {text}"
        timeline = tuple(replace(e, label=label(e.label, k)) for e, k in zip(est.timeline, self.step_of_marks))
        return replace(est, peak_event=label(est.peak_event, self.step_at_peak), timeline=timeline)


# ---- time ----
def accumulated_time(training: Training, walk: Callable[[tuple], TimeEstimate], collectives: tuple,
                     tokens_per_sample: int | None, dp_size: int) -> TimeEstimate:
    """One optimizer step: each simulated micro-step's time (``walk(collectives)``: cost/time.py's
    simulation of one step, its optimizer step taken off) times the micro-steps it stands for, plus one
    optimizer step. A micro-step whose parameters are still gathered has no forward all-gathers; one
    without gradient sync has no reduce-scatters (the module docstring)."""
    ag_fwd, ag_bwd, rs = collectives
    none = (0.0,) * len(ag_fwd)
    # a micro-step's walk reads only its collectives, which its (gathered, sync) decide: micro-steps
    # that agree on both (all of them with every_micro_step and no kept parameters) are walked once
    walked: dict[tuple[bool, bool], TimeEstimate] = {}
    for s in micro_steps(training):
        if (s.gathered, s.sync) not in walked:
            walked[s.gathered, s.sync] = walk((none if s.gathered else ag_fwd, ag_bwd, rs if s.sync else none))
    parts = [(s.repeats, walked[s.gathered, s.sync]) for s in micro_steps(training)]
    optimizer_s = parts[-1][1].optimizer_s
    step_s = sum(k * (e.step_time_s - e.optimizer_s) for k, e in parts) + optimizer_s
    compute_s = sum(k * e.compute_s for k, e in parts)
    samples = training.micro_batch * training.accumulation_steps * dp_size
    units = tuple(
        replace(us[0][1], **{f: sum(k * getattr(u, f) for k, u in us) for f in (
            "fwd_compute_s", "bwd_compute_s", "all_gather_s", "reduce_scatter_s", "exposed_comm_s", "copies_s",
            "slowdown_s", "tp_s")})
        for us in zip(*[[(k, u) for u in e.units] for k, e in parts]))
    return TimeEstimate(
        step_time_s=step_s, compute_s=compute_s, comm_s=sum(k * e.comm_s for k, e in parts),
        exposed_comm_s=max(0.0, step_s - compute_s - optimizer_s), optimizer_s=optimizer_s,
        samples_per_s=samples / step_s if step_s > 0 else 0.0,
        tokens_per_s=samples * tokens_per_sample / step_s if tokens_per_sample and step_s > 0 else None,
        # each micro-step's model FLOPs are its mfu x its step time x peak: summed, over the whole step
        mfu=sum(k * e.mfu * e.step_time_s for k, e in parts) / step_s if step_s > 0 else 0.0,
        units=units, tp_comm_s=sum(k * e.tp_comm_s for k, e in parts),
    )
