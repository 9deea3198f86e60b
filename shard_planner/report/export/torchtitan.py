"""Export a plan as a torchtitan 0.3 config function: a Python module for ``--module/--config``.

[Note: torchtitan 0.3 configuration] torchtitan 0.3 has no TOML job config and no
``--section.key=value`` options of its own: ``ConfigManager.parse_args`` (torchtitan 0.3.0,
torchtitan/config/manager.py) imports ``--module`` (a model name such as ``llama3``, or any importable
module, tried as ``MODULE.config_registry`` and then ``MODULE``), calls its ``--config`` function for a
``Trainer.Config``, and lets ``tyro`` override fields from the remaining arguments. So the export is such
a module: its ``shard_planner_plan()`` builds the model's own config function (named at run time by
``SHARD_PLANNER_BASE_CONFIG``) and sets what the plan decides. The fields (torchtitan 0.3.0):

- ``parallelism`` (config/configs.py ParallelismConfig): ``data_parallel_shard_degree``,
  ``data_parallel_replicate_degree`` (> 1 with a shard degree > 1 is HSDP), ``fsdp_reshard_after_forward``
  ("default" | "always" | "never", one setting for every unit: distributed/fsdp.py);
- ``training`` (TrainingConfig): ``local_batch_size`` (per GPU), ``global_batch_size`` (torchtitan runs
  global / (local x data-parallel degree) micro-steps per optimizer step), ``seq_len``,
  ``mixed_precision_param`` ("bfloat16" | "float32"), ``mixed_precision_reduce`` ("float32" only),
  ``enable_cpu_offload``;
- ``activation_checkpoint`` (distributed/activation_checkpoint.py): ``None``, ``FullAC.Config()`` or
  ``SelectiveAC.Config()`` (per-op: mm and SDPA outputs kept, every second mm recomputed), applied to
  every block alike; 0.3 has no every-k-th-block option;
- ``optimizer.param_groups[*]`` (components/optimizer/optimizer.py ParamGroupConfig): ``optimizer_name``
  and ``optimizer_kwargs["lr"]``;
- with tensor parallelism, ``parallelism.tensor_parallel_degree`` and ``enable_sequence_parallel``, and
  ``compile.enable_async_tensor_parallel`` (see [Note: torchtitan 0.3 tensor parallelism]).

[Note: torchtitan 0.3 tensor parallelism] (torchtitan 0.3.0, file:line)
- the degrees: ``ParallelDims`` requires dp_replicate x dp_shard x cp x tp x pp == WORLD_SIZE
  (distributed/parallel_dims.py:186), so the data-parallel degrees are the plan's replicate and shard
  (GPUs / tp), and ``tensor_parallel_degree`` its tp (config/configs.py:157); the global batch is
  local x dp_replicate x dp_shard per micro-step (trainer.py:415-431);
- sequence parallelism is an option, ``enable_sequence_parallel`` (configs.py:160, default True), handed to
  the model's sharding (models/llama3/model.py:83-88 ``set_llama3_sharding_config(enable_sp=...)``): the
  plan's ``sequence_parallel`` maps onto it exactly;
- loss parallelism is not an option: the output layer's logits always stay split on the vocabulary
  (models/common/decoder_sharding.py:330-336, lm_head ``out_dst_shardings`` S(-1)) and
  ``cross_entropy_loss`` takes the vocabulary-parallel path on them (components/loss.py:39-57);
- async TP is ``compile.enable_async_tensor_parallel`` (configs.py:295, default False; it needs
  ``compile.enable``: configs.py:304-311); the plan's collectives are not overlapped: set False;
- the styles are torchtitan's own: each model declares its sharding (Llama: models/llama3/sharding.py:25-74,
  decoder_sharding.py:301-336): per block q/k/v and w1/w3 colwise, wo and w2 rowwise, and with sequence
  parallelism the two norms SequenceParallel and the attention and feed-forward inputs gathered; the token
  embedding split on the vocabulary, the final norm (sequence parallel) and the output layer colwise. The
  final norm gathers its output (decoder_sharding.py:119-139) where the plan's ``head`` gathers its input:
  the same all-gather. A plan whose styles differ (``torchtitan_layout_gaps``) is noted: torchtitan
  applies its own, not the plan's.

torchtitan 0.2's TOML job config is not served: its format could not be checked against an installed
0.2 here. torchtitan decides the units itself (one per transformer block, plus embeddings and output)
and sets no explicit prefetch: what the plan decides beyond that is listed as comments.
"""

