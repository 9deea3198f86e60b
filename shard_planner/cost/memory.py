"""Per-rank memory of one FSDP2 training step, simulated event by event.

``simulate_memory(trace, plan, profile)`` replays forward, loss, backward and the optimizer step of
one rank as FSDP2 (torch 2.13) runs them, tracks live bytes in the categories of
``plan.MEMORY_CATEGORIES``, and returns the peak, its breakdown and the whole timeline.

Model state (ZeRO, Rajbhandari et al. SC'20, §5). ZeRO-3 with mixed-precision Adam holds
``(2 + 2 + K)Ψ / N`` bytes per rank with K = 12: 16-bit parameters (2), 16-bit gradients (2), and fp32
master parameters, momentum and variance (12). FSDP2 realises the same 16Ψ/N with a different split —
see [Note: FSDP2 model state]. Sharded bytes divide by the shard group (``plan.mesh.shard``), not by
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

[Note: Optimizer step]
  Optimizer states are created at the first step and live from then on (the simulated step is a
  steady-state one). On GPU torch.optim defaults to the foreach implementation: AdamW/Adam allocate
  one temporary the size of all sharded parameters (``torch._foreach_sqrt(exp_avg_sqs)`` in
  torch/optim/adamw.py ``_multi_tensor_adamw``). On CPU tensors it takes the single-tensor path
  (``_default_to_fused_or_foreach`` picks foreach for CUDA only), whose temporaries are per parameter:
  measured with the storage tracker, AdamW's step peaks 2x one parameter above its states with one
  parameter and 3x the parameter size with 2 to 8 equal ones (``sqrt`` and ``div`` of this one, the
  previous ``denom`` not yet released) — modelled as 3x the largest module's parameter shard. SGD
  (with or without momentum, no weight decay) allocates none either way. Gradients are freed by
  ``zero_grad(set_to_none=True)`` before the next forward.

[Note: Measured peaks move by one activation]
  Repeated real runs of the same plan measure peaks that differ by one activation-sized storage now
  and then (e.g. 966684 vs 999452 B for tests/models/cost_mlp.py with forward prefetch 2): some
  tensors are held by reference cycles (autograd graph <-> FSDP2 hooks) and freed whenever Python's
  cyclic collector happens to run. The simulator predicts the case where they are freed promptly;
  tests allow 3%.

[Note: CPU offload]
  With ``CPUOffloadPolicy`` the sharded parameters, gradients and optimizer states live on the host,
  and the optimizer steps there. On a GPU profile they leave the device, but every all-gather first
  copies the unit's fp32 shard to the device (1/N, transient). On a CPU profile (``device == "cpu"``)
  the host is the device: nothing moves and offloaded state still counts.
"""

from __future__ import annotations

import logging

from shard_planner.cost.tables import CostTables, cost_tables, dtype_bytes
from shard_planner.cost.types import MemoryEstimate, MemoryEvent
from shard_planner.plan import MEMORY_CATEGORIES, Plan
from shard_planner.profile import HardwareProfile
from shard_planner.trace.types import ModelTrace

logger = logging.getLogger(__name__)

# Optimizer states per parameter element, in the sharded (built) dtype (torch/optim: AdamW and Adam
# keep exp_avg and exp_avg_sq; SGD with momentum keeps momentum_buffer; plain SGD nothing).
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}
# Temporaries of the step. See [Note: Optimizer step]. GPU (foreach): in sizes of all sharded
# parameters together; CPU (single-tensor): in sizes of the largest one parameter shard.
OPTIMIZER_TEMPORARIES = {"adamw": 1, "adam": 1, "sgd_momentum": 0, "sgd": 0}
OPTIMIZER_TEMPORARIES_SINGLE_TENSOR = {"adamw": 3, "adam": 3, "sgd_momentum": 0, "sgd": 0}

