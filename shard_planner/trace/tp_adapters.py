"""LoRA adapters under tensor parallelism: a LoRA layer stands where its Linear stood, and its style goes to its parts.

    linear_of(model, "layers.0.attention.wq")        # the nn.Linear: the module, or a LoRA layer's base_layer
    with_adapters(model, {"...wq": "colwise"})        # {"...wq.base_layer": "colwise", "...wq.lora_B": "colwise"}

[Note: LoRA adapters under tensor parallelism]
  peft's LoRA layer (peft/tuners/lora/layer.py ``Linear``: the frozen ``base_layer``, ``lora_A`` and ``lora_B``
  ModuleDicts of one nn.Linear per adapter) and examples/llama_lora.py's (the same names, one adapter each, as
  plain nn.Linear) compute ``base_layer(x) + lora_B(lora_A(x)) * scaling``. Such a layer takes the place of the
  Linear it wraps, so the roles (q/k/v and output projections, gate/up and down) are found on it as on a Linear
  (trace/tp_styles.py), and the style found is then given to its parts so that the sum adds like with like on
  every rank:

  - a colwise layer (its output the rank's slice of the features): ``base_layer`` and ``lora_B`` colwise (the
    same slice of ``out``), ``lora_A`` replicated (r x in, whole on every rank, reading the replicated input).
    ColwiseParallel wraps lora_B's (b, s, r) input with ``DTensor.from_local(..., Replicate())``, whose backward
    all-reduces its Partial gradient (torch/distributed/tensor/parallel/style.py ``_prepare_input_fn``), so
    lora_A's weight gradient is the whole one on every tp rank: the all-reduce Megatron's
    ``copy_to_tensor_model_parallel_region`` does for peft's LoraParallelLinear (peft/tuners/lora/tp_layer.py,
    whose lora_B is a ColumnParallelLinear beside a plain lora_A);
  - a rowwise layer (reading the rank's slice of the input features): ``base_layer`` and ``lora_A`` rowwise
    (the same slice of ``in``, lora_A's (b, s, r) output all-reduced to Replicate), ``lora_B`` replicated
    (out x r, whole), its output the whole features as the base layer's is.

  The rank r is never split, so any r works at any degree. The collectives this adds (a (b, s, r) all-reduce
  per rowwise layer's forward and per colwise layer's backward) are traced as every style's are
  (trace/tp_local.py) and counted by ``run`` (tests/execute/test_tensor_parallel_run.py). Not under sequence
  parallelism: the attention and the feed-forward then hand their projections the gathered input as a DTensor
  (execute/tensor_parallel.py [Note: gather_input hands on a DTensor]), which a replicated plain lora_A cannot
  take, so a model with adapters is split without it (trace/tp_degrees.py). Not on the embedding or the output
  layer (peft's default targets leave them): a LoRA layer styled otherwise is refused.
"""

from __future__ import annotations

import torch.nn as nn

from shard_planner.errors import UserError
from shard_planner.plan.finetune import ADAPTERS
from shard_planner.parallel.tensor_parallel import Style

BASE_LAYER = "base_layer"


def lora_parts(module: nn.Module) -> tuple[list[str], list[str]] | None:
    """(lora_A's Linears, lora_B's Linears), named relative to ``module``, when ``module`` is a LoRA layer: an
    nn.Linear ``base_layer`` beside ``lora_A`` and ``lora_B``, each an nn.Linear or a ModuleDict of them (one per
    adapter); None for any other module."""
    if not isinstance(getattr(module, BASE_LAYER, None), nn.Linear):
        return None
    parts = []
    for name in ADAPTERS:
        sub = getattr(module, name, None)
        if isinstance(sub, nn.Linear):
            parts.append([name])
        elif isinstance(sub, nn.ModuleDict) and len(sub) and all(isinstance(m, nn.Linear) for m in sub.values()):
            parts.append([f"{name}.{adapter}" for adapter in sub])
        else:
            return None
    return parts[0], parts[1]


def linear_of(model: nn.Module, fqn: str) -> nn.Module:
    """The nn.Linear ``fqn`` stands for: the module itself, or a LoRA layer's ``base_layer`` (its sizes)."""
    module = model.get_submodule(fqn)
    return module.base_layer if lora_parts(module) is not None else module


def inside_lora_layer(fqn: str, layers: set[str]) -> bool:
    """Whether ``fqn`` is a part of one of the LoRA layers ``layers`` (its base layer or an adapter)."""
    return any(fqn.startswith(layer + ".") for layer in layers)


def lora_layers(model: nn.Module) -> set[str]:
    """The FQNs of every LoRA layer of ``model``."""
    return {fqn for fqn, module in model.named_modules() if lora_parts(module) is not None}


def layer_of(fqn: str) -> str:
    """The module a style's FQN splits the work of: a LoRA layer for its parts (``....wq.base_layer``,
    ``....wq.lora_B.default``: ``....wq``), else ``fqn``."""
    parts = fqn.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i] == BASE_LAYER or parts[i] in ADAPTERS:
            return ".".join(parts[:i])
    return fqn


def transformers_prefix(model: nn.Module) -> str:
    """Where the transformers model sits in ``model`` (``"base_model.model."`` under peft's ``PeftModel``; ``""``
    when ``model`` is it)."""
    get_base_model = getattr(model, "get_base_model", None)
    inner = get_base_model() if callable(get_base_model) else model
    if inner is model:
        return ""
    return next(f"{fqn}." for fqn, module in model.named_modules() if module is inner)


def with_adapters(model: nn.Module, styles: dict[str, str]) -> dict[str, str]:
    """``styles`` with each LoRA layer's style given to its parts: [Note: LoRA adapters under tensor parallelism]."""
    out = {}
    for fqn, style in styles.items():
        parts = lora_parts(model.get_submodule(fqn))
        if parts is None:
            out[fqn] = style
            continue
        adapters_a, adapters_b = parts
        if style == Style.COLWISE.value:
            split = adapters_b
        elif style == Style.ROWWISE.value:
            split = adapters_a
        else:
            raise UserError(f"tensor parallelism: {fqn} is a LoRA layer styled {style}; only the attention's and the "
                            "feed-forward's projections (colwise, rowwise) split with their adapters; leave it out "
                            "of the LoRA targets or plan it without tp")
        out[f"{fqn}.{BASE_LAYER}"] = style
        out.update({f"{fqn}.{name}": style for name in split})
    return out


def check_not_quantised(model: nn.Module, styles: dict[str, str]) -> None:
    """:func:`refuse_quantised` for every styled module: the styles are refused where they are derived, so the
    layout search records why for each degree."""
    for fqn in styles:
        refuse_quantised(fqn, model.get_submodule(fqn))


def refuse_quantised(fqn: str, module: nn.Module) -> None:
    """Refuse a styled module holding a quantised (NF4) parameter, as QLoRA's base Linears do: torchao's NF4Tensor
    implements FSDP2's all-gather hooks (model/param_storage.py), not the sharding DTensor's styles need, so such a
    fine-tune is planned without tensor parallelism. The styles' derivation and the trace of a hand-written plan's
    styles (trace/tp_local.py) both refuse here."""
    from shard_planner.model.param_storage import stored_parts

    for name, p in module.named_parameters(recurse=False):
        if any(part.quantized for part in stored_parts(p)):
            raise UserError(f"tensor parallelism: {fqn}.{name} is stored in NF4 (QLoRA), which tensor "
                            "parallelism cannot split; plan a QLoRA fine-tune without --tp")