from __future__ import annotations

import string

from collections import Counter

from shard_planner import __version__
from shard_planner.plan.checkpointing import ALTERNATE_MATMUL, DEFAULT_SAVE_OPS, SELECTIVE
from shard_planner.plan import OPTIMIZER_TORCH, Plan
from shard_planner.parallel.tensor_parallel import Style, TensorParallel
from shard_planner.report.export.accumulation import policy_notes
from shard_planner.report.export.common import (
    Export, allocator_env, allocator_line, block_units, comment_block, finetune_notes, grouped_note, loss_notes, prefetch_notes, split_number,
    uniform_reshard,
)

# torchtitan's Llama split (see [Note: torchtitan 0.3 tensor parallelism]): styles per block and outside them.
_LLAMA_BLOCK = Counter({Style.COLWISE: 5, Style.ROWWISE: 2})  # wq, wk, wv, w1, w3; wo, w2
_LLAMA_BLOCK_SP = _LLAMA_BLOCK + Counter({Style.NORM: 2, Style.GATHER_INPUT: 2})  # the two norms; attention, ffn
_LLAMA_ROOT = Counter({Style.EMBEDDING: 1, Style.HEAD: 1})
_LLAMA_ROOT_SP = _LLAMA_ROOT + Counter({Style.NORM: 1})  # the final norm


def _covers_torchtitan_op_saves(save_ops: tuple[str, ...]) -> bool:
    """The plan's selective block keeps at least what torchtitan's SelectiveAC keeps (odd-numbered mms and
    attention; plan/checkpointing.py [Note: torchtitan's op-level policy]), so SelectiveAC needs no more memory."""
    return ("matmul" in save_ops or ALTERNATE_MATMUL in save_ops) and "attention_fwd" in save_ops


def ac_mode(blocks) -> tuple[str, list[str]]:
    """torchtitan's activation-checkpointing mode for the plan's blocks, and notes.

    torchtitan applies one mode to every block. A pattern it cannot say falls back to a mode needing no
    more memory than the plan: SelectiveAC when every block is selective (keeping at least torchtitan's
    ops) or not checkpointed; otherwise full checkpointing of every block."""
    modes = [u.activation_checkpoint for u in blocks]
    n, checkpointed = len(modes), sum(bool(m) for m in modes)
    if checkpointed == 0:
        return "none", []
    if all(m is True for m in modes):
        return "full", []
    selective = [u for u in blocks if u.activation_checkpoint == SELECTIVE]
    if selective and all(m in (SELECTIVE, False) for m in modes) and \
            all(_covers_torchtitan_op_saves(u.ac_save_ops) for u in selective):
        notes = []
        if any(u.ac_save_ops == DEFAULT_SAVE_OPS for u in selective):
            notes.append("torchtitan's SelectiveAC saves mm and SDPA outputs but recomputes every second mm of a "
                         "block: a little less memory and a little more recompute than the plan's (which saves "
                         "every matmul and attention output)")
        if len(selective) < n:
            notes.append(f"the plan checkpoints {len(selective)} of {n} blocks selectively and leaves the others "
                         "alone; torchtitan applies one mode to every block: using SelectiveAC on all (less "
                         "memory, more recompute than the plan)")
        return "selective", notes
    return "full", [f"the plan checkpoints {checkpointed} of {n} blocks ({_pattern(modes)}); torchtitan 0.3 applies "
                    "one mode to every block (none, full or per-op selective; no every-k-th-block option): using full "
                    "checkpointing of every block, which needs no more memory than the plan (more recompute)"]


def _pattern(modes) -> str:
    full, sel = sum(m is True for m in modes), sum(m == SELECTIVE for m in modes)
    return ", ".join(part for part in (f"{full} fully" if full else "", f"{sel} selectively" if sel else "") if part)


