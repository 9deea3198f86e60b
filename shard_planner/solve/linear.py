"""The solver's linear model: per candidate unit, integer memory terms (MiB) and a time term (µs).

The cost model (:mod:`shard_planner.cost`) simulates a plan event by event; the solver needs the same
quantities as *coefficients* of a linear program. This module computes them once per global choice
(micro-batch, prefetch depths, mesh, offload) from the trace and the profile. The program itself, and
how these terms combine into the peak, is stated in :mod:`shard_planner.solve.cpsat`;
:func:`evaluate` computes the same peak and time for one assignment directly, and is what the DP, the
brute force and the tests compare against.

Memory per rank (bytes, then MiB rounded *up* so the linear model never under-counts by rounding):

- ``base``: the profile's fixed overhead, sharded state (ZeRO §5: params + grads + optimizer states,
  each ``/ shard``), parameters no item owns (the root unit's own: gathered once, kept — FSDP2 does
  not reshard the root), activations saved outside every item, the batch, the loss' saved tensors.
- per candidate ``c`` (a run of items with one option), following the FSDP2 schedule the cost model
  simulates (:mod:`shard_planner.cost.memory`, its notes cited by name):
  ``stack``  — what stays live from its forward until its backward: saved activations (checkpointed:
  only each module's inputs, Korthikanti et al. 2022 §4 "full recomputation keeps the layer input";
  selective: the inputs and the outputs of the stored op classes, cost/selective.py),
  plus unsharded parameters it keeps (reshard False: all of them; int ``r``: ``1/r`` of them);
  ``fwd``    — its own rise while it computes forward: its parameters twice (the all-gather output
  stays until the next unit's copy-out, [Note: All-gather buffers]) and the largest traced
  ``fwd_peak_rise_bytes`` of its modules above what it has already saved;
  ``copy``   — its own rise at its copy-out: the parameters twice (the previous unit's output adds
  ``prev_out`` of that unit);
  ``bwd``    — its own rise while it computes backward: gathered parameters, unsharded gradients in the
  param dtype, its saved activations (re-materialised when checkpointed, one module at a time) and
  the traced ``bwd_peak_rise_bytes`` (the next unit's reduce-scatter input ``rs_in`` is still live,
  [Note: Reduce-scatter buffers]);
  ``rs``     — its own rise at its reduce-scatter: the input in the reduce dtype and the 1/N output;
  ``gather`` — the all-gather output a neighbour's prefetch adds ([Note: Prefetch holds all-gather
  outputs]); ``regather`` — the same in backward (0 when it kept its parameters).

Time per candidate (seconds, then µs rounded): forward and backward compute of its items
(:func:`shard_planner.cost.module_compute_s`: the items' measured times when the profile has module
timings, else traced FLOPs at the profile's achievable FLOP/s), recomputation when checkpointed (its
forward again, less the early stop's tail: the simulator recomputes with the measured forward too;
selective: the share of it the non-stored ops take), FSDP2's copies on the compute stream (a copy-out per all-gather and the
reduce-scatter copy-in, cost/fsdp_copies.py, as the simulator prices them), and *exposed*
communication, linearised per unit as ``max(0, comm - overlap x compute)``: the all-gathers and
reduce-scatters of a unit hide behind compute of the neighbouring units; the unit's own compute stands
in for its neighbours' (exact for uniform stacks of blocks), and the prefetch depth sets how many
neighbours (``overlap = max(1, depth)``, cost/fsdp2_rules.py ``effective_prefetch_depth``: FSDP2's
implicit prefetch overlaps one unit even at depth 0; on a CPU profile nothing overlaps). The linear
model has no per-op or per-unit framework overhead (only the simulators price it, cost/time.py), so
measured times, which hold the per-op framework time already, are not counted twice. Collectives use the ring model ``alpha (p-1) + (p-1)/p x bytes / busbw`` (nccl-tests' bus bandwidth, DESIGN.md "Time model").
The constant part (loss, modules outside items, optimizer step) does not change the argmin but is
added so the linear step time is comparable with the simulator's.

How it compares with the simulators (what tests/test_linear_vs_simulators.py asserts for every plan
of its corpus: the solver's and the cost tests' traces, examples/gpt2.py tiny, four profiles, FSDP
and HSDP meshes, prefetch 0-2, micro-batch 1 and 4, AdamW and SGD, with and without CPU offload;
measured over 10,240 random covers of ten traces when this was written, the extremes in brackets).
With ``sim_peak`` the simulated peak bytes and ``sim_s`` the simulated step time:

- peak: ``peak_mib * MiB >= (1 - PEAK_UNDER_COUNT) * sim_peak`` with ``PEAK_UNDER_COUNT`` 0.03 [0.023]
  without CPU offload (or on a CPU profile) and 0.06 [0.051] with CPU offload on a GPU profile; and
  ``peak_mib * MiB <= PEAK_OVER_FACTOR * sim_peak + PEAK_OVER_SLACK_MIB * MiB`` (2x + 16 MiB
  [1.81x on peaks over 256 MiB; +12.6 MiB on tiny models, from rounding every term up to a MiB]). It
  is neither a bound nor exact: it over-counts by taking each unit's worst moment at once (both
  copies of the parameters in forward, all gradients and both reduce-scatter buffers at once), and
  under-counts where the simulator has terms it has not: under CPU offload on a GPU, the host-to-device
  copy of each unit's fp32 shard before its all-gather ([Note: CPU offload]); otherwise at events the
  linear model has no term for, where neighbouring units' buffers meet (found on the corpus): a
  unit's backward copy-out (its all-gather output and its parameters live together, beside the
  neighbours' buffers; ``bwd`` counts the parameters once), a reduce-scatter beside a prefetched
  all-gather, and the backward of the root's own modules.
- time: ``TIME_RATIO[0] * sim_s <= time_us / 1e6 <= TIME_RATIO[1] * sim_s`` with TIME_RATIO = (0.45,
  1.25) [0.505, 1.20], ``sim_s`` priced by a profile whose framework overheads (``per_op_overhead_s``,
  ``per_unit_overhead_s``, ``per_param_tensor_optimizer_overhead_s``) are 0: the linear model has
  none of them, so against the full simulator only the upper bound holds (their step time on tiny
  models is mostly overhead: as low as 0.01 x). Below 1: the linearised overlap ``max(0, comm -
  overlap x compute)`` hides more communication than the two-stream simulation can (the first and
  last units, uneven neighbours); above: the tie-break and rounding to µs, and exposed time the
  simulation hides behind neighbours' compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from shard_planner.cost.accumulation import held_between_micro_steps_bytes
from shard_planner.cost.collectives import ring_bandwidth_s
from shard_planner.plan.checkpointing import is_selective
from shard_planner.cost.model import CostModel
from shard_planner.cost.queries import UnitSetting
from shard_planner.cost import fsdp2_rules  # called through the module: a test changes a rule, every caller follows
from shard_planner.cost.reshard import ReshardAfterForward
from shard_planner.cost import optimizer as optimizer_rules
from shard_planner.cost.tables import largest_module_float_bytes
from shard_planner.cost.unit_bytes import UnitBytes, reduce_scatter_backend_temp_bytes
from shard_planner.cost.unit_cost import UnitCost
from shard_planner.cost.unit_params import UnitParams
from shard_planner.dtypes import DTYPE_BYTES
from shard_planner.plan import Training
from shard_planner.hardware.profile import HardwareProfile
from shard_planner.solve.choice import GlobalChoice
from shard_planner.solve.candidate_costs import CandidateCosts, candidate_costs
from shard_planner.solve.item_terms import ItemTerms, item_terms
from shard_planner.solve.space import Candidate, SearchSpace
from shard_planner.trace.types import ModelTrace

MIB = 2**20
TIE_BREAK_S_PER_COLLECTIVE = 1e-6  # 1 µs: the smallest step of the objective's integer scale
US_PER_S = 1_000_000
# What the linear model promises against the simulators (module docstring; tests/test_linear_vs_simulators.py).
PEAK_UNDER_COUNT = 0.03  # at most this fraction below the simulated peak (no CPU offload, or a CPU profile)
PEAK_UNDER_COUNT_OFFLOAD = 0.06  # the same with CPU offload on a GPU profile
PEAK_OVER_FACTOR, PEAK_OVER_SLACK_MIB = 2.0, 16  # at most 2x the simulated peak + 16 MiB
TIME_RATIO = (0.45, 1.25)  # linear / simulated step time, the simulator's framework overheads set to 0


@dataclass(frozen=True)
class Coeffs:
    """Integer terms of one candidate (MiB, µs); see the module docstring."""

    stack_mib: int
    fwd_mib: int
    copy_mib: int
    bwd_mib: int
    rs_mib: int
    gather_mib: int
    prev_out_mib: int
    regather_mib: int
    rs_in_mib: int
    root_mib: int  # parameters (and their gradients) added to the root unit when the option is "in root"
    uses_int_reshard: bool
    time_us: int
    # the compute in time_us, seconds: forward, backward, recomputation (:func:`with_prefetch` prices the
    # rest again from it); not compared: the integer terms are the program's
    compute_s: tuple[float, float, float] = field(default=(0.0, 0.0, 0.0), compare=False)


@dataclass(frozen=True)
class LinearModel:
    space: SearchSpace
    choice: GlobalChoice
    coeffs: tuple[Coeffs, ...]  # parallel to space.candidates
    base_mib: int
    loss_mib: int  # transient of the loss, on top of every saved activation
    optimizer_mib: int  # the optimizer step: overhead + sharded state + the foreach temporary (a constant)
    process_group_mib: int  # one extra process group when any unit reshards to an int
    const_time_us: int
    model_bytes: UnitBytes  # the whole model's parameters as one unit's (cost/unit_bytes.py)

    @property
    def forward_depth(self) -> int:
        return self.choice.prefetch.forward

    @property
    def backward_depth(self) -> int:
        # FSDP2 always prefetches one unit in backward (cost/fsdp2_rules.py [Note: Prefetch depth and
        # targets]).
        return fsdp2_rules.effective_prefetch_depth(self.choice.prefetch.backward)


@dataclass(frozen=True)
class LinearResult:
    peak_mib: int
    time_us: int


def _mib(nbytes: float) -> int:
    return max(0, math.ceil(nbytes / MIB))


def _us(seconds: float) -> int:
    return max(0, round(seconds * US_PER_S))


def unit_setting(choice: GlobalChoice, training: Training) -> UnitSetting:
    """What ``choice``'s units share, as the per-unit cost reads it (cost/queries.py), priced by the choice's
    engine (cost/engines/ [Note: What an engine owns]). The program's structure is FSDP2's decisions (its
    units, reshard after forward, prefetch); the single-device engine's unit costs have no gathered copies,
    collectives or copies, so its terms for them are zero and the program chooses checkpointing alone (its
    space offers one reshard option: solve/space.py)."""
    return UnitSetting(choice.mesh, training.numerics, training.optimizer, choice.cpu_offload, choice.engine)


def build_linear_model(trace: ModelTrace, space: SearchSpace, choice: GlobalChoice, training: Training,
                       profile: HardwareProfile, cost_model: CostModel | None = None,
                       costs: CandidateCosts | None = None) -> LinearModel:
    """The coefficients for one global choice. ``cost_model``: the CostModel of ``trace`` on ``profile``
    (module compute times, subtree sums); None: a new one. ``costs``: the candidates' unit costs under the
    choice's setting (solve/candidate_costs.py: shared by the choices that differ only in micro-batch,
    prefetch or accumulation); None: priced here."""
    cm = cost_model if cost_model is not None else CostModel(trace, profile)
    # time as the choice's ranks see the profile (CPU ranks sharing cores: cost/host_share.py); the
    # byte figures the memory rows read are the same on it
    cm = cm.for_world(choice.mesh.world_size)
    profile = cm.profile
    setting = unit_setting(choice, training)
    if costs is None:
        costs = candidate_costs(trace, space, setting, profile)
    elif not costs.matches(space, setting, profile):
        raise ValueError(f"{choice.label}: the candidate costs given are of another space, setting or profile")
    b = choice.micro_batch
    shard = choice.mesh.shard_group_size
    numerics = training.numerics  # the plan's dtypes (plan/numerics.py)
    act_elem = DTYPE_BYTES[numerics.activation_dtype]
    act_scale = act_elem / DTYPE_BYTES.get(trace.compute_dtype, act_elem)  # activations in their dtype, traced in the trace's

    # ---- per item, in bytes / FLOPs at micro-batch b (solve/item_terms.py) ----
    per_item = item_terms(cm, trace, space, b, numerics, act_scale)
    saved, fwd_s, bwd_s = per_item.saved, per_item.fwd_s, per_item.bwd_s
    shared = _choice_terms(space, choice, costs)
    coeffs = [_candidate_coeffs(k, c, per_item, shared) for k, c in enumerate(space.candidates)]

    # ---- constants ----
    # The whole model as one unit's parameters gives the sharded state (ZeRO §5, stage 3: params +
    # grads in their built dtype + optimizer states, / shard; on the host under CPU offload) and the
    # step's temporaries by the simulators' rules (cost/unit_cost.py, cost/optimizer.py); the root's own
    # parameters (no item owns them) are gathered once and kept, with their gradients and reduce-scatter
    # input, all step.
    model_params, model, root = costs.model_params, costs.model, costs.root
    item_saved_total = sum(saved)
    all_saved = cm.subtree_sum("", "saved_bytes_self").at(b) * act_scale
    outside_saved = max(0.0, all_saved - item_saved_total)
    base = (profile.reserved_bytes + model.sharded_state_bytes + _held_all_step_bytes(root.bytes)
            + outside_saved + trace.batch_input_bytes.at(b) + trace.loss_saved_bytes.at(b) * act_scale)
    loss = trace.loss_peak_rise_bytes.at(b) * act_scale
    opt_temp = optimizer_rules.optimizer_temporaries_bytes(
        training.optimizer, profile.device, model.bytes.sharded_grad, largest_module_float_bytes(trace),
        shard) if model.state_on_device else 0.0
    optimizer = profile.reserved_bytes + model.sharded_state_bytes + opt_temp

    const_s = _constant_time_s(cm, fwd_s, bwd_s, choice, training, model_params, model, root)
    return with_accumulation(LinearModel(
        space=space, choice=choice, coeffs=tuple(coeffs), base_mib=_mib(base), loss_mib=_mib(loss), optimizer_mib=_mib(optimizer),
        process_group_mib=_mib(profile.per_process_group_bytes), const_time_us=_us(const_s), model_bytes=model.bytes,
    ), choice, training)


def with_prefetch(lm: LinearModel, choice: GlobalChoice, costs: CandidateCosts) -> LinearModel:
    """``lm`` (built for ``choice`` at other prefetch depths; ``costs`` its candidates' unit costs) for
    ``choice``: the depths change only the overlap windows of the time terms (the program reads its
    prefetch terms from ``choice``), so only ``time_us`` is priced again, from each candidate's compute
    (``Coeffs.compute_s``) by the same rule as :func:`build_linear_model`'s."""
    if (replace(lm.choice, prefetch=choice.prefetch) != choice or costs.space is not lm.space
            or (costs.setting.mesh, costs.setting.cpu_offload) != (choice.mesh, choice.cpu_offload)):
        raise ValueError(f"{choice.label}: not {lm.choice.label} at other prefetch depths, or other candidate costs")
    ch = _choice_terms(lm.space, choice, costs)
    if (ch.d_f, ch.d_b) == _overlap_windows(lm.choice):
        return replace(lm, choice=choice)  # the same overlap windows (depth 0 overlaps one unit too): the same terms
    coeffs = tuple(replace(co, time_us=_time_us(k, c, co.compute_s, ch))
                   for k, (c, co) in enumerate(zip(lm.space.candidates, lm.coeffs)))
    return replace(lm, choice=choice, coeffs=coeffs)


def with_accumulation(lm: LinearModel, choice: GlobalChoice, training: Training) -> LinearModel:
    """``lm`` (built for ``choice`` without accumulation, or with the same micro-batch) for ``choice``:
    gradient accumulation adds what it holds between micro-steps to ``base`` at every moment of the
    step (an upper bound: cost/accumulation.py ``held_between_micro_steps_bytes``); the rest of a
    micro-step is one step's. The program's time stays one micro-step's: the simulators price the
    accumulated step and rank the plans."""
    held = held_between_micro_steps_bytes(lm.model_bytes, choice.training(training))
    return replace(lm, choice=choice, base_mib=lm.base_mib + _mib(held))


def _constant_time_s(cm: CostModel, fwd_s, bwd_s, choice: GlobalChoice, training: Training,
                     model_params: UnitParams, model: UnitCost, root: UnitCost) -> float:
    """The step time no candidate changes: compute outside every item, the root's collectives, the
    optimizer step and, under CPU offload, the host-device copies. ``model_params``: every parameter of
    the model, and ``model`` their cost as one unit's; ``root``: the cost of the root's own parameters
    (no item owns them)."""
    b = choice.micro_batch
    # compute outside every item: the root's subtree less the items', and the loss (the root's measured
    # time does not hold the loss: timings.py times loss_fn outside every module)
    root_f, root_b = cm.module_compute_s("", b, training.numerics)
    loss_f, loss_b = cm.module_compute_s(None, b, training.numerics)
    outside_s = max(0.0, root_f + root_b - sum(fwd_s) - sum(bwd_s)) + loss_f + loss_b
    # the root's all-gather at the start and its reduce-scatter (+ HSDP all-reduce) at the end; FSDP2
    # does not reshard the root (None): the per-unit rule (cost/unit_cost.py)
    rc = root.collectives
    root_comm = rc.all_gather_fwd_s + rc.reduce_scatter_s + rc.replica_all_reduce_s
    # the step is memory-bound, on the host under offload (cost/optimizer.py)
    const_s = outside_s + root_comm + optimizer_rules.model_step_s(
        training.optimizer, model_params, choice.mesh.shard_group_size, cm.profile, choice.cpu_offload,
        training.numerics)
    if choice.cpu_offload:
        # every parameter's shard to the device before its all-gather and its gradient back, once per
        # step (PCIe, profile): the whole model's host copies as one unit's (cost/unit_collectives.py)
        const_s += model.collectives.copy_in_fwd_s + model.collectives.copy_back_s
    return const_s


def _held_all_step_bytes(x: UnitBytes) -> float:
    """A unit that is gathered once and kept all step (the root; a candidate "in root"): its unsharded
    parameters, their gradients and its reduce-scatter input, live at every moment of the step."""
    return x.unsharded + x.unsharded_grads + x.rs_input


def _choice_terms(space: SearchSpace, choice: GlobalChoice, costs: CandidateCosts) -> _ChoiceTerms:
    """What every candidate of ``choice`` shares (``costs``: under its setting, on the profile as its
    ranks see it)."""
    # Overlap windows in units of the unit's own compute: FSDP2's implicit prefetch (the CPU runs
    # ahead) already overlaps one unit in forward when the explicit depth is 0, and backward always
    # prefetches one (DESIGN.md "FSDP2 facts"; cost/time.py models the same).
    leading = next((i for i, it in enumerate(space.items) if not it.may_join_root), len(space.items))
    d_f, d_b = _overlap_windows(choice)
    return _ChoiceTerms(setting=costs.setting, costs=costs, profile=costs.profile, d_f=d_f, d_b=d_b,
                        overlap=costs.profile.device != "cpu", leading_root_items=leading)


def _overlap_windows(choice: GlobalChoice) -> tuple[int, int]:
    """(forward, backward) units of compute a unit's collectives may hide behind at ``choice``'s prefetch
    depths: FSDP2's effective depths (cost/fsdp2_rules.py ``effective_prefetch_depth``)."""
    depth = fsdp2_rules.effective_prefetch_depth
    return depth(choice.prefetch.forward), depth(choice.prefetch.backward)


@dataclass(frozen=True)
class _ChoiceTerms:
    """What every candidate of one global choice shares: the units' setting (mesh, dtypes, optimizer,
    offload) and the candidates' unit costs under it, the profile (as the choice's ranks see it), the overlap windows
    in units of a unit's compute (``d_f``, ``d_b``; ``overlap`` False on a CPU profile) and how many
    leading items may join the root."""

    setting: UnitSetting
    costs: CandidateCosts
    profile: HardwareProfile
    d_f: int
    d_b: int
    overlap: bool
    leading_root_items: int


def _live(parts: tuple[UnitCost, ...], field: str) -> float:
    """Of one byte field of a candidate's units, what is live at once: the outer unit's and, nested, one
    inner unit's at a time (the largest)."""
    return getattr(parts[0].bytes, field) + max((getattr(p.bytes, field) for p in parts[1:]), default=0.0)


def _candidate_coeffs(index: int, c: Candidate, items: ItemTerms, ch: _ChoiceTerms) -> Coeffs:
    """The terms of candidate ``index`` (``c``) of the space."""
    saved, inputs, fwd_rise, bwd_rise, sac = items.saved, items.inputs, items.fwd_rise, items.bwd_rise, items.sac
    fwd_s, bwd_s = items.fwd_s, items.bwd_s
    profile, shard = ch.profile, ch.setting.mesh.shard_group_size
    o = c.option
    idx = range(c.start, c.stop)
    # each FSDP unit the candidate makes (one, or nested: the outer and one per inner unit) by the
    # simulators' per-unit query (cost/unit_cost.py), and all of them as one (solve/candidate_costs.py)
    parts, whole = ch.costs.parts[index], ch.costs.whole[index]
    gather = whole.bytes.unsharded
    gather_live = _live(parts, "unsharded")

    # activations: cumulative saved within the run; checkpointed modules keep their inputs only
    selective = is_selective(o.activation_checkpoint)  # keeps its inputs and the stash (cost/selective.py)
    kept_act = [inputs[i] + (sac[0][i] if selective else 0.0) if o.activation_checkpoint else saved[i] for i in idx]
    act_stack = sum(kept_act)
    fwd_act, cum = 0.0, 0.0
    for k, i in enumerate(idx):
        fwd_act = max(fwd_act, cum + fwd_rise[i])
        cum += kept_act[k]
    if o.activation_checkpoint:
        bwd_act = act_stack + max(saved[i] + bwd_rise[i] for i in idx)
    else:
        bwd_act = act_stack + max(bwd_rise[i] for i in idx)

    r = ReshardAfterForward.of(o.reshard_after_forward, shard)  # cost/reshard.py
    if o.in_root:  # the root's parameters and gradients live all step: in ``root`` (see [Note: The root's gradients])
        kept_params, regather, root_bytes = 0.0, 0.0, _held_all_step_bytes(whole.bytes)
        fwd_mem, copy_mem, bwd_mem, rs_mem, next_gather, rs_in = fwd_act, 0.0, bwd_act, 0.0, 0.0, 0.0
    else:
        kept_params = r.kept_after_forward_bytes(gather)
        regather = gather_live if r.reshards else 0.0
        root_bytes = 0.0
        fwd_mem = 2 * gather_live + fwd_act
        copy_mem = 2 * gather_live
        # every nested unit's gradients are live at the block's backward (cost/memory.py [Note: Nested
        # units' gradients]): all of them, not one inner unit's
        bwd_mem = gather_live + whole.bytes.unsharded_grads + bwd_act
        rs_in = _live(parts, "rs_input")
        # the copy-in holds the unit's unsharded gradients and the flat input together; then the 1/N
        # output and the backend's copy of the input (gloo) join, the gradients freed but the last one:
        # bounded by all of them (cost/memory.py [Note: Reduce-scatter buffers])
        rs_mem = (_live(parts, "unsharded_grads") + rs_in + fsdp2_rules.shard_bytes(rs_in, shard)
                  + reduce_scatter_backend_temp_bytes(rs_in, profile, shard))
        next_gather = gather_live

    # ---- time ----
    cf = sum(fwd_s[i] for i in idx)
    cb = sum(bwd_s[i] for i in idx)
    rc = 0.0
    if o.activation_checkpoint:  # selective: the stored ops' share is not recomputed
        # full: the early stop's tail is not recomputed (trace/capture.py [Note: Early stop of the
        # recomputation]); a nested unit's own block is priced whole, as the simulator does
        rc = sum(fwd_s[i] * (1.0 - (sac[1][i] if selective else 0.0 if o.nested else sac[2][i])) for i in idx)
    return Coeffs(
        stack_mib=_mib(act_stack + kept_params), fwd_mib=_mib(fwd_mem), copy_mib=_mib(copy_mem), bwd_mib=_mib(bwd_mem),
        rs_mib=_mib(rs_mem), gather_mib=_mib(next_gather), prev_out_mib=_mib(next_gather),
        regather_mib=_mib(regather), rs_in_mib=_mib(rs_in), root_mib=_mib(root_bytes),
        uses_int_reshard=not o.in_root and r.to_group, time_us=_time_us(index, c, (cf, cb, rc), ch),
        compute_s=(cf, cb, rc),
    )


def _time_us(k: int, c: Candidate, compute_s: tuple[float, float, float], ch: _ChoiceTerms) -> int:
    """Candidate ``k``'s (``c``) time term: its compute (``compute_s``: forward, backward, recomputation)
    and what of its communication and FSDP2's copies the compute does not hide."""
    cf, cb, rc = compute_s
    whole = ch.costs.whole[k]
    exposed = _exposed_comm_s(c, ch.costs.parts[k], whole, cf, cb + rc, ch)
    # FSDP2's copies on the compute stream: a copy-out per all-gather and the reduce-scatter copy-in
    r = ReshardAfterForward.of(c.option.reshard_after_forward, ch.setting.mesh.shard_group_size)
    # (cost/fsdp2_rules.py: the all-gathers of its reshard policy; a unit in the root is gathered once)
    gathers = 1 if c.option.in_root else fsdp2_rules.all_gathers_per_step(r, ch.setting.mesh.shard_group_size)
    exposed += gathers * whole.copy_out_s + whole.copy_in_s
    return _us(cf + cb + rc + exposed)


def _exposed_comm_s(c: Candidate, parts: tuple[UnitCost, ...], whole: UnitCost, fwd_s: float, bwd_s: float,
                    ch: _ChoiceTerms) -> float:
    """Communication of one candidate the compute does not hide (module docstring, "Time per
    candidate"): ``parts`` are the costs of its units (one, or the outer and each inner unit when
    nested), ``whole`` of all of them as one; ``fwd_s``, ``bwd_s`` its compute (backward with
    recomputation)."""
    profile, shard = ch.profile, ch.setting.mesh.shard_group_size
    d_f, d_b, overlap, leading_root_items = ch.d_f, ch.d_b, ch.overlap, ch.leading_root_items
    o, r = c.option, ReshardAfterForward.of(c.option.reshard_after_forward, shard)
    # each unit's collectives: the simulators' per-unit rule (cost/unit_collectives.py, through
    # cost/unit_cost.py); the host copies of CPU offload are the constant's (``_constant_time_s``)
    per_unit = [p.collectives for p in parts]
    ar = sum(u.replica_all_reduce_s for u in per_unit)  # HSDP; 0 without
    if o.in_root:
        mesh = ch.setting.mesh
        ag_f = ring_bandwidth_s(profile, whole.bytes.unsharded, mesh)  # joins the root's all-gather: no extra latency
        rs = ring_bandwidth_s(profile, whole.bytes.rs_input, mesh)
        exposed = ag_f + rs + ar  # at the very start and the very end of the step: nothing to hide behind
    else:
        ag_f = sum(u.all_gather_fwd_s for u in per_unit)
        ag_b = sum(u.all_gather_bwd_s for u in per_unit)  # 0 when it keeps its parameters
        rs = sum(u.reduce_scatter_s for u in per_unit)
        if not overlap:  # gloo on CPU: collectives run on the thread that computes
            exposed = ag_f + ag_b + rs + ar
        elif c.start <= leading_root_items:
            # the first unit (only one-off modules before it, which may join the root): its forward
            # all-gather follows the root's with no compute before it to hide behind, and its
            # reduce-scatter is the last one of backward (cost/time.py simulates the same)
            exposed = ag_f + max(0.0, ag_b - d_b * bwd_s) + rs + ar
        else:
            exposed = max(0.0, ag_f - d_f * fwd_s) + max(0.0, ag_b + rs + ar - d_b * bwd_s)
        # Tie-break: among covers the model finds equally fast, prefer fewer collectives (each costs a
        # launch and a synchronisation that the ring model does not see; FSDP paper §3.2: finer units
        # cost throughput through more, smaller collectives): per unit, its reshard policy's (cost/fsdp2_rules.py).
        exposed += TIE_BREAK_S_PER_COLLECTIVE * len(parts) * len(fsdp2_rules.unit_collectives_of(r, shard))
    return exposed


def evaluate(lm: LinearModel, chosen: list[int] | tuple[int, ...]) -> LinearResult:
    """Peak (MiB) and step time (µs) of one exact cover under the linear model, computed directly:
    the same quantities the CP-SAT program and the DP constrain (see :mod:`.cpsat`)."""
    cands = lm.space.candidates
    seq = sorted(chosen, key=lambda k: cands[k].start)
    pos = 0
    for k in seq:
        if cands[k].start != pos:
            raise ValueError(f"candidates {seq} do not cover the items exactly")
        pos = cands[k].stop
    if pos != lm.space.n:
        raise ValueError(f"candidates {seq} do not cover the items exactly")
    co = [lm.coeffs[k] for k in seq]
    shared = lm.base_mib + sum(c.root_mib for c in co) + (lm.process_group_mib if any(c.uses_int_reshard for c in co) else 0)
    gmax = max((c.gather_mib for c in co), default=0)
    extra_f = max(0, lm.forward_depth - 1) * gmax
    extra_b = (lm.backward_depth - 1) * gmax
    peak = max(lm.optimizer_mib, shared + lm.loss_mib + sum(c.stack_mib for c in co))
    stack = 0
    for j, c in enumerate(co):
        nxt = co[j + 1] if j + 1 < len(co) else None
        prev = co[j - 1] if j > 0 else None
        base = shared + stack
        fwd = base + c.fwd_mib + extra_f + (nxt.gather_mib if nxt and lm.forward_depth >= 1 else 0)
        copy = base + c.copy_mib + extra_f + (prev.prev_out_mib if prev else 0)
        regather = prev.regather_mib if prev else 0
        bwd = base + c.bwd_mib + regather + extra_b + (nxt.rs_in_mib if nxt else 0)
        rs = base + c.rs_mib + regather + extra_b
        peak = max(peak, fwd, copy, bwd, rs)
        stack += c.stack_mib
    return LinearResult(peak_mib=peak, time_us=lm.const_time_us + sum(c.time_us for c in co))
