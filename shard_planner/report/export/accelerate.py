"""Export a plan as an Accelerate config file (``accelerate launch --config_file``), FSDP2 flavour.

Keys (Accelerate's FSDP2 guide, docs/source/concept_guides/fsdp1_vs_fsdp2.md, and its
config_yaml_templates/fsdp.yaml): ``fsdp_version: 2``; ``fsdp_reshard_after_forward`` (a bool; it
replaces FSDP1's sharding strategy); ``fsdp_auto_wrap_policy`` with ``fsdp_transformer_layer_cls_to_wrap``
(comma-separated class names) or ``fsdp_min_num_params``; ``fsdp_activation_checkpointing`` (applied to
the wrapped layers); ``fsdp_offload_params``; ``mixed_precision`` at the top level; HSDP through
``parallelism_config`` (``parallelism_config_dp_replicate_size`` / ``_dp_shard_size``), and tensor
parallelism's degree there too (``parallelism_config_tp_size``; see [Note: Accelerate's tensor parallelism]).
Accelerate's FSDP2 has no forward prefetch option and always prefetches one unit in backward.

What Accelerate cannot say (grouped units, per-unit reshard or checkpointing, prefetch depth, units of a
class that also occurs elsewhere) is written as comments at the top of the file with the nearest setting
used; the nearest setting is always the one that needs no more memory than the plan.
"""

from __future__ import annotations