_SP, _UP, _GR, _OS, _AC, _TM, _CB, _OV = range(8)  # indices into the category vector (MEMORY_CATEGORIES order)
assert MEMORY_CATEGORIES == ("sharded_params", "unsharded_params", "grads", "optimizer_states", "activations",
                             "temporaries", "comm_buffers", "overhead")


def optimizer_state_count(optimizer: str) -> int:
    return OPTIMIZER_STATES[optimizer]


class UnitBytes:
    """Per-unit byte sizes under one plan (sharded, unsharded, reduce-scatter): what the memory and the
    time simulators both read. ``unit_bytes(tables, plan)`` builds them; ``estimate`` builds them once."""

    __slots__ = ("sharded", "unsharded", "rs_input", "rs_output", "sharded_grad", "cast_input",
                 "post_forward", "reshard", "resharded", "grad_cast", "last_grad", "mp")


def unit_bytes(t: CostTables, plan: Plan) -> list[UnitBytes]:
    n = plan.mesh.shard
    param_dtype, reduce_dtype = plan.training.param_dtype, plan.training.reduce_dtype
    pd_elem, rs_elem = dtype_bytes(param_dtype), dtype_bytes(reduce_dtype)
    out = []
    for i, u in enumerate(plan.units):
        b = UnitBytes()
        float_numel = t.unit_float_numel[i]
        float_built = t.unit_float_built_bytes[i]
        other = t.unit_other_bytes[i]
        b.last_grad = t.unit_first_float_numel[i] * pd_elem
        # Mixed precision applies to floating parameters whose dtype differs from param_dtype.
        mp = any(dt != param_dtype for dt in t.unit_float_dtypes[i])
        unsharded = float_numel * pd_elem + other
        b.sharded = (float_built + other) / n
        b.unsharded = unsharded
        # reduce_dtype equal to param_dtype means "no cast" (FSDPParam.init_dtype_attrs): same bytes.
        b.rs_input = float_numel * rs_elem
        b.rs_output = b.rs_input / n
        b.sharded_grad = float_built / n
        b.grad_cast = b.rs_output != b.sharded_grad  # reduce dtype differs from built: cast after
        b.mp = mp
        b.cast_input = unsharded / n if mp else 0.0
        r = u.reshard_after_forward
        b.reshard = r is not False
        b.post_forward = unsharded / r if (not isinstance(r, bool)) else 0.0
        b.resharded = False
        out.append(b)
    return out


