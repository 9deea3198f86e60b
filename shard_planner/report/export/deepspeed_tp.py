"""A tensor-parallel plan in the DeepSpeed config: AutoTP training (``tensor_parallel``) under ZeRO-3.

    section, notes = autotp_section(plan)   # ({}, []) without tensor parallelism
    local = autotp_local_info(plan, info)   # parameter counts per tp rank, for the ZeRO-3 sizes

[Note: DeepSpeed 0.19.8 AutoTP] (file:line in the installed deepspeed 0.19.8)
- AutoTP training with ZeRO-3 is supported: ``tensor_parallel.autotp_size`` > 1 splits the model in
  ``deepspeed.initialize`` (runtime/engine.py:595-600, :952-955 "AutoTP + ZeRO stage 3 is supported for both
  inference and training"), and ZeRO-3 partitions each rank's split parameters over the data-parallel group
  (module_inject/auto_tp.py:512-522 ``_gather_zero3_params``): the plan's FSDP over the dp ranks after the
  tp split.
- ``partition_config.layer_specs`` names the split of each parameter by regular expression (``re.match`` on
  the parameter's name: autotp_config.py:215-226), ``partition_type`` "column" (output dimension split: the
  plan's ``colwise``), "row" (input dimension split, output all-reduced: ``rowwise`` without sequence
  parallelism) or "skip" (autotp_config.py:20-24); ``use_default_specs`` false keeps DeepSpeed's own
  patterns out (runtime/tensor_parallel/config.py:133-140), and a Linear no pattern matches stays whole
  (auto_tp.py:494-499). A column spec with ``gather_output`` all-gathers its output: the plan's ``head``
  without loss parallelism.
- ``vocab_parallel_lm_head`` true keeps the output layer's logits split on the vocabulary into a
  vocabulary-parallel loss (the plan's loss parallelism), for the layer ``lm_head_patterns`` names
  (auto_tp.py:676-687); the loss is installed as the model's ``loss_function`` hook, which a model must have
  (sequence/cross_entropy.py:428-431: transformers' causal LMs have it).
- There is no Megatron-style sequence parallelism in AutoTP (its specs are column, row or skip; DeepSpeed's
  sequence parallelism is Ulysses, which splits attention heads by all-to-all, another scheme), and an
  ``nn.Embedding`` a spec matches is split on its hidden dimension (auto_tp.py:886-913, ``_slice_embedding``:
  ``split(..., dim=1)``), not on the vocabulary as the plan's ``embedding`` style: the plan's ``norm``, ``gather_input`` and
  ``embedding`` styles have no AutoTP equivalent.
- Without an mpu, DeepSpeedConfig checks train_batch_size = micro-batch x accumulation x every rank
  (runtime/config.py:466-471, :602-605), tp ranks included, where the tp ranks of a group share one
  micro-batch: the export leaves train_batch_size for DeepSpeed to derive.
"""

from __future__ import annotations

import re
from dataclasses import replace

from shard_planner.plan import Plan
from shard_planner.report.export.common import split_number
from shard_planner.report.export.model_info import ModelInfo
from shard_planner.parallel.tensor_parallel import Style

_SPEC_TYPE = {Style.COLWISE: "column", Style.ROWWISE: "row"}


def weight_pattern(fqn: str) -> str:
    """The regular expression for ``fqn``'s weight and every module numbered alike (``layers.0.attention.wq`` ->
    ``(?:.*\\.)?layers\\.\\d+\\.attention\\.wq\\.weight$``), under any prefix DeepSpeed's walk gives it."""
    parsed = split_number(fqn)
    body = re.escape(fqn) if parsed is None else re.escape(parsed[0]) + r"\d+" + re.escape(parsed[2])
    return r"(?:.*\.)?" + body + r"\.weight$"


def _layer_specs(plan: Plan) -> list[dict]:
    """One spec per partition type, its patterns in the plan's order (deduplicated); the head's without loss
    parallelism (a column split whose output is gathered)."""
    tp = plan.tensor_parallel
    specs: dict[str, list[str]] = {}
    for fqn, style in tp.styles_by_fqn.items():
        if style.style in _SPEC_TYPE:
            patterns = specs.setdefault(_SPEC_TYPE[style.style], [])
            if weight_pattern(fqn) not in patterns:
                patterns.append(weight_pattern(fqn))
    out = [{"patterns": patterns, "partition_type": kind} for kind, patterns in specs.items()]
    if tp.head_fqn is not None and not tp.loss_parallel:
        out.append({"patterns": [weight_pattern(tp.head_fqn)], "partition_type": "column", "gather_output": True})
    return out