from shard_planner import __version__
from shard_planner.plan.checkpointing import SELECTIVE
from shard_planner.plan import Plan
from shard_planner.plan.numerics import Numerics
from shard_planner.report.export.accumulation import accelerate_lines, policy_notes
from shard_planner.report.export.common import (
    TORCH_DTYPES, Export, allocator_env, allocator_line, comment_block, emit_yaml, finetune_notes, loss_notes, optimizer_call, grouped_note, prefetch_notes,
    uniform_reshard,
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


# [Note: Accelerate reduces in the compute dtype] The config file cannot say a reduce dtype: `accelerate
# launch` turns fsdp_config into FSDP_* environment variables, none of them a mixed-precision policy
# (accelerate 1.16, utils/launch.py prepare_multi_gpu_env), and AcceleratorState then calls
# FullyShardedDataParallelPlugin.set_mixed_precision(mixed_precision) (state.py), which, when the plugin
# has no policy, builds MixedPrecisionPolicy(param_dtype=d, reduce_dtype=d) with d the compute dtype
# (utils/dataclasses.py). A plugin constructed in code with mixed_precision_policy keeps its policy, and
# reads everything else from the same environment.


def _reduce_dtype_notes(numerics: Numerics) -> list[str]:
    """What Accelerate reduces gradients in, when it is not the plan's reduce dtype, and the code that
    makes it the plan's. See [Note: Accelerate reduces in the compute dtype]."""
    compute, reduce = numerics.compute_dtype, numerics.reduce_scatter_dtype
    if compute == "float32" or not numerics.reduce_casts:
        return []
    return [f"the plan reduces gradients in {reduce} (it was priced for {reduce} reduce-scatters); with "
            f"this config alone Accelerate reduce-scatters them in {compute} (its FSDP2 plugin builds "
            f"MixedPrecisionPolicy(param_dtype={compute}, reduce_dtype={compute}); the config file "
            "cannot hold a reduce dtype). To run the plan, create the Accelerator with fsdp_plugin=FullyShardedDataParallelPlugin(mixed_precision_policy="
            f"MixedPrecisionPolicy(param_dtype={TORCH_DTYPES[compute]}, reduce_dtype="
            f"{TORCH_DTYPES[reduce]})) (torch.distributed.fsdp.MixedPrecisionPolicy); the plugin reads "
            "the rest of this file from accelerate launch's environment"]


# [Note: Accelerate's tensor parallelism] (accelerate 1.16) ``ParallelismConfig`` holds dp_replicate_size,
# dp_shard_size, tp_size (and cp_size, sp_size), read from the PARALLELISM_CONFIG_* variables accelerate launch
# sets from the file's parallelism_config section (parallelism_config.py:272-277, utils/launch.py:385-387); its
# mesh is (dp_replicate, dp_shard, tp) with tp last (parallelism_config.py:256-267), the plan's layout, and
# FSDP2 shards over the dp dimensions (utils/fsdp_utils.py:769, mesh[fsdp_dim_names]); the sizes must
# multiply to the processes (parallelism_config.py:368-373). Accelerate splits no module itself: with tp_size > 1
# the model must arrive split, its tp_size set (accelerator.py:1875-1884, get_model_tp_size: utils/other.py:
# 263-283; transformers' from_pretrained(tp_plan="auto") does both), and it only wraps the parameters left whole
# as Replicate DTensors over the tp mesh (accelerator.py:1585-1605). transformers splits by the model's own
# plan, which has no sequence parallelism (shard_planner/trace/tp_styles.py [Note: Sequence parallelism's styles])
# and all-gathers the logits (e.g. LlamaForCausalLM's {"lm_head": "colwise_gather_output"}); Accelerate has
# no loss-parallel setting.


def _tp_lines(plan: Plan) -> tuple[list[str], list[str]]:
    """The header lines and notes of a tensor-parallel plan ([], [] without). See [Note: Accelerate's tensor
    parallelism]."""
    tp = plan.tensor_parallel
    if tp is None:
        return [], []
    m = plan.mesh
    header = [f"Tensor parallelism: {m.description} ({tp.description}): parallelism_config_tp_size = {m.tp_size} "
              f"below, with dp_replicate_size {m.replicate_group_size} x dp_shard_size {m.shard_group_size} = "
              f"{m.world_size} GPUs / tp {m.tp_size}; Accelerate's mesh is (dp_replicate, dp_shard, tp), as the plan's. "
              "Accelerate splits no module: split the model before accelerator.prepare (see the notes)."]
    notes = [f"Accelerate applies none of the plan's {len(tp.styles)} tensor-parallel styles: it needs the model "
             "split already, with model.tp_size set; transformers' from_pretrained(tp_plan=\"auto\") splits by the "
             "model's own plan, which is the plan's only when the plan's styles were derived from it. To run the "
             "plan's styles: apply_tensor_parallel(model, accelerator.torch_device_mesh) from the fsdp2 export "
             f"(its TP_STYLES) and model.tp_size = {plan.mesh.tp_size}, before accelerator.prepare"]
    if tp.sequence_parallel:
        notes.append("the plan uses sequence parallelism; transformers' tensor-parallel plans have none "
                     "(activations whole on every tp rank: more activation memory than the plan): only the plan's "
                     "styles applied as above keep it")
    if tp.loss_parallel:
        notes.append("the plan keeps the logits split on the vocabulary into the loss (loss parallelism); Accelerate "
                     "has no setting and transformers' plans all-gather them (colwise_gather_output): with the "
                     "plan's styles, compute the loss and its backward inside torch.distributed.tensor.parallel."
                     "loss_parallel() (the fsdp2 export's loss_context())")
    return header, notes


def _parallelism_config(plan: Plan) -> dict:
    """HSDP's and tensor parallelism's sizes (accelerate launch's parallelism_config_* options)."""
    sizes = {"parallelism_config_dp_replicate_size": plan.mesh.replicate_group_size,
             "parallelism_config_dp_shard_size": plan.mesh.shard_group_size}
    if plan.mesh.is_tp:
        sizes["parallelism_config_tp_size"] = plan.mesh.tp_size
    return sizes


def export_accelerate(plan: Plan, info: ModelInfo) -> Export:
    notes: list[str] = finetune_notes(plan, "Accelerate", expressible=True) + loss_notes(plan, "Accelerate")
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
    fsdp["fsdp_sync_module_states"] = True  # accelerate launch requires it with cpu_ram_efficient_loading
    t = plan.training
    notes += _reduce_dtype_notes(t.numerics)

    config: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "mixed_precision": _MIXED_PRECISION[t.numerics.compute_dtype],
        "num_machines": max(1, plan.cluster.gpus // plan.cluster.gpus_per_node),
        "num_processes": plan.cluster.gpus,
        "machine_rank": 0,
        "fsdp_config": fsdp,
    }
    if plan.mesh.is_hsdp or plan.mesh.is_tp:
        config["parallelism_config"] = _parallelism_config(plan)
    tp_header, tp_notes = _tp_lines(plan)
    notes += tp_notes
    header = [
        f"Accelerate FSDP2 config for {plan.model.path} on {plan.cluster.gpus} GPUs, generated by shard-planner "
        f"{__version__} (model fingerprint {plan.model.fingerprint}).",
        f"Use: {allocator_env(plan)} accelerate launch --config_file THIS_FILE train.py",
        allocator_line(plan, "accelerate launch ..."),
        f"Per-device batch size of the plan: {t.micro_batch} (set it in your DataLoader or "
        "TrainingArguments.per_device_train_batch_size; Accelerate configs do not hold it).",
        f"Optimizer of the plan: {optimizer_call(t, plan.model.finetune is not None)} (build it in your script; "
        "Accelerate configs do not hold it).",
        *accelerate_lines(plan),
        *tp_header,
    ]
    if notes:
        header += ["", "Where the plan cannot be expressed exactly (the nearest setting is used below):"]
        header += [f"- {n}" for n in notes]
    else:
        header += ["", "Every decision of the plan is expressed exactly."]
    text = "\n".join(comment_block(header) + emit_yaml(config)) + "\n"
    return Export("accelerate", text, ".yaml", tuple(notes))
