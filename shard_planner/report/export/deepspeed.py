"""Export a plan as a DeepSpeed ZeRO-3 config (JSON) whose parameter-fetch limits come from the plan.

ZeRO-3 has no units: it fetches parameters ahead by volume, in elements. The plan's units give those
volumes (``p_i``: parameters unit i owns, forward order, the root excluded; ``k``: the plan's prefetch
depth, ``max(forward, backward, 1)``, since FSDP2 always prefetches one unit in backward):

- ``stage3_prefetch_bucket_size`` = max_i (p_{i+1} + ... + p_{i+k}): the parameters the plan has in
  flight ahead of the running unit;
- ``stage3_max_live_parameters`` = (parameters of units kept gathered after forward: reshard False,
  the root included when it does not reshard) + max_i (p_i + ... + p_{i+k}): the running unit and its
  prefetched successors;
- ``stage3_param_persistence_threshold``: ZeRO-3 never partitions a parameter TENSOR of at most this
  many elements (see [Note: ZeRO-3 persistence is per tensor]). The plan keeps whole only what the
  non-resharding root owns, so: the largest root-owned tensor smaller than every tensor the other units
  own; 0 when the root reshards or no root tensor is that small;
- ``reduce_bucket_size`` = max_i p_i: FSDP2 reduce-scatters one unit's gradients at a time;
- ``stage3_max_reuse_distance``: 0 when every unit reshards after forward (always re-fetch in
  backward), the whole model when none does (keep until backward), else 0 (the plan's mix has no
  ZeRO-3 equivalent; noted);
- ``zero_hpz_partition_size`` (ZeRO++ hierarchical partitioning, the equivalent of an int
  ``reshard_after_forward``): the plan's int when all units that reshard use the same one.

Plus bf16/fp16 from the plan's param dtype, the micro-batch, gradient clipping off (0.0, as the
executor trains), the plan's gradient accumulation steps and global batch (``train_batch_size``), CPU offload of parameters and optimizer when planned, and
the plan's optimizer with its learning rate (``plan.training.lr``). A tensor-parallel plan adds AutoTP's
``tensor_parallel`` section (report/export/deepspeed_tp.py, [Note: DeepSpeed 0.19.8 AutoTP]).
"""

from __future__ import annotations

import json

from shard_planner import __version__
from shard_planner.plan.checkpointing import SELECTIVE
from shard_planner.plan import OPTIMIZER_TORCH, Plan
from shard_planner.report.export.accumulation import policy_notes
from shard_planner.report.export.common import Export, allocator_line, finetune_notes, loss_notes
from shard_planner.report.export.deepspeed_tp import autotp_local_info, autotp_section
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
    persistence, persistence_how = _persistence_threshold(plan, info)
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
        f"stage3_param_persistence_threshold = {persistence:,}: {persistence_how}",
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


# [Note: ZeRO-3 persistence is per tensor] DeepSpeed marks a parameter persistent (never partitioned,
# whole on every rank for the whole run) when its own element count is at most
# stage3_param_persistence_threshold (deepspeed 0.19.8, runtime/zero/parameter_offload.py,
# mark_persistent_parameters: ``param.ds_numel <= param_threshold``, per tensor of named_parameters()).
# A threshold as large as a module (e.g. Llama 8B's 525,336,576-element embedding) therefore keeps every
# tensor of the model whole: no sharding at all. Only tensors the plan keeps whole may fall under it.


def _persistence_threshold(plan: Plan, info: ModelInfo) -> tuple[int, str]:
    """stage3_param_persistence_threshold and how it was derived. See [Note: ZeRO-3 persistence is per tensor].

    Persistent: tensors of the root unit when it does not reshard (FSDP2 keeps them gathered from forward
    to backward). The threshold t must stay below the smallest tensor any other unit owns (s_min), so
    t = the largest root-owned tensor < s_min, or 0. A module whose tensor sizes are unknown (a trace
    records only totals) counts as owning a 1-element tensor on a unit, and as owning nothing on the root."""
    if plan.root.reshard_after_forward is not False:
        return 0, "0: the root unit reshards after forward, so every tensor is partitioned"
    root_index = plan.units.index(plan.root)
    owners = info.unit_owners(plan)
    def tensors(on_root: bool) -> list[int]:
        unknown = () if on_root else (1,)  # see the docstring: never more persistence than known
        return [n for m in info.modules if m.param_count and (owners[m.fqn] == root_index) == on_root
                for n in (m.param_numels if m.param_numels is not None else unknown)]

    smallest = min(tensors(on_root=False), default=None)
    root_tensors = tensors(on_root=True)
    below = [n for n in root_tensors if smallest is None or n < smallest]
    if smallest is None:  # the root is the only unit: FSDP2 keeps the whole model gathered in the step
        return max(below, default=0), "the largest tensor: the root is the plan's only unit and does not reshard"
    if not below:
        return 0, (f"0: no tensor of the root unit is smaller than the smallest tensor of the other units "
                   f"({smallest:,}), so none can stay whole without keeping a unit's tensors whole too")
    return max(below), (f"the largest root-owned tensor smaller than every tensor of the other units (the smallest: "
                        f"{smallest:,}): ZeRO-3 keeps the {len(below)} root tensor(s) up to it whole, as the "
                        "non-resharding root unit does, and partitions every other tensor")


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