def _tables(plan: Plan) -> tuple[dict, dict, list[str]]:
    """The ``parallelism`` and ``training`` fields, and notes."""
    t = plan.training
    reshard, notes = uniform_reshard(plan)
    parallelism = {"data_parallel_shard_degree": plan.mesh.shard_group_size,
                   "data_parallel_replicate_degree": plan.mesh.replicate_group_size,
                   "fsdp_reshard_after_forward": "always" if reshard else "never"}
    training = {"local_batch_size": t.micro_batch}
    if t.accumulation_steps > 1:  # torchtitan's default global batch is local x data-parallel degree
        training["global_batch_size"] = plan.global_batch_samples
        notes += policy_notes(plan, "torchtitan", syncs_every_step=True)
    if plan.model.seq_len:
        training["seq_len"] = plan.model.seq_len
    compute, reduce = t.numerics.compute_dtype, t.numerics.reduce_scatter_dtype
    param_dtype = compute if compute in ("bfloat16", "float32") else "bfloat16"
    if param_dtype != compute:
        notes.append(f"torchtitan's mixed_precision_param is bfloat16 or float32; the plan computes in {compute}: "
                     "using bfloat16 (the same bytes)")
    if reduce != "float32":
        notes.append(f"torchtitan only accepts mixed_precision_reduce = float32; the plan reduces in {reduce}")
    training.update(mixed_precision_param=param_dtype, mixed_precision_reduce="float32", enable_cpu_offload=t.cpu_offload)
    return parallelism, training, notes


def _counts(counter: Counter) -> str:
    return ", ".join(f"{n} {style.value}" for style, n in sorted(counter.items(), key=lambda item: item[0].value))


def torchtitan_layout_gaps(tp: TensorParallel) -> list[str]:
    """Where ``tp``'s styles differ from torchtitan's Llama split ([] when they are it): per numbered block
    (the module path up to its last number) and outside the blocks, the styles counted by kind."""
    blocks: dict[str, Counter] = {}
    root: Counter = Counter()
    for fqn, style in tp.styles_by_fqn.items():
        parsed = split_number(fqn)
        (root if parsed is None else blocks.setdefault(f"{parsed[0]}{parsed[1]}", Counter()))[style.style] += 1
    block, top = (_LLAMA_BLOCK_SP, _LLAMA_ROOT_SP) if tp.sequence_parallel else (_LLAMA_BLOCK, _LLAMA_ROOT)
    gaps = [f"block {name}: {_counts(c)}" for name, c in blocks.items() if c != block][:2]
    if root != top:
        gaps.append(f"outside the blocks: {_counts(root)}")
    if gaps or not blocks:
        gaps.append(f"torchtitan's Llama: {_counts(block)} per block; {_counts(top)} outside")
    return gaps


def _tp_settings(plan: Plan) -> tuple[dict, dict, list[str]]:
    """The tensor-parallel ``parallelism`` fields, the ``compile`` fields and notes; see [Note: torchtitan 0.3
    tensor parallelism]."""
    tp = plan.tensor_parallel
    if tp is None:
        return {}, {}, []
    parallelism = {"tensor_parallel_degree": plan.mesh.tp_size, "enable_sequence_parallel": tp.sequence_parallel}
    notes = []
    if not tp.loss_parallel:
        notes.append("the plan all-gathers the logits (no loss parallelism); torchtitan 0.3 always keeps them split "
                     "on the vocabulary into a vocabulary-parallel loss (no option): the logits take 1/"
                     f"{plan.mesh.tp_size} of the plan's memory here")
    gaps = torchtitan_layout_gaps(tp)
    if gaps:
        notes.append("the plan's tensor-parallel styles are not torchtitan's Llama split, which torchtitan applies "
                     f"to its model whatever this file says ({'; '.join(gaps)}): the split run is torchtitan's, "
                     "not the plan's (the fsdp2 export applies the plan's)")
    return parallelism, {"enable_async_tensor_parallel": False}, notes


def _literal(mapping: dict) -> str:
    """A dict of str keys and bool/int/float/str values as Python source, one entry a line."""
    return "{\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in mapping.items()) + "}"