def _split_by_autotp(plan: Plan) -> set[str]:
    """The modules whose weight the ``tensor_parallel`` section splits: colwise, rowwise and the head."""
    return {f for f, s in plan.tensor_parallel.styles_by_fqn.items() if s.style in (*_SPEC_TYPE, Style.HEAD)}


def autotp_local_info(plan: Plan, info: ModelInfo) -> ModelInfo:
    """``info`` as one tp rank holds the model after AutoTP's split: each split module's weight (its first
    tensor; the whole module when its tensors are unknown) / tp. ZeRO-3 fetches and partitions these local
    tensors, so its sizes (report/export/deepspeed.py ``derive_zero3``) are counted on them."""
    if plan.tensor_parallel is None:
        return info
    mesh, split = plan.mesh, _split_by_autotp(plan)

    def local(m):
        if m.fqn not in split or not m.param_count:
            return m
        if m.param_numels is None:
            return replace(m, param_count=mesh.tp_share(m.param_count))
        weight = mesh.tp_share(m.param_numels[0])
        return replace(m, param_count=m.param_count - m.param_numels[0] + weight,
                       param_numels=(weight, *m.param_numels[1:]))

    return ModelInfo(tuple(local(m) for m in info.modules))


def autotp_section(plan: Plan) -> tuple[dict, list[str]]:
    """The config's ``tensor_parallel`` section for ``plan`` and the notes of what it cannot say. See [Note:
    DeepSpeed 0.19.8 AutoTP]."""
    tp = plan.tensor_parallel
    if tp is None:
        return {}, []
    partition = {"use_default_specs": False, "layer_specs": _layer_specs(plan)}
    if tp.loss_parallel and tp.head_fqn is not None:
        partition["lm_head_patterns"] = [tp.head_fqn.rpartition(".")[2]]
    section = {"autotp_size": plan.mesh.tp_size, "vocab_parallel_lm_head": tp.loss_parallel,
               "partition_config": partition}
    by_style = {s: [f for f, m in tp.styles_by_fqn.items() if m.style is s] for s in Style}
    notes = [f"tensor parallelism: AutoTP over {plan.mesh.tp_size} ranks under ZeRO-3 over the other "
             f"{plan.mesh.dp_size} (the sizes above count one tp rank's parameters: split weights / "
             f"{plan.mesh.tp_size}); train_batch_size is left to DeepSpeed, which counts every rank (micro-batch x "
             f"accumulation x {plan.mesh.world_size}) where the plan's global batch is {plan.global_batch_samples} "
             "samples (the tp ranks of a group share one micro-batch)"]
    if tp.sequence_parallel:
        notes.append(f"the plan's sequence parallelism ({len(by_style[Style.NORM])} norms, "
                     f"{len(by_style[Style.GATHER_INPUT])} gathered inputs) cannot be expressed: AutoTP has none, so "
                     "activations between the split regions are whole on every tp rank (more activation memory than "
                     "the plan) and rowwise outputs are all-reduced instead of reduce-scattered")
    if by_style[Style.EMBEDDING]:
        notes.append(f"the plan splits the embedding {by_style[Style.EMBEDDING][0]} on the vocabulary; AutoTP splits an "
                     "embedding on its hidden dimension, a different layout: left whole on every tp rank (its "
                     f"parameters, gradients and optimizer states {plan.mesh.tp_size}x the plan's per rank)")
    if by_style[Style.GRAD_ALL_REDUCE]:
        notes.append(f"the plan keeps {len(by_style[Style.GRAD_ALL_REDUCE])} modules whole on every tp rank and sums "
                     f"their weight gradients over the tp group ({by_style[Style.GRAD_ALL_REDUCE][0]}: transformers' "
                     "replicated_with_grad_allreduce, a per-head norm that sees this rank's heads); AutoTP's config "
                     "has no such setting: without that sum each tp rank trains its own copy of those weights")
    if tp.loss_parallel:
        notes.append("loss parallelism: vocab_parallel_lm_head installs DeepSpeed's vocabulary-parallel loss as the "
                     "model's loss_function hook, which the model must have (transformers' causal LMs do); a model "
                     "without one is refused by deepspeed.initialize: set vocab_parallel_lm_head false and add the "
                     "head's pattern as a column spec with gather_output true (logits gathered: more memory)")
    return section, notes
