"""Export a plan as a DeepSpeed ZeRO-3 config (JSON) whose parameter-fetch limits come from the plan.

ZeRO-3 has no units: it fetches parameters ahead by volume, in elements. The plan's units give those
volumes (``p_i``: parameters unit i owns, forward order, the root excluded; ``k``: the plan's prefetch
depth, ``max(forward, backward, 1)``, since FSDP2 always prefetches one unit in backward):

- ``stage3_prefetch_bucket_size`` = max_i (p_{i+1} + ... + p_{i+k}): the parameters the plan has in
  flight ahead of the running unit;
- ``stage3_max_live_parameters`` = (parameters of units kept gathered after forward: reshard False,
  the root included when it does not reshard) + max_i (p_i + ... + p_{i+k}): the running unit and its
  prefetched successors;
- ``stage3_param_persistence_threshold``: ZeRO-3 never partitions parameters up to this size. The
  plan keeps the root unit's parameters (norms, small heads) gathered for the whole step when the root
  does not reshard: the largest parameter count of a module the root owns; 0 when the root reshards;
- ``reduce_bucket_size`` = max_i p_i: FSDP2 reduce-scatters one unit's gradients at a time;
- ``stage3_max_reuse_distance``: 0 when every unit reshards after forward (always re-fetch in
  backward), the whole model when none does (keep until backward), else 0 (the plan's mix has no
  ZeRO-3 equivalent; noted);
- ``zero_hpz_partition_size`` (ZeRO++ hierarchical partitioning, the equivalent of an int
  ``reshard_after_forward``): the plan's int when all units that reshard use the same one.

Plus bf16/fp16 from the plan's param dtype, the micro-batch, gradient clipping off (0.0, as the
executor trains), the plan's gradient accumulation steps and global batch (``train_batch_size``), CPU offload of parameters and optimizer when planned, and
the optimizer (Adam/AdamW with the plan's learning rate; SGD is left to the training script).
"""

from __future__ import annotations

import json

from shard_planner import __version__
from shard_planner.checkpointing import SELECTIVE
from shard_planner.plan import Plan
from shard_planner.report.export.accumulation import policy_notes
from shard_planner.report.export.common import Export
from shard_planner.report.export.model_info import ModelInfo


def _window_max(values: list[int], width: int) -> int:
    """Largest sum of ``width`` consecutive values (all of them when fewer)."""
    if not values:
        return 0
    width = min(width, len(values))
    return max(sum(values[i:i + width]) for i in range(len(values) - width + 1))


def derive_zero3(plan: Plan, info: ModelInfo) -> tuple[dict, list[str]]:
    """The zero_optimization settings and how each was derived (one line per key)."""
    counts = info.unit_param_counts(plan)
    inner = [(u, c) for u, c in zip(plan.units, counts) if not u.is_root]
    p = [c for _, c in inner]
    k = max(plan.prefetch.forward, plan.prefetch.backward, 1)
    kept = sum(c for u, c in inner if u.reshard_after_forward is False)
    root_index = plan.units.index(plan.root)
    if plan.root.reshard_after_forward is False:
        kept += counts[root_index]
        root_sizes = [m.param_count for m in info.owned_modules(plan, root_index) if m.param_count]
        persistence = max(root_sizes, default=0)
    else:
        persistence = 0
    prefetch_bucket = _window_max(p[1:], k) if len(p) > 1 else 0
    max_live = kept + _window_max(p, k + 1)
    reduce_bucket = max(p, default=counts[root_index])
    reshards = [u.reshard_after_forward for u, _ in inner]
    total = sum(counts)
    if all(r is not False for r in reshards):
        reuse, reuse_how = 0, "0: every unit reshards after forward, so ZeRO-3 re-fetches in backward"
    elif all(r is False for r in reshards):
        reuse, reuse_how = total, f"{total:,} (the whole model): no unit reshards after forward"
    else:
        reuse, reuse_how = 0, "0: the plan keeps some units gathered and reshards others, which ZeRO-3 cannot say per unit"
    zero = {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": reduce_bucket,
        "stage3_prefetch_bucket_size": prefetch_bucket,
        "stage3_max_live_parameters": max_live,
        "stage3_max_reuse_distance": reuse,
        "stage3_param_persistence_threshold": persistence,
    }
    how = [
        f"unit sizes (parameters, forward order, root excluded): {_summarise(p)}; prefetch depth k = {k}",
        f"stage3_prefetch_bucket_size = {prefetch_bucket:,}: the largest {k} consecutive units after the running one",
        f"stage3_max_live_parameters = {max_live:,}: {kept:,} kept gathered (reshard False) + the largest "
        f"{k + 1} consecutive units",
        f"stage3_param_persistence_threshold = {persistence:,}: "
        + ("the largest module the non-resharding root unit owns" if persistence else "0, the root reshards or owns nothing"),
        f"reduce_bucket_size = {reduce_bucket:,}: the largest unit (one reduce-scatter per unit)",
        f"stage3_max_reuse_distance = {reuse_how}",
    ]
    ints = sorted({r for r in reshards if not isinstance(r, bool)})
    if len(ints) == 1 and all(r is not False for r in reshards):
        zero["zero_hpz_partition_size"] = ints[0]
        how.append(f"zero_hpz_partition_size = {ints[0]}: the plan's partial reshard (ZeRO++ hpZ)")
    elif ints:
        how.append(f"partial reshards to {ints} ranks mixed with other settings: no hpZ (ZeRO++) set")
    return zero, how