def export_torchtitan(plan: Plan) -> Export:
    parallelism, training, notes = _tables(plan)
    blocks = block_units(plan)
    mode, ac_notes = ac_mode(blocks)
    notes += ac_notes
    others = [u.name for u in plan.inner_units if u.activation_checkpoint and u not in blocks]
    if others:
        notes.append(f"checkpointed unit(s) outside the repeated blocks ({', '.join(others)}): torchtitan "
                     "checkpoints blocks only; not checkpointed here")
    notes += grouped_note(plan)
    notes += prefetch_notes(plan, where="torchtitan")
    tp_parallelism, compile_fields, tp_notes = _tp_settings(plan)
    parallelism.update(tp_parallelism)
    notes += tp_notes
    notes += finetune_notes(plan, "torchtitan 0.3", expressible=False)  # no LoRA, QLoRA or freezing option
    notes += loss_notes(plan, "torchtitan 0.3 (its loss is cross_entropy_loss over the whole logits)")
    notes.append("units: torchtitan wraps one unit per transformer block plus embeddings and output in its "
                 f"parallelize function; the plan's {len(plan.inner_units)} units apply where they coincide (the "
                 "fsdp2 export applies them exactly)")
    if plan.root.reshard_after_forward:
        notes.append("the plan reshards the root after forward; torchtitan does not (FSDP2's root default)")
    t = plan.training
    cls, kwargs = OPTIMIZER_TORCH[t.optimizer]
    header = [
        f"torchtitan 0.3 config for {plan.model.path} on {plan.cluster.gpus} GPUs, generated by shard-planner "
        f"{__version__} (model fingerprint {plan.model.fingerprint}).",
        allocator_line(plan, "torchrun ... (torchtitan's run_train.sh turns expandable segments on unless the "
                             "variable is set: set it as here)"),
        *([f"Tensor parallelism: {plan.mesh.description} ({plan.tensor_parallel.description}): "
           "tensor_parallel_degree and enable_sequence_parallel below."] if plan.tensor_parallel else []),
        "Where the plan cannot be expressed exactly (the nearest setting is used below):",
        *[f"- {n}" for n in notes],
    ]
    text = _SOURCE.substitute(
        header="\n".join(comment_block(header)), gpus=plan.mesh.world_size, alloc_env=allocator_env(plan),
        parallelism=_literal(parallelism), compile=_literal(compile_fields),
        training=_literal(training), mode=repr(mode), optimizer=repr((cls, {"lr": t.lr, **kwargs})))
    return Export("torchtitan", text, ".py", tuple(notes))


# The generated module (string.Template: $name is filled in by export_torchtitan).
_SOURCE = string.Template('''"""A torchtitan 0.3 config function with shard-planner's plan (see the comments below).

Use: save as shard_planner_torchtitan.py in a directory on PYTHONPATH, then
    $alloc_env SHARD_PLANNER_BASE_CONFIG=llama3:llama3_8b \\\\
        torchrun --nproc_per_node $gpus -m torchtitan.train \\\\
        --module shard_planner_torchtitan --config shard_planner_plan
SHARD_PLANNER_BASE_CONFIG names your model's own config function as MODULE:FUNCTION (MODULE: a torchtitan
model such as llama3, or an importable module); the plan's settings are applied on top of it. Options
after --config still override fields (torchtitan's command line, e.g. --training.steps 100).
"""

import importlib
import os

$header

PARALLELISM = $parallelism
TRAINING = $training
COMPILE = $compile  # with tensor parallelism: async TP off (the plan's TP collectives are not overlapped)
ACTIVATION_CHECKPOINT = $mode  # every block: "none", "full" (FullAC) or "selective" (per-op SelectiveAC)
OPTIMIZER = $optimizer  # torch.optim class name and keyword arguments


def base_config():
    """The model's own torchtitan config function, named by SHARD_PLANNER_BASE_CONFIG=MODULE:FUNCTION."""
    name = os.environ.get("SHARD_PLANNER_BASE_CONFIG")
    if not name or ":" not in name:
        raise ValueError("set SHARD_PLANNER_BASE_CONFIG=MODULE:FUNCTION to your model's torchtitan config function, "
                         "e.g. llama3:llama3_8b")
    module_name, function = name.rsplit(":", 1)
    for candidate in (f"torchtitan.models.{module_name}.config_registry", f"{module_name}.config_registry", module_name):
        try:
            module = importlib.import_module(candidate)
        except ModuleNotFoundError as error:  # only this candidate missing; a missing dependency is raised
            if error.name and (candidate == error.name or candidate.startswith(error.name + ".")):
                continue
            raise
        return getattr(module, function)()
    raise ValueError(f"SHARD_PLANNER_BASE_CONFIG: cannot import {module_name!r}")


def shard_planner_plan():
    """The base config with the plan's parallelism, batch, mixed precision, checkpointing and optimizer."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    config = base_config()
    for section, values in (("parallelism", PARALLELISM), ("training", TRAINING), ("compile", COMPILE)):
        for key, value in values.items():
            setattr(getattr(config, section), key, value)
    config.activation_checkpoint = {"none": None, "full": FullAC.Config(),
                                    "selective": SelectiveAC.Config()}[ACTIVATION_CHECKPOINT]
    name, kwargs = OPTIMIZER
    for group in config.optimizer.param_groups:  # the base's other hyper-parameters stay for the same optimizer
        group.optimizer_kwargs = {**group.optimizer_kwargs, **kwargs} if group.optimizer_name == name else dict(kwargs)
        group.optimizer_name = name
    return config
''')
