"""Per-rank memory of one FSDP2 training step, simulated event by event.

``simulate_memory(trace, plan, profile)`` (or ``CostModel.memory(plan)``) walks the step's event
sequence (shard_planner/cost/schedule.py: forward, loss, backward and the optimizer step of one rank
as FSDP2, torch 2.13, runs them), tracks each unit's sharding state (cost/unit_state.py) and emits every
allocation and free with its kind, owner and CUDA stream to accountants (cost/allocations.py): the
category totals (``plan.MEMORY_CATEGORIES``) with their peak and the timeline are two of them.

Model state (ZeRO, Rajbhandari et al. SC'20, §5). ZeRO-3 with mixed-precision Adam holds
``(2 + 2 + K)Ψ / N`` bytes per rank with K = 12: 16-bit parameters (2), 16-bit gradients (2), and fp32
master parameters, momentum and variance (12). FSDP2 realises the same 16Ψ/N with a different split —
see [Note: FSDP2 model state]. Sharded bytes divide by the shard group (``plan.mesh.shard_group_size``), not by
the world size: HSDP replicas each hold a full sharded copy.

The rest follows the FSDP2 source (torch/distributed/fsdp/_fully_shard/, cited per note) and was
checked against storage-tracked real runs on CPU/gloo (tests/test_cost_realrun.py); every finding is
a note below.

[Note: FSDP2 model state]
  (Module buffers are not sharded: every rank holds all of them, counted with the sharded parameters.)
  The sharded parameters stay in the dtype the model was built in (fp32) — they are the master
  weights; ``MixedPrecisionPolicy(param_dtype=bf16)`` only changes the all-gathered copy. Sharded
  gradients are always cast back to that dtype (``_fsdp_collectives.foreach_reduce``:
  ``_to_dtype_if_needed(reduce_output, orig_dtype)``), so they are fp32 whatever the reduce dtype.
  AdamW adds two fp32 states. Per rank: 4Ψ/N params + 4Ψ/N grads + 8Ψ/N states = 16Ψ/N, which equals
  ZeRO's (2 + 2 + 12)Ψ/N: FSDP2 keeps no 16-bit sharded copies, and its fp32 gradient takes the place
  of ZeRO's 16-bit gradient plus... nothing: ZeRO's 2Ψ of 16-bit params and 2Ψ of 16-bit grads become
  4Ψ of fp32 grads, and ZeRO's fp32 master copy is FSDP2's sharded parameter. Tested for N = 1..4096.

[Note: All-gather buffers]
  ``foreach_all_gather`` allocates one flat output of the unit's unsharded size in the param dtype
  (the rank's input is a view into it); with mixed precision it first casts the fp32 shard into a
  flat param-dtype copy (1/N of the unit, freed once copied in). ``foreach_all_gather_copy_out``
  then allocates the unsharded parameters (another unit-size) and copies into them. In *forward* the
  flat output is not freed after the copy-out: ``wait_for_unshard`` keeps it as ``all_gather_state``
  until the *next* unit's ``wait_for_unshard`` returns (the root's post-forward frees the last one),
  so while a unit computes in forward its parameters are live twice. The previous unit's output is
  dropped from ``comm_ctx`` before the copy-out but still referenced by the local
  ``prev_all_gather_state`` until the function returns, so during a copy-out in forward THREE
  unit-size buffers are live: the previous output, this output and this unit's parameters (measured
  on tests/models/cost_mlp.py at world size 2: 4 x 32 KiB extra storages at blocks.0's copy-out, one
  more than at its compute). In backward the output is freed right after the copy-out.

[Note: Prefetch holds all-gather outputs, not parameters]
  An explicitly prefetched unit (``set_modules_to_forward_prefetch``, depth k) has its all-gather
  issued in the current unit's pre-forward; its flat output stays pending until that unit's own
  pre-forward copies it out. So prefetch depth k adds k pending unit-size buffers, in
  ``comm_buffers``. Backward always prefetches at least one unit (FSDP2's default when no explicit
  list is set; an empty list means "default"), so backward depth 0 behaves as 1.

[Note: Reshard to a smaller group]
  ``reshard_after_forward=r`` (an int) keeps a clone of this rank's 1/r of the param-dtype unsharded
  parameters after forward (``FSDPParam.to_sharded_post_forward``: ``.clone()``); backward
  all-gathers from it over r ranks (another flat param-dtype copy of 1/r, then a unit-size output).
  The clone is freed when the unit is unsharded again. Each distinct r creates a process group,
  costing ``profile.per_process_group_bytes`` (pytorch#153302).

[Note: Reduce-scatter buffers]
  ``post_backward`` reshards the parameters, then ``foreach_reduce`` allocates a flat reduce-scatter
  input of the unit's unsharded size in the reduce dtype, copies the unsharded gradients into it and
  clears its list of them, which frees them — all but one: the gradient autograd produced last for the
  unit (that of its first module in forward order) is still referenced from C++ until post-backward
  returns (measured: one block-size bf16 storage more than expected during the collective when each
  unit has one parameter, and exactly one of 2 or 5 gradients when a unit has 2 or 5). It then
  allocates the 1/N output, which *becomes* the sharded gradient (views into it), or is cast to the
  built dtype when the reduce dtype differs. So during the collective: that gradient + input + output
  (+ the backend's temporary: gloo copies the input, ``profile.reduce_scatter_temp_fraction``). The flat input is kept (``reduce_scatter_states``, at most
  one) until the next unit's post-backward, and the last one until the end of backward.

[Note: The root's gradients live through backward]
  The root's own modules (embeddings, final norm, head) run their backward first, but the root's
  post-backward — which reduce-scatters and frees their unsharded gradients — runs last, from the
  final callback. Their param-dtype gradients are live during the whole backward.

[Note: Activations]
  Saved tensors are attributed to the module that first saves them (the tracer's contract), so the
  live activation level after a block is the batch, plus everything saved so far, plus the block's
  output (the tensor flowing to the next block). Inside a block the level rises by the traced
  ``fwd_peak_rise_bytes`` above the level at its entry; in backward by ``bwd_peak_rise_bytes`` (which
  excludes parameter gradients) plus the block's parameter gradients (measured on a Linear head: the
  input gradient and the weight gradient are live together with the output gradient). A checkpointed block keeps only its input in forward and recomputes its
  saved tensors at the start of its backward (``torch.utils.checkpoint``, non-reentrant). Activations
  are traced in one compute dtype and scaled by the element size of the plan's param dtype.

[Note: A container's own code]
  A module that holds a unit is split into blocks: its children, then its own code (a ``self_only``
  block), which saves ``saved_bytes_self`` but may reach higher while it runs: the root of a
  transformers model computes the loss inside its forward while its decoder's output is still held by
  its frame. The trace records how high its own code rose above the level at its entry
  (``fwd_tail_rise_bytes``); the block rises to that level above the walk's level where the container
  entered (its first block's), and at least by what it saves. Measured on the zoo's T5 (tests/hf/zoo.py,
  its decoder's last block a unit): the forward peak, at the loss, was predicted 19,972 B low before. With a
  checkpointed block inside, the trace's level (without checkpointing) is not the plan's: only the saved
  bytes count there. Its own code's backward runs first, rising by the trace's ``bwd_head_rise_bytes``
  (trace/replay.py ``head_rise``), e.g. that loss's backward: a tiny transformers Llama with LoRA peaks there
  (reports/benchmarks/single_device.md: -5.4% before it, 0.0% after; FSDP2 a block per unit -3.1%, +2.1%).

[Note: Checkpointed inputs held elsewhere]
  A checkpointed block keeps its input storages, but some of them are already counted: batch tensors,
  and storages an earlier block took as input too. In a U-Net a down block's input is also the skip
  connection the matching up block concatenates (``examples/unet.py``: ``downs.1`` and ``ups.1`` both
  take the same 64 KiB storage, ``downs.0`` and ``ups.2`` the same 128 KiB one), so adding each
  checkpointed block's ``input_bytes`` counted them twice. The tracer reports that part as
  ``ModuleTrace.input_shared_bytes`` and only ``input - input_shared`` is added. Measured with the
  StorageTracker (U-Net tiny, bf16, batch 8, every block checkpointed, no FSDP): the checkpointed
  inputs live at the end of forward are 589824 B of distinct storages, where the per-block sum is
  786432 B; with FSDP2 at world size 2 the peak (recompute of ``ups.2``) measured 2421968 B, predicted
  2618368 B (+8.1%) before and 2421760 B (-0.01%) after (tests/test_cost_realrun.py). Not modelled: a
  skip storage whose only other holder is a checkpointed block's saved tensors (they are dropped), e.g.
  a checkpointed down block followed by a non-checkpointed one, under-counts it.

[Note: Nested units' gradients]
  A unit nested inside a block (``layers.0`` a unit, ``layers.0.mlp`` its own unit) produces its
  gradients during that block's backward, so they are live at the block's backward peak together with
  the block's own, until the nested unit's post-backward reduce-scatters them. Counting them only after
  the block's backward event under-predicted every plan with a nested unit, most visibly when the block
  is checkpointed (its backward, after the recompute, is the step's peak). Measured (tiny transformers,
  bf16, 2 ranks, blocks checkpointed, one MLP nested; tests/hf/): GPT-2 -4.9% before, -0.5% after; Llama
  -2.6% before, +1.1% after with use_cache=True, +3.55% with use_cache=False (tests/hf/test_zoo.py
  OVER_PREDICTED). With every block's MLP nested the error is still -3 to -4% (GPT-2, Llama): not modelled yet.

[Note: Measured peaks move by one activation]
  Repeated real runs of the same plan measure peaks that differ by one activation-sized storage now
  and then (e.g. 966684 vs 999452 B for tests/models/cost_mlp.py with forward prefetch 2): some
  tensors are held by reference cycles (autograd graph <-> FSDP2 hooks) and freed whenever Python's
  cyclic collector happens to run. The simulator predicts the case where they are freed promptly;
  tests allow 3%.
"""