def _summarise(values: list[int]) -> str:
    if not values:
        return "none"
    if len(set(values)) == 1:
        return f"{len(values)} x {values[0]:,}"
    return f"{len(values)} units, {min(values):,} to {max(values):,}"


def _checkpointing_notes(plan: Plan) -> list[str]:
    """DeepSpeed's ``activation_checkpointing`` section configures ``deepspeed.checkpointing.checkpoint``,
    which the model code calls around the modules it checkpoints (full recomputation); it has no per-op
    (selective) policy, so neither can be written into this config."""
    full = [u.name for u in plan.inner_units if u.activation_checkpoint is True]
    selective = [u.name for u in plan.inner_units if u.activation_checkpoint == SELECTIVE]
    notes = []
    if full:
        notes.append(f"the plan checkpoints {len(full)} unit(s) fully: wrap those modules' forward in "
                     "deepspeed.checkpointing.checkpoint (or torch.utils.checkpoint) in the model code")
    if selective:
        notes.append(f"the plan checkpoints {len(selective)} unit(s) selectively (matmul and attention outputs "
                     "kept): DeepSpeed has no per-op checkpointing policy; use torch.utils.checkpoint with "
                     "create_selective_checkpoint_contexts in the model code (the fsdp2 export shows how)")
    return notes


def export_deepspeed(plan: Plan, info: ModelInfo) -> Export:
    t = plan.training
    zero, how = derive_zero3(plan, info)
    if t.cpu_offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    # ZeRO-3 has no units: grouping and prefetch are expressed through the sizes above
    notes: list[str] = policy_notes(plan, "ZeRO-3", syncs_every_step=True, fsdp2=False)
    if plan.mesh.replicate > 1:
        notes.append(f"HSDP ({plan.mesh.replicate} replicas x {plan.mesh.shard}-way sharding): ZeRO-3 shards over "
                     "all ranks; MiCS (mics_shard_size) is DeepSpeed's closest; mics_shard_size is set")
        zero["mics_shard_size"] = plan.mesh.shard
    notes += _checkpointing_notes(plan)
    config = {
        "_comment": [f"DeepSpeed ZeRO-3 config for {plan.model.path} on {plan.cluster.gpus} GPUs, generated by "
                     f"shard-planner {__version__} (model fingerprint {plan.model.fingerprint}). Sizes are in "
                     "parameters (elements), derived from the plan's units:", *how, *notes],
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.accumulation_steps,
        "train_batch_size": plan.global_batch_samples,  # micro-batch x accumulation steps x ranks
        "gradient_clipping": 0.0,
        "bf16": {"enabled": t.param_dtype == "bfloat16"},
        "fp16": {"enabled": t.param_dtype == "float16"},
        "zero_optimization": zero,
    }
    if t.optimizer in ("adam", "adamw"):
        config["optimizer"] = {"type": "AdamW" if t.optimizer == "adamw" else "Adam", "params": {"lr": t.lr}}
    if t.param_dtype != "float32" and t.reduce_dtype == "float32":
        config["communication_data_type"] = "fp32"
    return Export("deepspeed", json.dumps(config, indent=2) + "\n", ".json", tuple(notes))


__all__ = ["derive_zero3", "export_deepspeed"]
