"""Building a transformers model fine-tuned as a :class:`~shard_planner.plan.finetune.FineTune` says: LoRA with
peft, QLoRA with torchao's NF4 under peft's LoRA, or frozen modules by name (what each does: the
docstring of shard_planner/plan/finetune.py).

peft and torchao are an optional extra (``pip install 'shard-planner[finetune]'``), imported only here and
only when a fine-tune asks for them. :func:`apply_finetune` is called by the ``build_model()`` that
shard_planner/model/hf.py makes from a config, so the tracer (under FakeTensorMode), the executor (on the real
device) and the exports build the same model; the tracer's build of NF4 weights without their values is
in trace/build.py ([Note: NF4 weights under fake tensors]).
"""

from __future__ import annotations

import fnmatch
import logging
import warnings
from contextlib import contextmanager

import torch.nn as nn

from shard_planner.errors import ModelFileError, first_line
from shard_planner.plan.finetune import ALL_LINEAR, NF4_BLOCK, NF4_SCALER_BLOCK, FineTune

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'shard-planner[finetune]'"
# Loggers that warn while torchao imports on a machine without its GPU kernels (torchao's "Failed to load
# .../_C_mxfp8...so", torch's pytree "register_constant() on Enum subclasses"): not the user's concern on
# a planning machine. transformers' modeling code imports torchao too wherever it is installed.
_IMPORT_NOISE = ("torchao", "torch.utils._pytree")


@contextmanager
def quiet_imports():
    """While peft, torchao or transformers' modeling code import: their import-time warnings held back."""
    loggers = [logging.getLogger(name) for name in _IMPORT_NOISE]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def _import_peft(path: str):
    try:
        with quiet_imports():
            import peft
    except ImportError as exc:
        raise ModelFileError(f"{path}: --lora needs peft: {INSTALL_HINT}") from exc
    return peft


def _import_to_nf4(path: str):
    """torchao's ``to_nf4`` (torchao.quantization since 0.18; torchao.dtypes before)."""
    with quiet_imports():
        try:
            from torchao.quantization import to_nf4
        except ImportError:
            try:
                from torchao.dtypes import to_nf4
            except ImportError as exc:
                raise ModelFileError(f"{path}: --qlora needs torchao with to_nf4: {INSTALL_HINT}") from exc
    return to_nf4


def resolved(finetune: FineTune | None, model_type: str, path: str) -> FineTune | None:
    """``finetune`` with its LoRA targets named: the given ones, else peft's default for ``model_type``
    (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``, what ``LoraConfig(target_modules=None)``
    uses), else all-linear."""
    if finetune is None or finetune.lora_rank is None or finetune.lora_targets:
        return finetune
    _import_peft(path)
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    targets = tuple(DEFAULTS.get(model_type) or (ALL_LINEAR,))
    if model_type not in DEFAULTS:
        logger.info("%s: peft has no default LoRA targets for %r; using %s", path, model_type, ALL_LINEAR)
    return FineTune(finetune.lora_rank, targets, finetune.qlora, finetune.freeze)


def apply_finetune(model: nn.Module, finetune: FineTune, path: str) -> nn.Module:
    """``model`` (a transformers model as built from the config) fine-tuned as ``finetune`` says, with
    resolved targets (:func:`resolved`): the peft model for LoRA and QLoRA, the model itself otherwise."""
    if finetune.freeze:
        _freeze(model, finetune.freeze, path)
    if finetune.lora_rank is None:
        return model
    peft = _import_peft(path)
    if finetune.qlora:
        _quantize_base(model, _import_to_nf4(path), path)
    targets = list(finetune.lora_targets)
    config = peft.LoraConfig(r=finetune.lora_rank, lora_alpha=finetune.lora_alpha, lora_dropout=0.0,
                             target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets)
    try:
        with warnings.catch_warnings():  # peft asks transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", category=FutureWarning, message=".*is_gradient_checkpointing")
            return peft.get_peft_model(model, config)
    except (ValueError, TypeError, KeyError) as exc:  # e.g. "Target modules {'x'} not found in the base model"
        raise ModelFileError(f"{path}: peft cannot put LoRA on {', '.join(targets)}: {first_line(exc)}") from exc


def _freeze(model: nn.Module, patterns: tuple[str, ...], path: str) -> None:
    """``requires_grad_(False)`` on every module whose name matches a pattern (fnmatch), subtree included."""
    names = [name for name, _ in model.named_modules() if name]
    for pattern in patterns:
        matched = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            shown = ", ".join(names[:4])
            raise ModelFileError(f"{path}: --freeze {pattern!r} matches no module (names look like {shown}, ...)")
        for name in matched:
            model.get_submodule(name).requires_grad_(False)


def _quantize_base(model: nn.Module, to_nf4, path: str) -> None:
    """Every Linear weight but the output layer's to NF4, frozen (QLoRA's base, as bitsandbytes'
    ``load_in_4bit`` leaves the output layer: transformers' ``get_keys_to_not_convert``)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    quantum = NF4_BLOCK * NF4_SCALER_BLOCK
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module is head:
            continue
        weight = module.weight
        if weight.numel() % quantum:
            raise ModelFileError(f"{path}: --qlora: {name}.weight {tuple(weight.shape)} has {weight.numel()} elements, "
                                 f"not a multiple of {quantum} (NF4 blocks of {NF4_BLOCK} x scaler blocks of "
                                 f"{NF4_SCALER_BLOCK})")
        module.weight = nn.Parameter(to_nf4(weight.detach(), NF4_BLOCK, NF4_SCALER_BLOCK), requires_grad=False)