from __future__ import annotations

from shard_planner.cost import optimizer as optimizer_rules
from shard_planner.cost.activations import BlockActivations
from shard_planner.cost.allocations import (
    ACTIVATIONS, ALL_GATHER_OUTPUT, COMM_BUFFERS, GRADS, ON_COPY_IN, ON_DEFAULT, ON_REDUCE_SCATTER,
    OVERHEAD, SHARDED_PARAMS, UNSHARDED_PARAMS, Accountant, CategoryTotals, Stream, Timeline, label,
    one_accountant, to_dict,
)
from shard_planner.cost.allocations import OPTIMIZER_STATES as OPTIMIZER_STATES_KIND
from shard_planner.cost.queries import PlanQuery
from shard_planner.cost.reshard import reshard_group_sizes
from shard_planner.cost.schedule import EventKind, Phase, Schedule
from shard_planner.cost.selective import SelectiveBlocks
from shard_planner.cost.tables import CostTables
from shard_planner.cost.types import MemoryEstimate, MemoryEvent
from shard_planner.cost.unit_bytes import UnitBytes, reduce_scatter_backend_temp_bytes
from shard_planner.cost.unit_state import Sharding, UnitState
from shard_planner.hardware.profile import HardwareProfile
from shard_planner.trace.types import ModelTrace


