"""A transformers config file as a model file: ``shard-planner plan path/to/config.json``.

:func:`load_hf_config` reads a config (a ``config.json``, or a folder holding one) and returns the
functions a model file defines (:class:`HfModel`); ``modelfile.load_model_file`` presents them as a
:class:`~shard_planner.model.modelfile.ModelFile` (loss: the default, which takes the model's own), so the
tracer, planner and executor never ask where a model came from:

- ``build_model()``: the architecture the config names (``architectures[0]``), else the Auto class of
  ``--hf-task``, built with ``_from_config`` (no weights; the default attention implementation);
- ``make_batch(b)``: synthetic keyword inputs from the config (token ids below ``vocab_size`` at the
  sequence length, or ``pixel_values`` of ``image_size`` x ``num_channels``; decoder inputs for an
  encoder-decoder) with ``labels``, so the model computes its own loss (the default loss uses it);
- ``TRAINING``: ``seq_len`` for text models (tokens per sample).

:func:`tp_plan` gives a built model's tensor-parallel plan, for ``tp_styles.derive_tensor_parallel``.

``HfOptions.finetune`` (``--lora``, ``--qlora``, ``--freeze``: shard_planner/plan/finetune.py) fine-tunes what
``build_model()`` builds (shard_planner/model/hf_finetune.py, with peft and torchao); :func:`model_options` gives a
plan's options back, so ``run`` and ``export`` rebuild the planned model.

transformers is an optional extra (``pip install 'shard-planner[hf]'``); it is imported only here.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from shard_planner.errors import ModelFileError
from shard_planner.plan.finetune import FineTune
from shard_planner.plan.loss import LOSSES, MODEL

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"  # what transformers' save_pretrained writes (transformers.utils.CONFIG_NAME)
MAX_DEFAULT_SEQ_LEN = 2048  # the default sequence length: the model's maximum, capped here
FALLBACK_SEQ_LEN = 512  # for a config that names no maximum (relative positions: T5)
INSTALL_HINT = "pip install 'shard-planner[hf]'"


@dataclass(frozen=True)
class HfTask:
    """One kind of model: the Auto class that builds it and the mapping that says which architectures
    are of this kind (transformers.models.auto.modeling_auto.<mapping>[model_type])."""

    auto_class: str
    mapping: str
    inputs: str  # "text" or "image"
    labels: str  # "tokens": the input tokens; "token-class": a class per token; "sample": a class per sample


HF_TASKS = {
    "causal-lm": HfTask("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "text", "tokens"),
    "masked-lm": HfTask("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "text", "tokens"),
    "seq2seq-lm": HfTask("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "text", "tokens"),
    "sequence-classification": HfTask("AutoModelForSequenceClassification",
                                      "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "text", "sample"),
    "token-classification": HfTask("AutoModelForTokenClassification",
                                   "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "text", "token-class"),
    "image-classification": HfTask("AutoModelForImageClassification",
                                   "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "image", "sample"),
}


@dataclass(frozen=True)
class HfOptions:
    """What the config alone may not say: the task (``--hf-task``), the sequence length (``--seq-len``) and
    the fine-tune (``--lora``, ``--qlora``, ``--freeze``: shard_planner/plan/finetune.py); and, for any model
    file, the loss over its output layer (``--loss``, shard_planner/model/loss.py; None: as the file says)."""

    task: str | None = None
    seq_len: int | None = None
    finetune: FineTune | None = None
    loss: str | None = None

    def __post_init__(self):
        if self.loss is not None and self.loss not in LOSSES:
            raise ModelFileError(f"unknown --loss {self.loss!r}; known: {', '.join(LOSSES)}")
        if self.task is not None and self.task not in HF_TASKS:
            raise ModelFileError(f"unknown --hf-task {self.task!r}; known: {', '.join(HF_TASKS)}")
        if self.seq_len is not None and self.seq_len < 1:
            raise ModelFileError(f"--seq-len must be positive, got {self.seq_len}")


@dataclass(frozen=True)
class HfModel:
    """What a model file defines, made from a config: ``build_model``, ``make_batch`` and ``TRAINING``; and
    the fine-tune ``build_model`` applies, its LoRA targets named (None: the model as transformers builds it)."""

    build_model: Callable[[], object]
    make_batch: Callable[[int], dict]
    training: dict
    finetune: FineTune | None = None
    task: str = "causal-lm"  # the kind of model it builds (HF_TASKS)


def plan_options(path: str, task: str | None, seq_len: int | None, finetune: FineTune | None = None,
                 loss: str | None = None) -> HfOptions | None:
    """For a plan's model at ``path``: the task, sequence length and fine-tune it was planned with when it
    is a transformers config, and the loss for any model file (so ``run`` and ``export`` rebuild the planned
    model); None when there is nothing to say."""
    if config_file(path) is not None:
        return HfOptions(task=task, seq_len=seq_len, finetune=finetune, loss=loss)
    return HfOptions(loss=loss) if loss is not None else None


def model_options(model, path: str | None = None) -> HfOptions | None:
    """:func:`plan_options` of a plan's model section (a :class:`~shard_planner.plan.ModelRef`), for the
    model file at ``path`` (default: the section's own path); its loss named (``model`` in plans without one:
    a model file's TRAINING["loss"] then does not change what the plan was made with)."""
    return plan_options(path or model.path, model.hf_task, model.seq_len, model.finetune, model.loss or MODEL)


def as_planned(plan, task: str | None, finetune: FineTune | None):
    """``plan`` (a :class:`~shard_planner.plan.Plan`) recording the ``--hf-task`` and fine-tune its
    transformers config was planned with, which ``run`` and ``export`` rebuild (:func:`model_options`
    reads them back); ``plan`` itself when there are none."""
    if task is None and finetune is None:
        return plan
    return replace(plan, model=replace(plan.model, hf_task=task, finetune=finetune))


def tp_plan(model) -> dict[str, str] | None:
    """The tensor-parallel plan of a model transformers built, as ``derive_tensor_parallel(hf_tp_plan=...)``
    reads it: module-name patterns (``*`` for layer numbers) -> transformers' style names. It is the model's
    ``tp_plan`` (transformers/distributed/mixin.py:79-109 ``init_parallel_plans``: the class's ``_tp_plan``,
    e.g. LlamaForCausalLM's ``{"lm_head": "colwise_gather_output"}``, and each child's plan under its name,
    ``model.`` + the config's ``base_model_tp_plan`` and ``embed_tokens: embedding_rowwise``). None for
    another model, or a transformers model without a plan."""
    plan = getattr(model, "tp_plan", None) if is_transformers_model(model) else None
    return dict(plan) if isinstance(plan, dict) and plan else None


def is_transformers_model(model) -> bool:
    """Whether transformers built ``model``: its config has a tensor-parallel plan's field
    (``base_model_tp_plan``, PretrainedConfig), whether or not the plan is set."""
    return hasattr(getattr(model, "config", None), "base_model_tp_plan")


def config_file(path: str | Path) -> Path | None:
    """The transformers config file ``path`` names (itself, or ``config.json`` in a folder); None when it
    is not one (a model file, a trace.json: a config is a JSON object with a ``model_type``)."""
    file = Path(path)
    if file.is_dir():
        file = file / CONFIG_NAME
    if file.suffix != ".json" or not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return file if isinstance(data, dict) and "model_type" in data else None


def warn_if_other_dtype(path: str | Path, dtype: str) -> None:
    """Say (once: cli/once.py) when ``dtype``, the dtype a command traces and plans the model in (--dtype),
    is not the one the transformers config at ``path`` names (``torch_dtype``, or ``dtype`` in newer
    transformers): `--dtype fp16` on a bf16 config was taken without a word. Nothing for a model file."""
    file = config_file(path)
    if file is None:
        return
    data = json.loads(file.read_text())
    named = data.get("torch_dtype") or data.get("dtype")
    if isinstance(named, str) and named in ("bfloat16", "float16", "float32") and named != dtype:
        logger.warning("%s: the config's dtype is %s, but the model is planned in %s as --dtype asks: its parameters "
                       "are gathered and computed in %s (--dtype %s keeps the config's)", path, named, dtype, dtype,
                       {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[named])


def load_hf_config(path: str, options: HfOptions = HfOptions()) -> HfModel:
    """The model-file functions for the transformers config at ``path`` (a config.json or a folder holding one)."""
    file = config_file(path)
    if file is None:
        raise ModelFileError(f"{path}: not a transformers config (a JSON object with a model_type, or a folder "
                             f"holding {CONFIG_NAME})")
    transformers = _import_transformers(path)
    config = _read_config(path, file, transformers)
    task, model_class = _resolve(path, config, options.task, transformers)
    spec = HF_TASKS[task]
    if task == "sequence-classification" and getattr(config, "pad_token_id", None) is None:
        # transformers' decoder classifiers find each sample's last token by pad_token_id and refuse a
        # batch above 1 without one; the synthetic batch holds no padding, so any id works
        config.pad_token_id = 0
        logger.info("%s: no pad_token_id; using 0 for the sequence classifier (the batch has no padding)", path)
    seq_len = options.seq_len or _default_seq_len(config)
    make_inputs = _image_inputs(config) if spec.inputs == "image" else _text_inputs(config, seq_len)
    training = {"seq_len": seq_len} if spec.inputs == "text" else {}
    finetune = None
    if options.finetune is not None:
        from shard_planner.model.hf_finetune import resolved

        finetune = resolved(options.finetune, config.model_type, path)
    logger.info("%s: %s (%s), %s%s", path, model_class.__name__, task,
                f"sequence length {seq_len}" if spec.inputs == "text" else "image inputs",
                f", {finetune.text}" if finetune is not None else "")
    return HfModel(
        build_model=_builder(model_class, config, finetune, path),
        make_batch=_with_labels(config, spec, make_inputs, seq_len),
        training=training,
        finetune=finetune,
        task=task,
    )


def _builder(model_class, config, finetune: FineTune | None, path: str) -> Callable[[], object]:
    """``build_model``: the model from the config (no weights), fine-tuned as ``finetune`` says."""
    if finetune is None:
        return lambda: model_class._from_config(config)

    def build():
        from shard_planner.model.hf_finetune import apply_finetune

        return apply_finetune(model_class._from_config(config), finetune, path)

    return build


def _import_transformers(path: str):
    """transformers, with its modeling code (which imports torchao where it is installed: quietly, see
    hf_finetune.quiet_imports)."""
    from shard_planner.model.hf_finetune import quiet_imports

    try:
        with quiet_imports():
            import transformers
            import transformers.modeling_utils  # noqa: F401
    except ImportError as exc:
        raise ModelFileError(f"{path}: a transformers config needs transformers: {INSTALL_HINT}") from exc
    return transformers


def _read_config(path: str, file: Path, transformers):
    model_type = json.loads(file.read_text())["model_type"]
    if model_type not in transformers.CONFIG_MAPPING:
        raise ModelFileError(f"{path}: model_type {model_type!r} is unknown to transformers "
                             f"{transformers.__version__}")
    try:
        return transformers.CONFIG_MAPPING[model_type].from_json_file(str(file))
    except Exception as exc:
        raise ModelFileError(f"{path}: transformers cannot read it: {type(exc).__name__}: {exc}") from exc


def _resolve(path: str, config, task: str | None, transformers) -> tuple[str, type]:
    """(task, model class): ``--hf-task``'s Auto class where given, else the config's architecture."""
    from transformers.models.auto import modeling_auto

    if task is not None:
        mapping = getattr(modeling_auto, HF_TASKS[task].mapping)
        names = mapping.get(config.model_type)
        if names is None:
            raise ModelFileError(f"{path}: transformers has no {task} model for model_type {config.model_type!r}")
        return task, getattr(transformers, names if isinstance(names, str) else names[0])
    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        raise ModelFileError(f"{path}: the config names no architectures; pass --hf-task "
                             f"({' | '.join(HF_TASKS)})")
    name = architectures[0]
    model_class = getattr(transformers, name, None)
    if model_class is None:
        raise ModelFileError(f"{path}: architecture {name!r} is unknown to transformers {transformers.__version__}")
    for candidate, spec in HF_TASKS.items():
        names = getattr(modeling_auto, spec.mapping).get(config.model_type, ())
        if name in ((names,) if isinstance(names, str) else names):
            return candidate, model_class
    raise ModelFileError(f"{path}: no synthetic batch for architecture {name!r}; pass --hf-task "
                         f"({' | '.join(HF_TASKS)}) to build that kind of model from this config")


def _default_seq_len(config) -> int:
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return min(MAX_DEFAULT_SEQ_LEN, value)
    return FALLBACK_SEQ_LEN


def _text_inputs(config, seq_len: int) -> Callable[[int], dict]:
    vocab = _required(config, "vocab_size")

    def make(batch_size: int) -> dict:
        import torch

        inputs = {"input_ids": torch.randint(0, vocab, (batch_size, seq_len))}
        if getattr(config, "is_encoder_decoder", False):  # teacher forcing: the decoder reads a target sequence
            inputs["decoder_input_ids"] = torch.randint(0, vocab, (batch_size, seq_len))
        return inputs

    return make


def _image_inputs(config) -> Callable[[int], dict]:
    size = _required(config, "image_size")
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    channels = getattr(config, "num_channels", 3)

    def make(batch_size: int) -> dict:
        import torch

        return {"pixel_values": torch.randn(batch_size, channels, height, width)}

    return make


def _with_labels(config, spec: HfTask, make_inputs: Callable[[int], dict], seq_len: int) -> Callable[[int], dict]:
    """``make_batch``: the inputs plus ``labels`` (so the model computes its loss); no targets."""
    def make_batch(batch_size: int) -> dict:
        import torch

        inputs = make_inputs(batch_size)
        if spec.labels == "sample":
            inputs["labels"] = torch.randint(0, max(1, config.num_labels), (batch_size,))
        elif "decoder_input_ids" in inputs:
            inputs["labels"] = inputs["decoder_input_ids"].roll(-1, dims=1)  # the next decoder token
        elif spec.labels == "token-class":
            inputs["labels"] = torch.randint(0, max(1, config.num_labels), (batch_size, seq_len))
        else:  # causal LM (the model shifts them) and masked LM: the input tokens
            inputs["labels"] = inputs["input_ids"].clone()
        return inputs

    return make_batch


def _required(config, attr: str):
    value = getattr(config, attr, None)
    if value is None:
        raise ModelFileError(f"{config.model_type} config has no {attr}; cannot make a synthetic batch from it")
    return value