# [Note: DeepSpeed's Adam is not torch's] For optimizer type "Adam"/"AdamW" DeepSpeed builds its own
# FusedAdam (or DeepSpeedCPUAdam under offload) with its own defaults, weight_decay 0.0 for AdamW too
# (deepspeed 0.19.8, runtime/engine.py get_optimizer_configuration; ops/adam/fused_adam.py), where the
# plan's optimizer is torch.optim.AdamW with PyTorch's defaults (weight_decay 0.01). Any other type is
# getattr(torch.optim, type)(params, **params) (engine.py _configure_basic_optimizer), PyTorch's defaults.


def _optimizer_section(plan: Plan) -> dict:
    """The plan's optimizer (shard_planner.plan.OPTIMIZER_TORCH) and learning rate; for Adam(W) with
    torch's defaults written out, see [Note: DeepSpeed's Adam is not torch's]."""
    import inspect

    import torch

    cls, kwargs = OPTIMIZER_TORCH[plan.training.optimizer]
    params = {"lr": plan.training.lr, **kwargs}
    if cls in ("Adam", "AdamW"):
        defaults = inspect.signature(getattr(torch.optim, cls)).parameters
        params.update({k: _json_value(defaults[k].default) for k in ("betas", "eps", "weight_decay")})
    return {"type": cls, "params": params}


def _json_value(value):
    return list(value) if isinstance(value, tuple) else value


def export_deepspeed(plan: Plan, info: ModelInfo) -> Export:
    t = plan.training
    numerics = t.numerics  # the plan's dtypes (plan/numerics.py)
    zero, how = derive_zero3(plan, autotp_local_info(plan, info))  # per tp rank with tensor parallelism
    if t.cpu_offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    # ZeRO-3 has no units: grouping and prefetch are expressed through the sizes above
    notes: list[str] = policy_notes(plan, "ZeRO-3", syncs_every_step=True, fsdp2=False)
    notes += finetune_notes(plan, "DeepSpeed", expressible=True) + loss_notes(plan, "DeepSpeed")
    if plan.mesh.is_hsdp:  # DeepSpeed 0.19.8 rejects mics_shard_size (runtime/config.py:119-122, _reject_removed_config_keys)
        notes.append(f"HSDP ({plan.mesh.replicate_group_size} replicas x {plan.mesh.shard_group_size}-way sharding) "
                     f"cannot be expressed: ZeRO-3 shards over all {plan.mesh.dp_size} data-parallel ranks (DeepSpeed "
                     "0.19.8 removed MiCS, its sharding within groups, and refuses mics_shard_size): less memory per "
                     "rank than the plan, its all-gathers and reduce-scatters across the replicas too")
    notes += _checkpointing_notes(plan)
    tensor_parallel, tp_notes = autotp_section(plan)
    notes += tp_notes
    config = {
        "_comment": [f"DeepSpeed ZeRO-3 config for {plan.model.path} on {plan.cluster.gpus} GPUs, generated by "
                     f"shard-planner {__version__} (model fingerprint {plan.model.fingerprint}). Sizes are in "
                     "parameters (elements), derived from the plan's units:", *how, *notes,
                     allocator_line(plan, "deepspeed train.py --deepspeed_config THIS_FILE")],
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.accumulation_steps,
        "train_batch_size": plan.global_batch_samples,  # micro-batch x accumulation steps x ranks
        "gradient_clipping": 0.0,
        "bf16": {"enabled": numerics.compute_dtype == "bfloat16"},
        "fp16": {"enabled": numerics.compute_dtype == "float16"},
        "zero_optimization": zero,
    }
    if tensor_parallel:  # DeepSpeed derives train_batch_size over every rank: see deepspeed_tp.py
        del config["train_batch_size"]
        config["tensor_parallel"] = tensor_parallel
    config["optimizer"] = _optimizer_section(plan)
    if config["optimizer"]["type"] not in ("Adam", "AdamW"):  # ZeRO refuses others unless told (engine.py)
        config["zero_allow_untested_optimizer"] = True
    if numerics.compute_dtype != "float32" and numerics.reduce_scatter_dtype == "float32":
        config["communication_data_type"] = "fp32"
    return Export("deepspeed", json.dumps(config, indent=2) + "\n", ".json", tuple(notes))


__all__ = ["derive_zero3", "export_deepspeed"]