def simulate_memory(trace: ModelTrace, plan: Plan, profile: HardwareProfile,
                    *, timeline: bool = True, ub: list[UnitBytes] | None = None) -> MemoryEstimate:
    """Peak live bytes of one rank over one steady-state training step (see the module docstring).

    ``timeline=False`` skips building the per-event timeline (the solver only needs the peak); ``ub``:
    ``unit_bytes(cost_tables(trace, plan.units), plan)`` when the caller has it already."""
    t = cost_tables(trace, plan.units)
    if ub is None:
        ub = unit_bytes(t, plan)
    training = plan.training
    b = training.micro_batch
    n_units = len(plan.units)
    act_scale = dtype_bytes(training.param_dtype) / dtype_bytes(trace.compute_dtype)
    offload_off_device = training.cpu_offload and profile.device != "cpu"

    sharded_total = sum(x.sharded for x in ub)
    states = OPTIMIZER_STATES[training.optimizer] * sum(x.sharded_grad for x in ub)
    int_sizes = {u.reshard_after_forward for u in plan.units if not isinstance(u.reshard_after_forward, bool)}
    overhead = profile.reserved_bytes + profile.per_process_group_bytes * len(int_sizes)

    cat = [0.0] * 8
    # buffers are not sharded and stay on the device under CPU offload (FSDP2 moves only parameters)
    cat[_SP] = (0.0 if offload_off_device else sharded_total) + t.buffer_bytes
    cat[_OS] = 0.0 if offload_off_device else states
    cat[_OV] = float(overhead)
    batch_bytes = trace.batch_input_bytes.at(b)
    cat[_AC] = batch_bytes

    events: list[tuple[str, str, tuple]] = []
    peak = [-1.0, None]  # total, event tuple

    def record(what: str, who: str, phase: str, extra_temp: float = 0.0, extra_comm: float = 0.0) -> None:
        """One event; its label is "<phase>: <what> <who>", built only when kept."""
        total = cat[0] + cat[1] + cat[2] + cat[3] + cat[4] + cat[5] + cat[6] + cat[7] + extra_temp + extra_comm
        if timeline or total > peak[0]:
            snap = (cat[0], cat[1], cat[2], cat[3], cat[4], cat[5] + extra_temp, cat[6] + extra_comm, cat[7])
            if timeline:
                events.append((what, who, phase, snap))
            if total > peak[0]:
                peak[0] = total
                peak[1] = (what, who, phase, snap)

    name = t.unit_names
    unsharded = [False] * n_units
    pending = [0.0] * n_units  # all-gather outputs issued and not yet copied out
    ag_state = [0.0]  # forward: the last copied-out unit's all-gather output (freed at the next copy-out)
    offload_copy = [x.sharded if offload_off_device else 0.0 for x in ub]

    def issue_all_gather(u: int, phase: str) -> None:
        x = ub[u]
        if pending[u] or unsharded[u]:
            return
        # the flat param-dtype copy of the all-gather input (mixed precision, or a post-forward shard)
        cast = (x.post_forward if x.resharded else x.cast_input) if x.mp else 0.0
        cat[_CB] += x.unsharded
        pending[u] = x.unsharded
        record("all-gather", name[u], phase, extra_temp=cast + (0.0 if x.resharded else offload_copy[u]))

    def wait_all_gather(u: int, phase: str) -> None:
        x = ub[u]
        if unsharded[u]:
            return
        if not pending[u]:
            issue_all_gather(u, phase)
        cat[_UP] += x.unsharded
        record("copy-out", name[u], phase)
        if phase == "forward" and ag_state[0]:
            # freed only when wait_for_unshard returns: see [Note: All-gather buffers]
            cat[_CB] -= ag_state[0]
            ag_state[0] = 0.0
        if phase == "forward":
            ag_state[0] = pending[u]  # stays in comm_buffers
        else:
            cat[_CB] -= pending[u]
        pending[u] = 0.0
        if x.resharded:
            cat[_UP] -= x.post_forward
            x.resharded = False
        unsharded[u] = True

    def reshard_after_forward(u: int) -> None:
        x = ub[u]
        if not x.reshard or not unsharded[u]:
            return
        if x.post_forward:
            cat[_UP] += x.post_forward
            record("reshard to a smaller group", name[u], "forward")
            x.resharded = True
        cat[_UP] -= x.unsharded
        unsharded[u] = False

    fwd_units = t.forward_units
    fwd_pos = {u: i for i, u in enumerate(fwd_units)}
    d_fwd = plan.prefetch.forward
    d_bwd = max(1, plan.prefetch.backward)
    blocks = t.blocks
    ckpt = [plan.units[blk.unit].activation_checkpoint and blk.unit_module for blk in blocks]
    root = next(i for i, u in enumerate(plan.units) if u.is_root)

    def pre_forward(u: int) -> None:
        wait_all_gather(u, "forward")
        i = fwd_pos[u]
        for v in fwd_units[i + 1: i + 1 + d_fwd]:
            issue_all_gather(v, "forward")

    # ---- forward ----
    # activations = batch + saved so far + flow (the tensor flowing into / out of the current block)
    saved_sum = 0.0
    flow = 0.0
    pre_forward(root)
    for i, blk in enumerate(blocks):
        rise = blk.fwd_rise.at(b) * act_scale
        saved = blk.saved.at(b) * act_scale
        is_self = blk.fqn.endswith(":self")
        if not is_self:
            flow = blk.input.at(b) * act_scale
        cat[_AC] = batch_bytes + saved_sum + flow
        for u in (blk.unit, *blk.nested):
            if t.unit_first_block[u] == i and u != root:
                pre_forward(u)
        if ckpt[i]:
            out = blk.output.at(b) * act_scale
            record("checkpointed", blk.fqn, "forward", extra_temp=max(out, rise - saved))
            # only the inputs nobody else holds are new bytes: [Note: Checkpointed inputs held elsewhere]
            saved_sum += (blk.input.at(b) - blk.input_shared.at(b)) * act_scale
        else:
            record("", blk.fqn, "forward", extra_temp=rise)
            saved_sum += saved
        if not is_self:
            flow = blk.output.at(b) * act_scale
        cat[_AC] = batch_bytes + saved_sum + flow
        for u in (*blk.nested, blk.unit):
            if t.unit_last_block[u] == i and u != root:
                reshard_after_forward(u)
    if plan.units[root].reshard_after_forward is not False:
        reshard_after_forward(root)
    if ag_state[0]:
        cat[_CB] -= ag_state[0]
        ag_state[0] = 0.0
    record("end", "", "forward")

    # ---- loss ----
    loss_rise = trace.loss_peak_rise_bytes.at(b)
    record("loss forward+backward", "", "backward", extra_temp=loss_rise)
    flow = blocks[-1].output.at(b) * act_scale if blocks else 0.0

    # ---- backward ----
    # The root's pre-backward runs first (the gradient of its output arrives first) and prefetches
    # one unit, FSDP2's default (the executor sets no explicit list on the root); then the other units
    # in reverse forward order, each prefetching the next d_bwd.
    bwd_units = (root, *reversed([u for u in fwd_units if u != root]))
    bwd_pos = {u: i for i, u in enumerate(bwd_units)}
    grad_unsharded = [0.0] * n_units
    rs_state = [0.0]
    rs_temp = profile.reduce_scatter_temp_fraction
    param_elem = dtype_bytes(training.param_dtype)

    def pre_backward(u: int) -> None:
        wait_all_gather(u, "backward")
        i = bwd_pos[u]
        for v in bwd_units[i + 1: i + 1 + (1 if u == root else d_bwd)]:
            issue_all_gather(v, "backward")

    def post_backward(u: int) -> None:
        x = ub[u]
        if unsharded[u]:
            cat[_UP] -= x.unsharded
            unsharded[u] = False
        if rs_state[0]:
            cat[_CB] -= rs_state[0]
            rs_state[0] = 0.0
        cat[_CB] += x.rs_input
        record("reduce-scatter copy-in", name[u], "backward")
        # the copied-in gradients are freed, but the last one autograd produced stays referenced until
        # post_backward returns; the 1/N output is allocated before the collective runs (it becomes the
        # sharded gradient). See [Note: Reduce-scatter buffers].
        held = min(x.last_grad, grad_unsharded[u])
        cat[_GR] -= grad_unsharded[u] - held
        record("reduce-scatter", name[u], "backward",
               extra_temp=x.rs_input * rs_temp, extra_comm=x.rs_output)
        cat[_GR] -= held
        grad_unsharded[u] = 0.0
        rs_state[0] = x.rs_input
        if x.grad_cast:
            record("reduce-scatter output", name[u], "backward", extra_temp=x.rs_output + x.sharded_grad)
        if not offload_off_device:
            cat[_GR] += x.sharded_grad
        if plan.mesh.replicate > 1 and x.grad_cast:
            cat[_CB] += x.rs_output  # kept for the replica all-reduce (FSDPParamGroup._all_reduce_state)

    pre_backward(root)
    started = {root}
    for i in range(len(blocks) - 1, -1, -1):
        blk = blocks[i]
        for u in (blk.unit, *blk.nested):
            if u not in started and t.unit_last_block[u] == i:
                pre_backward(u)
                started.add(u)
        saved = blk.saved.at(b) * act_scale
        is_self = blk.fqn.endswith(":self")
        if not is_self:
            flow = blk.output.at(b) * act_scale  # the gradient of the block's output
        cat[_AC] = batch_bytes + saved_sum + flow
        if ckpt[i]:
            kept = (blk.input.at(b) - blk.input_shared.at(b)) * act_scale
            record("recompute", blk.fqn, "backward", extra_temp=blk.fwd_rise.at(b) * act_scale)
            saved_sum += saved - kept
            cat[_AC] = batch_bytes + saved_sum + flow
        own_grads = blk.own_float_numel * param_elem
        # the traced rise excludes parameter gradients: add them on top. See [Note: Activations].
        rise = blk.bwd_rise.at(b) * act_scale + own_grads
        cat[_GR] += own_grads
        record("", blk.fqn, "backward", extra_temp=rise - own_grads)
        grad_unsharded[blk.unit] += own_grads
        for v in blk.nested:
            g = t.unit_float_numel[v] * param_elem
            cat[_GR] += g
            grad_unsharded[v] += g
        saved_sum -= saved
        if not is_self:
            flow = blk.input.at(b) * act_scale  # the gradient of the block's input
        cat[_AC] = batch_bytes + saved_sum + flow
        for u in (*blk.nested, blk.unit):
            if u != root and t.unit_first_block[u] == i:
                post_backward(u)
    flow = 0.0
    cat[_AC] = batch_bytes + max(saved_sum, 0.0)
    post_backward(root)
    if rs_state[0]:
        cat[_CB] -= rs_state[0]
        rs_state[0] = 0.0
    record("end", "", "backward")

    # ---- optimizer step ----
    if not offload_off_device:
        if profile.device == "cpu":
            temp = OPTIMIZER_TEMPORARIES_SINGLE_TENSOR[training.optimizer] * t.largest_module_float_bytes / plan.mesh.shard
        else:
            temp = OPTIMIZER_TEMPORARIES[training.optimizer] * sum(x.sharded_grad for x in ub)
        record("step", "", "optimizer", extra_temp=temp)
    cat[_GR] = 0.0
    record("zero_grad", "", "optimizer")

    def to_dict(s: tuple) -> dict[str, int]:  # MEMORY_CATEGORIES, in order (a literal: this is hot)
        return {"sharded_params": int(s[0] + 0.5), "unsharded_params": int(s[1] + 0.5), "grads": int(s[2] + 0.5),
                "optimizer_states": int(s[3] + 0.5), "activations": int(s[4] + 0.5),
                "temporaries": int(s[5] + 0.5), "comm_buffers": int(s[6] + 0.5), "overhead": int(s[7] + 0.5)}

    def label(what: str, who: str, phase: str) -> str:
        if phase == "optimizer":
            return "optimizer step" if what == "step" else what
        if what.startswith("loss"):
            return what
        if not what:
            return f"{phase}: {who or '<root>'}"
        return f"{phase}: {what} {who}" if who else f"{phase}: {what}"

    what, who, phase, snap = peak[1]
    at_peak = to_dict(snap)
    return MemoryEstimate(
        peak_bytes=sum(at_peak.values()),
        memory_at_peak=at_peak,
        peak_event=label(what, who, phase),
        timeline=tuple(MemoryEvent(label(w, o, ph), ph, to_dict(sn)) for w, o, ph, sn in events) if timeline else (),
    )


def model_state_bytes(trace: ModelTrace, plan: Plan) -> dict[str, int]:
    """Sharded parameters, gradients and optimizer states per rank (the ZeRO model state)."""
    t = cost_tables(trace, plan.units)
    ub = unit_bytes(t, plan)
    grads = sum(x.sharded_grad for x in ub)
    return {
        "sharded_params": int(round(sum(x.sharded for x in ub))),
        "grads": int(round(grads)),
        "optimizer_states": int(round(OPTIMIZER_STATES[plan.training.optimizer] * grads)),
    }
