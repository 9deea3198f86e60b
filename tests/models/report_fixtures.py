"""Hand-made inputs for the report and export tests: a plan with a frontier and baselines, a trace of a
small decoder (embedding, N identical blocks, norm, head) and an estimate with a plausible timeline.

Numbers are invented but consistent (the timeline's peak is its largest event; the units' times are
per unit), so the plots have something real-looking to draw without the tracer or the cost model.
"""

from __future__ import annotations

from shard_planner.cost.types import Estimate, MemoryEstimate, MemoryEvent, TimeEstimate, UnitTime
from shard_planner.plan import (
    MEMORY_CATEGORIES, Cluster, FrontierPoint, Mesh, ModelRef, Plan, Prediction, Prefetch, SolverInfo, Training, Unit,
)
from shard_planner.hardware.profile import load_profile
from shard_planner.trace.types import Affine, ModelTrace, ModuleTrace

GIB = 2**30
MIB = 2**20


def _module(fqn, type_name, parent, children, h, params, *, saved=0.0, inp=0.0, flops=0.0):
    return ModuleTrace(
        fqn=fqn, type_name=type_name, parent=parent, children=tuple(children), structural_hash=h,
        param_count=params, param_bytes_by_dtype={"float32": 4 * params} if params else {}, buffer_bytes=0,
        calls=1, input_bytes=Affine(0, inp), output_bytes=Affine(0, inp), saved_bytes_self=Affine(0, saved),
        fwd_flops_self=Affine(0, flops), bwd_flops_self=Affine(0, 2 * flops),
        fwd_peak_rise_bytes=Affine(0, saved), bwd_peak_rise_bytes=Affine(0, saved),
    )


def make_trace(n_blocks: int = 8, *, block_params: int = 50_000_000, path: str = "examples/gpt2.py") -> ModelTrace:
    """root: wte, blocks (ModuleList of n_blocks Block), ln_f, lm_head."""
    blocks = [f"blocks.{i}" for i in range(n_blocks)]
    mods = [
        _module("", "GPT", None, ["wte", "blocks", "ln_f", "lm_head"], "root", 0),
        _module("wte", "Embedding", "", [], "emb", 40_000_000, saved=2 * MIB, inp=MIB),
        _module("blocks", "ModuleList", "", blocks, "list", 0),
        *[_module(b, "Block", "blocks", [], "block", block_params, saved=300 * MIB, inp=24 * MIB, flops=4e12)
          for b in blocks],
        _module("ln_f", "LayerNorm", "", [], "ln", 2048, saved=24 * MIB, inp=24 * MIB),
        _module("lm_head", "Linear", "", [], "head", 0, saved=400 * MIB, inp=24 * MIB, flops=2e12),
    ]
    return ModelTrace(
        model_path=path, model_class="GPT", compute_dtype="bfloat16", batch_sizes=(1, 2), tokens_per_sample=1024,
        modules=tuple(mods), forward_order=tuple(m.fqn for m in mods),
        backward_order=tuple(reversed([m.fqn for m in mods])), batch_input_bytes=Affine(0, 16384),
        loss_saved_bytes=Affine(0, 0), loss_peak_rise_bytes=Affine(0, 800 * MIB), loss_flops=Affine(0, 0),
        fingerprint="feedfacecafebeef",
    )


