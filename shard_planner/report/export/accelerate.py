"""Export a plan as an Accelerate config file (``accelerate launch --config_file``), FSDP2 flavour.

Keys (Accelerate's FSDP2 guide, docs/source/concept_guides/fsdp1_vs_fsdp2.md, and its
config_yaml_templates/fsdp.yaml): ``fsdp_version: 2``; ``fsdp_reshard_after_forward`` (a bool; it
replaces FSDP1's sharding strategy); ``fsdp_auto_wrap_policy`` with ``fsdp_transformer_layer_cls_to_wrap``
(comma-separated class names) or ``fsdp_min_num_params``; ``fsdp_activation_checkpointing`` (applied to
the wrapped layers); ``fsdp_offload_params``; ``mixed_precision`` at the top level; HSDP through
``parallelism_config`` (``parallelism_config_dp_replicate_size`` / ``_dp_shard_size``). Accelerate's
FSDP2 has no forward prefetch option and always prefetches one unit in backward.

What Accelerate cannot say (grouped units, per-unit reshard or checkpointing, prefetch depth, units of a
class that also occurs elsewhere) is written as comments at the top of the file with the nearest setting
used; the nearest setting is always the one that needs no more memory than the plan.
"""

from __future__ import annotations

from shard_planner import __version__
from shard_planner.checkpointing import SELECTIVE
from shard_planner.plan import Plan
from shard_planner.report.export.accumulation import accelerate_lines, policy_notes
from shard_planner.report.export.common import (
    Export, comment_block, emit_yaml, grouped_note, prefetch_notes, uniform_reshard,
)
from shard_planner.report.export.model_info import ModelInfo

_MIXED_PRECISION = {"bfloat16": "bf16", "float16": "fp16", "float32": "no"}


def wrap_classes(plan: Plan, info: ModelInfo) -> tuple[list[str], list[str]]:
    """Classes that name the plan's units exactly (every module of the class is a unit module), and notes
    for units whose class also occurs outside the plan's units (naming it would wrap those too)."""
    unit_modules = {f for u in plan.inner_units for f in u.modules}
    by_class: dict[str, list[str]] = {}
    for m in info.modules:
        if m.fqn:
            by_class.setdefault(m.type_name, []).append(m.fqn)
    classes, notes = [], []
    for u in plan.inner_units:
        for fqn in u.modules:
            cls = info.type_of(fqn)
            if cls in classes:
                continue
            others = [f for f in by_class[cls] if f not in unit_modules]
            if others:
                note = (f"unit {fqn} ({cls}): {len(others)} other {cls} module(s) (e.g. {others[0]}) are not units; "
                        f"naming {cls} would wrap them too, so {fqn} is left to the root unit")
                if note not in notes:
                    notes.append(note)
            else:
                classes.append(cls)
    return classes, notes


def export_accelerate(plan: Plan, info: ModelInfo) -> Export:
    notes: list[str] = []
    classes, class_notes = wrap_classes(plan, info)
    notes += class_notes
    fsdp: dict = {"fsdp_version": 2}
    if classes:
        fsdp["fsdp_auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"
        fsdp["fsdp_transformer_layer_cls_to_wrap"] = ",".join(classes)
        wrapped = [u for u in plan.inner_units if all(info.type_of(f) in classes for f in u.modules)]
    else:
        counts = [c for u, c in zip(plan.units, info.unit_param_counts(plan)) if not u.is_root]
        smallest = min(counts) if counts else 0
        fsdp["fsdp_auto_wrap_policy"] = "SIZE_BASED_WRAP" if counts else "NO_WRAP"
        if counts:
            fsdp["fsdp_min_num_params"] = smallest
            notes.append(f"no class names the plan's units exactly: size-based wrapping at the smallest unit's "
                         f"{smallest:,} parameters approximates them (its units may differ from the plan's)")
        wrapped = list(plan.inner_units)

    reshard, reshard_notes = uniform_reshard(plan)
    notes += reshard_notes
    fsdp["fsdp_reshard_after_forward"] = reshard

    ac = [bool(u.activation_checkpoint) for u in wrapped]
    fsdp["fsdp_activation_checkpointing"] = any(ac)
    if any(ac) and not all(ac):
        notes.append(f"the plan checkpoints {sum(ac)} of {len(ac)} wrapped units: Accelerate checkpoints all or none; "
                     "using all (less memory, more recomputation than the plan)")
    selective = [u.name for u in wrapped if u.activation_checkpoint == SELECTIVE]
    if selective:
        notes.append(f"the plan checkpoints {len(selective)} unit(s) selectively (saving matmul and attention "
                     "outputs): Accelerate's fsdp_activation_checkpointing is full checkpointing only; it has no "
                     "per-op policy (apply torch.utils.checkpoint's create_selective_checkpoint_contexts in code, "
                     "as the fsdp2 export does)")
    unwrapped_ac = [u.name for u in plan.inner_units if u.activation_checkpoint and u not in wrapped]
    if unwrapped_ac:
        notes.append(f"checkpointed unit(s) {', '.join(unwrapped_ac)} are not wrapped by class: not checkpointed here")
    notes += grouped_note(plan)
    notes += prefetch_notes(plan, where="Accelerate's FSDP2")
    notes += policy_notes(plan, "Accelerate", syncs_every_step=False)
    fsdp["fsdp_offload_params"] = plan.training.cpu_offload
    fsdp["fsdp_cpu_ram_efficient_loading"] = True
    fsdp["fsdp_state_dict_type"] = "SHARDED_STATE_DICT"
    t = plan.training
    if t.param_dtype != "float32" and t.reduce_dtype == "float32":
        notes.append(f"the plan computes in {t.param_dtype} and reduces gradients in float32; check that your "
                     "Accelerate version's FSDP2 mixed-precision policy does, or pass FullyShardedDataParallelPlugin("
                     "mixed_precision_policy=MixedPrecisionPolicy(param_dtype=..., reduce_dtype=torch.float32)) in code")

    config: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "mixed_precision": _MIXED_PRECISION[t.param_dtype],
        "num_machines": max(1, plan.cluster.gpus // plan.cluster.gpus_per_node),
        "num_processes": plan.cluster.gpus,
        "machine_rank": 0,
        "fsdp_config": fsdp,
    }
    if plan.mesh.replicate > 1:
        config["parallelism_config"] = {"parallelism_config_dp_replicate_size": plan.mesh.replicate,
                                        "parallelism_config_dp_shard_size": plan.mesh.shard}
    header = [
        f"Accelerate FSDP2 config for {plan.model.path} on {plan.cluster.gpus} GPUs, generated by shard-planner "
        f"{__version__} (model fingerprint {plan.model.fingerprint}).",
        "Use: accelerate launch --config_file THIS_FILE train.py",
        f"Per-device batch size of the plan: {t.micro_batch} (set it in your DataLoader or "
        "TrainingArguments.per_device_train_batch_size; Accelerate configs do not hold it).",
        *accelerate_lines(plan),
    ]
    if notes:
        header += ["", "Where the plan cannot be expressed exactly (the nearest setting is used below):"]
        header += [f"- {n}" for n in notes]
    else:
        header += ["", "Every decision of the plan is expressed exactly."]
    text = "\n".join(comment_block(header) + emit_yaml(config)) + "\n"
    return Export("accelerate", text, ".yaml", tuple(notes))