def simulate_memory_walk(trace: ModelTrace, t: CostTables, plan: PlanQuery, profile: HardwareProfile,
                         ub: tuple[UnitBytes, ...], schedule: Schedule, acts: BlockActivations, *,
                         timeline: bool, selective: SelectiveBlocks | None = None,
                         accountants: tuple[Accountant, ...] = ()) -> MemoryEstimate:
    """Walk ``schedule`` emitting its allocations (the module docstring); CostModel.memory calls it.
    ``selective``: the stash of selectively checkpointed blocks (cost/selective.py); ``accountants``:
    more accountants to see the events (cost/allocations.py), after the totals and the timeline."""
    walk = _MemoryWalk(trace, t, plan, profile, ub, schedule, acts, timeline, accountants)
    if selective is not None:
        walk.stash = selective.stash
    return walk.run()


class _MemoryWalk:
    """One schedule walked once, each event kind with one handler, every allocation and free emitted to
    the accountants (``self.out``); the category totals and the timeline are two of them."""

    def __init__(self, trace, t: CostTables, plan: PlanQuery, profile: HardwareProfile, ub, schedule: Schedule,
                 acts: BlockActivations, timeline: bool, accountants: tuple = ()):
        self.t, self.plan, self.profile, self.ub, self.schedule, self.timeline = t, plan, profile, ub, schedule, timeline
        self.trace, self.acts = trace, acts
        self.totals = CategoryTotals()
        self.marks = Timeline(self.totals) if timeline else None
        self.out = one_accountant((self.totals, *self.own_accountants(), *accountants))
        training = plan.training
        self.b = training.micro_batch
        self.offload_off_device = not optimizer_rules.state_on_device(training.cpu_offload, profile.device)
        self.units = [UnitState() for _ in plan.units]
        self.offload_copy = [x.sharded if self.offload_off_device else 0.0 for x in ub]
        self.held_all_gather = 0.0  # forward: the last copied-out unit's all-gather output
        self.held_all_gather_owner = ""
        self.held_reduce_scatter = 0.0  # the last reduce-scatter input, until the next post-backward
        self.held_reduce_scatter_owner = ""
        self.sharded_grad_live = [False] * len(plan.units)
        # activations = batch + saved so far + flow (the tensor flowing into / out of the current block)
        self.batch_bytes = trace.batch_input_bytes.at(self.b)
        self.activation_level = 0.0  # [Note: Activations as a level]: the level now,
        self.activation_bytes = 0.0  # and the level allocated (at the last mark)
        self.saved_sum = 0.0  # saved for backward so far, and what the output holds until the loss:
        self.held_sum = 0.0  # of it, the latter ([Note: Storages the forward's output holds], trace/held.py)
        self.flow = 0.0
        self.entry_level = [0.0] * len(t.blocks)  # the activation level as each block entered
        # per block, what selective checkpointing keeps beyond the inputs: [Note: Selective checkpointing memory]
        self.stash: tuple[float, ...] = (0.0,) * len(t.blocks)

    def own_accountants(self) -> tuple:
        """The walk's accountants after the totals (cost/accumulation.py adds one)."""
        return (self.marks,) if self.timeline else ()

    def allocate_step_state(self) -> None:
        """What lives through the whole step, one allocation per kind (allocated at initialisation or at the
        first step, not in the walked step): sharded state ([Note: FSDP2 model state]), the overhead, the batch."""
        plan, profile, ub, out = self.plan, self.profile, self.ub, self.out
        if not self.offload_off_device:  # buffers are not sharded and stay on the device (FSDP2 moves only parameters)
            out.on_alloc(SHARDED_PARAMS, sum(x.sharded for x in ub), "", ON_DEFAULT)
            states = optimizer_rules.optimizer_state_bytes(plan.training.optimizer, sum(x.sharded_grad for x in ub))
            out.on_alloc(OPTIMIZER_STATES_KIND, states, "", ON_DEFAULT)
        out.on_alloc(SHARDED_PARAMS, self.t.buffer_bytes, "", ON_DEFAULT)
        out.on_alloc(OVERHEAD, profile.reserved_bytes, "", ON_DEFAULT)
        for _ in reshard_group_sizes(plan.units, plan.mesh.shard_group_size):
            out.on_alloc(OVERHEAD, profile.per_process_group_bytes, "", ON_DEFAULT)  # pytorch#153302
        out.on_alloc(ACTIVATIONS, self.batch_bytes, "", ON_DEFAULT)
        self.activation_level = self.activation_bytes = self.batch_bytes

    def record(self, what: str, who: str, phase: Phase, extra_temp: float = 0.0, extra_comm: float = 0.0,
               stream: Stream = ON_DEFAULT) -> None:
        """A mark (label "<phase>: <what> <who>", built only when kept), after the activation level's change
        if any ([Note: Activations as a level]), with its scratch (cost/allocations.py): ``extra_temp`` of
        temporaries and ``extra_comm`` of a comm buffer, both on ``stream``."""
        out = self.out
        level = self.activation_level
        if level != self.activation_bytes:  # the change since the last mark, as one free and one alloc
            out.on_free(ACTIVATIONS, self.activation_bytes, "", ON_DEFAULT)
            out.on_alloc(ACTIVATIONS, level, "", ON_DEFAULT)
            self.activation_bytes = level
        out.on_mark(what, who, phase, extra_temp, extra_comm, stream)

    def run(self) -> MemoryEstimate:
        self.handlers = self.dispatch()
        self.allocate_step_state()
        self.walk_step()
        return self.result()

    def walk_step(self) -> None:
        """The step's events (cost/accumulation.py walks them once per micro-step)."""
        self.walk(self.schedule.events)

    def dispatch(self) -> list:
        """The handler of each event kind, indexed by the kind (an IntEnum): the hot loop's dispatch."""
        K = EventKind
        handlers: list = [None] * len(K)
        handlers[K.PRE_FORWARD], handlers[K.ALL_GATHER], handlers[K.ALL_GATHER_WAIT] = (
            self.pre_forward, self.all_gather, self.wait)
        handlers[K.FORWARD], handlers[K.RESHARD], handlers[K.FORWARD_END] = self.forward, self.reshard, self.forward_end
        handlers[K.LOSS], handlers[K.RECOMPUTE] = self.loss, self.recompute
        handlers[K.PRE_BACKWARD] = lambda ev: None  # its all-gather wait and prefetches are events of their own
        handlers[K.BACKWARD], handlers[K.POST_BACKWARD], handlers[K.BACKWARD_END] = (
            self.backward, self.post_backward, self.backward_end)
        handlers[K.OPTIMIZER] = self.optimizer
        return handlers

    def walk(self, events) -> None:
        """Handle ``events`` in order."""
        handlers = self.handlers
        for ev in events:
            handlers[ev.kind](ev)

    # ---- all-gathers and resharding: see [Note: All-gather buffers] ----
    def issue(self, u: int, phase: Phase) -> None:
        x, st = self.ub[u], self.units[u]
        if st.pending_bytes or st.sharding is Sharding.UNSHARDED:
            return
        from_group = st.group_clone_bytes != 0.0
        # the flat param-dtype copy of the all-gather input (mixed precision, or a post-forward shard)
        cast = (x.post_forward if from_group else x.cast_input) if x.mp else 0.0
        name = self.t.unit_names[u]
        self.out.on_alloc(ALL_GATHER_OUTPUT, x.all_gather_output, name, ON_COPY_IN)
        st.pending_bytes = x.all_gather_output
        st.sharding = Sharding.GATHERING
        self.record("all-gather", name, phase, extra_temp=cast + (0.0 if from_group else self.offload_copy[u]),
                    stream=ON_COPY_IN)

    def all_gather(self, ev) -> None:
        if not ev.implicit:  # an implicit prefetch is allocated at the unit's own pre-forward
            self.issue(ev.unit, ev.phase)

    def wait(self, ev) -> None:
        u, phase, out = ev.unit, ev.phase, self.out
        x, st = self.ub[u], self.units[u]
        if st.sharding is Sharding.UNSHARDED:
            return
        if not st.pending_bytes:  # (a unit without parameters has nothing pending: issued again, empty)
            self.issue(u, phase)
        name = self.t.unit_names[u]
        out.on_alloc(UNSHARDED_PARAMS, x.unsharded, name, ON_DEFAULT)
        self.record("copy-out", name, phase)
        if phase is Phase.FORWARD:
            if self.held_all_gather:  # freed only when wait_for_unshard returns
                out.on_free(ALL_GATHER_OUTPUT, self.held_all_gather, self.held_all_gather_owner, ON_COPY_IN)
            self.held_all_gather, self.held_all_gather_owner = st.pending_bytes, name
        else:
            out.on_free(ALL_GATHER_OUTPUT, st.pending_bytes, name, ON_COPY_IN)
        st.pending_bytes = 0.0
        if st.group_clone_bytes:
            out.on_free(UNSHARDED_PARAMS, x.post_forward, name, ON_DEFAULT)
            st.group_clone_bytes = 0.0
        st.sharding = Sharding.UNSHARDED

    def reshard(self, ev) -> None:
        u = ev.unit
        x, st = self.ub[u], self.units[u]
        if st.sharding is not Sharding.UNSHARDED:
            return
        st.sharding = Sharding.SHARDED
        name = self.t.unit_names[u]
        if x.post_forward:
            self.out.on_alloc(UNSHARDED_PARAMS, x.post_forward, name, ON_DEFAULT)
            self.record("reshard to a smaller group", name, Phase.FORWARD)
            st.group_clone_bytes = x.post_forward
            st.sharding = Sharding.RESHARDED_TO_GROUP
        self.out.on_free(UNSHARDED_PARAMS, x.unsharded, name, ON_DEFAULT)

    # ---- forward ----
    def enter_forward_block(self, i: int) -> None:
        """The activation level as block ``i`` starts: its input flows in."""
        if self.acts.flows[i]:
            self.flow = self.acts.input[i]
        self.activation_level = self.batch_bytes + self.saved_sum + self.flow

    def pre_forward(self, ev) -> None:
        if ev.block >= 0:
            self.enter_forward_block(ev.block)

    def forward(self, ev) -> None:
        i, a = ev.block, self.acts
        name = self.acts.names[i]
        self.enter_forward_block(i)
        self.entry_level[i] = self.activation_level
        rise = a.fwd_rise[i] if a.flows[i] else self.container_rise(i)
        if self.schedule.checkpointed[i]:
            stash = self.stash[i]  # selective: cost/selective.py [Note: Selective checkpointing memory]
            self.record("checkpointed", name, Phase.FORWARD, extra_temp=max(a.output[i], rise - a.saved[i]) + stash)
            # only the inputs nobody else holds are new bytes: [Note: Checkpointed inputs held elsewhere]
            self.saved_sum += a.kept[i] + stash
        else:
            self.record("", name, Phase.FORWARD, extra_temp=rise)
            self.saved_sum += a.saved[i] - self.made_grads(i)
        self.saved_sum += a.held[i]
        self.held_sum += a.held[i]
        if a.flows[i]:
            self.flow = a.output[i]
        self.activation_level = self.batch_bytes + self.saved_sum + self.flow

    def made_grads(self, i: int) -> float:
        """The parameter gradients block ``i``'s forward (or recomputation) made and saved, allocated as gradients
        as it ends (of its saved bytes, returned): a fused output layer and loss's (model/loss.py,
        ModuleTrace.forward_grad_bytes); backward hands them on as the gradients autograd accumulates."""
        if self.acts.made_grads[i]:
            self.out.on_alloc(GRADS, self.acts.made_grads[i], self.acts.names[i], ON_DEFAULT)
        return self.acts.made_grads[i]

    def container_rise(self, i: int) -> float:
        """How far a container's own code (block ``i``) rises above the level now: [Note: A container's own code]."""
        a, first = self.acts, self.t.blocks[i].first_block
        if first < 0 or any(self.schedule.checkpointed[first:i]):
            return a.saved[i]
        return max(a.saved[i], self.entry_level[first] + a.tail_rise[i] - self.activation_level)

    def forward_end(self, ev) -> None:
        if self.held_all_gather:  # the root's post-forward frees the last all-gather output
            self.out.on_free(ALL_GATHER_OUTPUT, self.held_all_gather, self.held_all_gather_owner, ON_COPY_IN)
            self.held_all_gather = 0.0
        self.record("end", "", Phase.FORWARD)

    def loss(self, ev) -> None:
        self.record("loss forward+backward", "", Phase.BACKWARD, extra_temp=self.trace.loss_peak_rise_bytes.at(self.b))
        self.saved_sum -= self.held_sum  # the output is dropped, and what it held with it
        self.activation_level -= self.held_sum
        self.held_sum = 0.0
        self.flow = self.acts.output[-1] if self.acts.output else 0.0

    # ---- backward ----
    def enter_backward_block(self, i: int) -> None:
        """The activation level as block ``i``'s backward starts: the gradient of its output flows in."""
        if self.acts.flows[i]:
            self.flow = self.acts.output[i]
        self.activation_level = self.batch_bytes + self.saved_sum + self.flow

    def recompute(self, ev) -> None:
        i, a = ev.block, self.acts
        name = self.acts.names[i]
        self.enter_backward_block(i)
        stash = self.stash[i]  # consumed as the recomputation reaches it (cost/selective.py)
        self.record("recompute", name, Phase.BACKWARD, extra_temp=max(0.0, a.fwd_rise[i] - stash))
        self.saved_sum += a.saved[i] - self.made_grads(i) - a.kept[i] - stash
        self.activation_level = self.batch_bytes + self.saved_sum + self.flow

    def backward(self, ev) -> None:
        i, a, out = ev.block, self.acts, self.out
        t = self.t
        blk = t.blocks[i]
        self.enter_backward_block(i)
        own_grads = a.own_grads[i]  # less those its forward made (made_grads)
        # the traced rise excludes parameter gradients: add them on top. See [Note: Activations].
        if own_grads:
            out.on_alloc(GRADS, own_grads, a.names[i], ON_DEFAULT)
        self.units[blk.unit].grad_bytes += own_grads + a.made_grads[i]
        for v in blk.nested:  # produced by this block's backward too: before the event, not after
            g = self.ub[v].unsharded_grads
            out.on_alloc(GRADS, g, t.unit_names[v], ON_DEFAULT)
            self.units[v].grad_bytes += g
        self.record("", a.names[i], Phase.BACKWARD, extra_temp=a.bwd_rise[i])
        self.saved_sum -= a.saved[i] - a.made_grads[i]
        if a.flows[i]:
            self.flow = a.input[i]  # the gradient of the block's input
        self.activation_level = self.batch_bytes + self.saved_sum + self.flow

    def post_backward(self, ev) -> None:
        self.reduce_scatter(ev, self.ub[ev.unit].last_grad)

    def reshard_after_backward(self, ev) -> None:
        """What every post-backward does first, with or without gradient sync: the root's (from the final
        callback) ends the backward's activations; a unit reshards unless it keeps its parameters."""
        if ev.block < 0:  # the root's, from the final callback: every block's backward is done
            self.flow = 0.0
            self.activation_level = self.batch_bytes + max(self.saved_sum, 0.0)
        st = self.units[ev.unit]
        if st.sharding is Sharding.UNSHARDED and self.reshards_after_backward():
            self.out.on_free(UNSHARDED_PARAMS, self.ub[ev.unit].unsharded, self.t.unit_names[ev.unit], ON_DEFAULT)
            st.sharding = Sharding.SHARDED

    def reduce_scatter(self, ev, last_grad_bytes: float) -> None:
        """Post-backward with gradient sync: reshard, then reduce-scatter the unit's gradients, of which
        the last autograd produced (``last_grad_bytes``) is held through the collective
        ([Note: Reduce-scatter buffers]; cost/accumulation.py passes an accumulated one)."""
        u, out = ev.unit, self.out
        x, st = self.ub[u], self.units[u]
        name = self.t.unit_names[u]
        self.reshard_after_backward(ev)
        self.free_held_reduce_scatter()
        out.on_alloc(COMM_BUFFERS, x.rs_input, name, ON_DEFAULT)
        self.record("reduce-scatter copy-in", name, Phase.BACKWARD)
        # the copied-in gradients are freed, but the last one autograd produced stays referenced until
        # post_backward returns; the 1/N output is allocated before the collective runs (it becomes the
        # sharded gradient). See [Note: Reduce-scatter buffers].
        held = min(last_grad_bytes, st.grad_bytes)
        if st.grad_bytes - held:
            out.on_free(GRADS, st.grad_bytes - held, name, ON_DEFAULT)
        backend_temp = reduce_scatter_backend_temp_bytes(x.rs_input, self.profile, self.plan.mesh.shard_group_size)
        self.record("reduce-scatter", name, Phase.BACKWARD, extra_temp=backend_temp, extra_comm=x.rs_output,
                    stream=ON_REDUCE_SCATTER)
        if held:
            out.on_free(GRADS, held, name, ON_DEFAULT)
        st.grad_bytes = 0.0
        self.held_reduce_scatter, self.held_reduce_scatter_owner = x.rs_input, name
        if x.grad_cast:
            self.record("reduce-scatter output", name, Phase.BACKWARD, extra_temp=x.rs_output + x.sharded_grad,
                        stream=ON_REDUCE_SCATTER)
        if not self.offload_off_device:
            out.on_alloc(GRADS, x.sharded_grad, name, ON_REDUCE_SCATTER)
            self.sharded_grad_live[u] = True
        if self.plan.mesh.is_hsdp and x.grad_cast:
            # kept for the replica all-reduce (FSDPParamGroup._all_reduce_state)
            out.on_alloc(COMM_BUFFERS, x.rs_output, name, ON_REDUCE_SCATTER)

    def free_held_reduce_scatter(self) -> None:
        """The previous reduce-scatter input, kept until the next post-backward or the end of backward."""
        if self.held_reduce_scatter:
            self.out.on_free(COMM_BUFFERS, self.held_reduce_scatter, self.held_reduce_scatter_owner, ON_DEFAULT)
            self.held_reduce_scatter = 0.0

    def reshards_after_backward(self) -> bool:
        """FSDP2's ``reshard_after_backward`` (True; cost/accumulation.py keeps parameters between micro-steps)."""
        return True

    def backward_end(self, ev) -> None:
        self.free_held_reduce_scatter()
        for u, st in enumerate(self.units):  # prefetched, never waited for: dropped by finalize_backward
            if st.pending_bytes:  # (a unit without a pre-backward, schedule.py)
                self.out.on_free(ALL_GATHER_OUTPUT, st.pending_bytes, self.t.unit_names[u], ON_COPY_IN)
                st.pending_bytes, st.sharding = 0.0, Sharding.SHARDED
        self.record("end", "", Phase.BACKWARD)

    # ---- optimizer step: see [Note: Optimizer step] (cost/optimizer.py) ----
    def optimizer(self, ev) -> None:
        training, plan = self.plan.training, self.plan
        if not self.offload_off_device:
            temp = optimizer_rules.optimizer_temporaries_bytes(
                training.optimizer, self.profile.device, sum(x.sharded_grad for x in self.ub),
                self.t.largest_module_float_bytes, plan.mesh.shard_group_size)
            self.record("step", "", Phase.OPTIMIZER, extra_temp=temp)
        self.zero_grad()
        self.record("zero_grad", "", Phase.OPTIMIZER)

    def zero_grad(self) -> None:
        """``zero_grad(set_to_none=True)``: every sharded gradient is freed."""
        names = self.t.unit_names
        for u, x in enumerate(self.ub):
            if self.sharded_grad_live[u]:
                self.out.on_free(GRADS, x.sharded_grad, names[u], ON_REDUCE_SCATTER)
                self.sharded_grad_live[u] = False

    def result(self) -> MemoryEstimate:
        what, who, phase, snap = self.totals.peak_event
        at_peak = to_dict(snap)
        timeline = (tuple(MemoryEvent(label(w, o, ph), ph, to_dict(sn)) for w, o, ph, sn in self.marks.marks)
                    if self.timeline else ())
        return MemoryEstimate(peak_bytes=sum(at_peak.values()), memory_at_peak=at_peak,
                              peak_event=label(what, who, phase), timeline=timeline)