def make_plan(n_blocks: int = 8, *, group: int = 1, checkpoint_every: int = 2, frontier: int = 6,
              path: str = "examples/gpt2.py", budget_gib: float = 40.0, predicted: bool = True) -> Plan:
    units = [Unit(("",), reshard_after_forward=False), Unit(("wte",))]
    for i in range(0, n_blocks, group):
        mods = tuple(f"blocks.{j}" for j in range(i, min(i + group, n_blocks)))
        units.append(Unit(mods, reshard_after_forward=True, activation_checkpoint=(i // group) % checkpoint_every == 0
                          if checkpoint_every else False))
    units.append(Unit(("lm_head",), reshard_after_forward=False))
    # The chosen plan is the fastest frontier point within the budget.
    usable = budget_gib * load_profile("h100-80gb").usable_fraction  # what the planner fills of --mem
    fitting = [k for k in range(frontier) if 18 + 5 * k <= usable] or [0]
    chosen_peak, chosen_step = int((18 + 5 * fitting[-1]) * GIB), 1.55 - 0.07 * fitting[-1]
    pts = tuple(
        FrontierPoint(int((18 + 5 * k) * GIB), 1.55 - 0.07 * k, f"frontier plan {k + 1}",
                      fits=(18 + 5 * k) <= usable)
        for k in range(frontier))
    baselines = (
        FrontierPoint(int(34.0 * GIB), 1.38, "torchtitan default (per block, reshard)"),
        FrontierPoint(int(36.5 * GIB), 1.41, "Accelerate TRANSFORMER_BASED_WRAP"),
        FrontierPoint(int(29.0 * GIB), 1.70, "Accelerate SIZE_BASED_WRAP (1e8)"),
        FrontierPoint(int(55.0 * GIB), 1.10, "no reshard (ZeRO-2-like)", fits=False),
        FrontierPoint(int(21.0 * GIB), 1.62, "full activation checkpointing"),
    )
    pred = Prediction(
        peak_bytes=chosen_peak, step_time_s=chosen_step,
        memory_at_peak={"sharded_params": 3 * GIB, "unsharded_params": 2 * GIB, "grads": 3 * GIB,
                        "optimizer_states": 6 * GIB, "activations": chosen_peak - 17 * GIB, "temporaries": GIB,
                        "comm_buffers": GIB, "overhead": GIB},
        samples_per_s=8 * 8 / chosen_step, tokens_per_s=8 * 8 * 1024 / chosen_step, exposed_comm_s=0.08, mfu=0.41)
    return Plan(
        model=ModelRef(path, "feedfacecafebeef", seq_len=1024),
        cluster=Cluster(gpus=8, gpus_per_node=8, profile="h100-80gb", mem_budget_bytes=int(budget_gib * GIB)),
        mesh=Mesh(shard=8), training=Training(micro_batch=8), units=tuple(units),
        prefetch=Prefetch(forward=2, backward=1),
        predicted=pred if predicted else None,
        solver=SolverInfo("cp-sat", "OPTIMAL", chosen_step, 0.31),
        frontier=pts, baselines=baselines,
    )


def make_estimate(plan: Plan) -> Estimate:
    """A timeline shaped like FSDP2's: all-gather and forward per unit, loss, backward with reduce-scatters,
    optimizer step. The peak is at the start of backward (activations and gradients both live)."""
    inner = [u for u in plan.units if not u.is_root]
    const = {"sharded_params": 3 * GIB, "optimizer_states": 6 * GIB, "overhead": GIB}
    events, act, grads = [], 0, 0

    def ev(label, phase, **kw):
        d = {c: 0 for c in MEMORY_CATEGORIES}
        d.update(const)
        d.update(activations=act, grads=grads, **kw)
        events.append(MemoryEvent(label, phase, d))

    for u in inner:
        ev(f"forward: all-gather {u.name}", "forward", unsharded_params=GIB, comm_buffers=GIB // 2)
        act += (GIB // 2) if u.activation_checkpoint else int(1.5 * GIB)
        ev(f"forward: {u.name}", "forward", unsharded_params=GIB)
    ev("loss", "forward", temporaries=2 * GIB)
    for u in reversed(inner):
        ev(f"backward: all-gather {u.name}", "backward", unsharded_params=2 * GIB, comm_buffers=GIB // 2)
        act -= (GIB // 2) if u.activation_checkpoint else int(1.5 * GIB)
        grads += GIB // 3
        ev(f"backward: reduce-scatter {u.name}", "backward", unsharded_params=GIB, comm_buffers=GIB)
    ev("optimizer step", "optimizer", temporaries=GIB)
    peak = max(events, key=lambda e: e.total_bytes)
    memory = MemoryEstimate(peak.total_bytes, dict(peak.bytes_by_category), peak.label, tuple(events))
    units = tuple(UnitTime(u.name, 0.020 + 0.001 * (i % 3), 0.045 if u.activation_checkpoint else 0.040,
                           0.018, 0.012, 0.004 if i == 0 else 0.0) for i, u in enumerate(plan.units))
    time = TimeEstimate(step_time_s=1.2, compute_s=1.0, comm_s=0.4, exposed_comm_s=0.08, optimizer_s=0.05,
                        samples_per_s=53.3, tokens_per_s=54613.0, mfu=0.41, units=units)
    return Estimate(memory, time)
