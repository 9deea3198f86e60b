"""Argument types every command shares (defined in ``shard_planner.argtypes``), and the parser that
reports a bad value in one line.

    p.add_argument("--gpus", type=positive_int, required=True)
    p.add_argument("--mem", type=byte_size, required=True)

A type that rejects a value raises ``argparse.ArgumentTypeError("must be ..., got '0'")``; :class:`Parser`
turns argparse's ``argument --gpus: must be ...`` into :class:`ArgumentValueError` (``--gpus must be a
positive integer, got '0'``), which the entry point prints as one line and exits 2. Every other argparse
error (a missing argument, an unknown choice or option) is one line too, argparse's message and where
the usage is: ``the following arguments are required: --mem; see shard-planner plan --help`` — not the
usage itself, whose dozen lines would bury the one that says what is wrong.

[Note: one definition per flag]
A flag means the same thing in every command that takes it, so each is defined once, here, by an
``add_*`` function the commands call (``add_micro_batch(p, default="the plan's")``): the name, its
aliases, the type, the metavar and the words of the help. What a command may vary is only the default
and what it says of it. Old names stay as aliases (``--batch-size`` for ``--micro-batch``, ``--report``
for ``--report-dir``), so command lines written for an earlier version keep working.
"""

from __future__ import annotations

import argparse
import re

from shard_planner.argtypes import byte_size, non_negative_int, positive_float, positive_int, token_count
from shard_planner.errors import UserError
from shard_planner.units import DTYPE_NAMES

__all__ = ["ArgumentValueError", "Parser", "byte_size", "non_negative_int", "positive_float", "positive_int"]

# argparse words a rejected value as "argument <flags>: <the type's message>" (argparse.ArgumentError).
_REJECTED_VALUE = re.compile(r"argument (\S+): (must be .*)")
_MISSING_VALUE = re.compile(r"argument (\S+): expected one argument")


class ArgumentValueError(UserError):
    """A command line argparse rejects: a value out of range (``--gpus 0``, ``--mem forty``), a missing
    argument, an unknown option or choice."""


class Parser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose errors become one-line :class:`ArgumentValueError`\\ s
    (sub-command parsers inherit the class)."""

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(args) if args is not None else []  # to name a flag with aliases as it was typed
        return super().parse_known_args(args, namespace)

    def _as_typed(self, flags: str) -> str:
        """Of a flag's names (argparse joins aliases: ``--micro-batch/--batch-size``), the one on the command line."""
        names = flags.split("/")
        given = getattr(self, "_given", [])
        return next((n for n in names if any(a == n or a.startswith(n + "=") for a in given)), names[0])

    def error(self, message: str):
        m = _REJECTED_VALUE.fullmatch(message)
        if m:
            raise ArgumentValueError(f"{self._as_typed(m.group(1))} {m.group(2)}")
        m = _MISSING_VALUE.fullmatch(message)
        if m:  # `--mem -1GB`: argparse reads a value that starts with '-' as the next option
            message = (f"{m.group(1)} needs a value (one that starts with '-' is read as an option: "
                       f"write {m.group(1)}=VALUE)")
        raise ArgumentValueError(f"{message}; see {self.prog} --help")


def add_hf_arguments(p: argparse.ArgumentParser) -> None:
    """``--loss`` (any model file: shard_planner/model/loss.py); ``--hf-task``, ``--seq-len`` and the fine-tune
    (``--lora``, ``--lora-targets``, ``--qlora``, ``--freeze``: shard_planner/plan/finetune.py): for a MODEL that is
    a transformers config (shard_planner.model.hf)."""
    from shard_planner.plan.finetune import parse_targets
    from shard_planner.plan.loss import LOSSES
    from shard_planner.model.hf import HF_TASKS

    p.add_argument("--loss", choices=LOSSES, default=None,
                   help="the loss over the output layer: model (the model file's loss_fn, or a transformers model's "
                   "own), chunked (torchtune's CEWithChunkedOutputLoss: the output layer on 8 chunks of the "
                   "sequence, each upcast to fp32 alone) or fused (Liger Kernel's fused linear cross-entropy: "
                   "the logits never whole); default: the model file's TRAINING['loss'], else model")
    g = p.add_argument_group("when MODEL is a transformers config (config.json, or a folder holding one)")
    g.add_argument("--hf-task", choices=sorted(HF_TASKS), default=None,
                   help="the kind of model to build (default: the config's architectures[0])")
    g.add_argument("--seq-len", type=positive_int, default=None, metavar="T",
                   help="tokens per sample of the synthetic batch (default: min(2048, the config's maximum "
                   "positions), 512 where it names none)")
    g.add_argument("--lora", type=positive_int, default=None, metavar="R",
                   help="fine-tune with LoRA adapters of rank R (peft; alpha 2R): the base is frozen, the adapters "
                   "train in fp32 (pip install 'shard-planner[finetune]')")
    g.add_argument("--lora-targets", type=parse_targets, default=(), metavar="NAMES",
                   help="the modules that get adapters, peft's names: q_proj,v_proj or all-linear (every Linear but "
                   "the output layer); default: peft's default for the architecture (q_proj,v_proj for Llama), "
                   "all-linear where it has none")
    g.add_argument("--qlora", action="store_true",
                   help="QLoRA: every Linear weight but the output layer in NF4 (torchao to_nf4), frozen, with the "
                   "--lora adapters on top")
    g.add_argument("--freeze", action="append", default=[], metavar="PATTERN",
                   help="freeze every parameter of the modules whose names match PATTERN (fnmatch, e.g. "
                   "'model.embed_tokens' or '*vision_tower*'; repeatable); the rest train")


def hf_options(args: argparse.Namespace):
    """The :class:`~shard_planner.model.hf.HfOptions` of :func:`add_hf_arguments`' arguments; None when none
    is given (a model file then loads as before). A trace.json takes none: it is the model as it was traced."""
    from shard_planner.plan.finetune import FineTune
    from shard_planner.model.hf import HfOptions
    from shard_planner.model.modelfile import is_trace_file

    finetune = None
    if args.lora is not None or args.lora_targets or args.qlora or args.freeze:
        finetune = FineTune(args.lora, args.lora_targets, args.qlora, tuple(args.freeze))
    if args.hf_task is None and args.seq_len is None and finetune is None and args.loss is None:
        return None
    if is_trace_file(args.model):
        raise UserError(f"{args.model} is a trace.json, the model as it was traced: --loss, --hf-task, --seq-len, "
                        "--lora, --qlora and --freeze apply to the model file or transformers config it was traced "
                        "from (shard-planner trace MODEL ... -o trace.json with them, or plan MODEL itself)")
    return HfOptions(task=args.hf_task, seq_len=args.seq_len, finetune=finetune, loss=args.loss)


# The MODEL argument's words, for every command that takes one (see [Note: one definition per flag]).
MODEL_FILE_OR_CONFIG = "model file (path/to/model.py or package.module), or a transformers config (config.json or its folder)"
TRACE_JSON = "a trace.json from shard-planner trace"


def add_model_argument(p: argparse.ArgumentParser, *, trace_json: bool = True, more: str = "") -> None:
    """MODEL: a model file or a transformers config, and (``trace_json``) a trace.json."""
    p.add_argument("model", help=MODEL_FILE_OR_CONFIG + (f", or {TRACE_JSON}" if trace_json else "") + more)


def add_gpus(p: argparse.ArgumentParser, *, required: bool = True, default_text: str = "") -> None:
    p.add_argument("--gpus", type=positive_int, required=required, default=None, metavar="N",
                   help="number of GPUs (ranks) the plan is for" + (f" (default: {default_text})" if default_text else ""))


def add_mem(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    """``--mem SIZE``, with its unit: ``--mem 40`` is refused at parse time (argtypes.byte_size)."""
    p.add_argument("--mem", type=byte_size, required=required, default=None, metavar="SIZE",
                   help="memory per GPU with its unit, e.g. 40GB (GB = GiB; a profile's nominal size, 80GB on "
                   "h100-80gb, means the whole device); on a GPU profile the plan's first two steps, simulated "
                   "through the CUDA caching allocator in the mode PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF set "
                   "here (expandable segments when unset), must survive 94.7%% of it less the CUDA context and "
                   "NCCL; on a CPU profile the predicted peak fills at most the profile's usable_fraction of it")


def add_gpus_per_node(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus-per-node", type=positive_int, default=None, metavar="K",
                   help="GPUs per node (default: the profile's)")


def add_profile(p: argparse.ArgumentParser, *, default: str | None, default_text: str) -> None:
    p.add_argument("--profile", default=default, metavar="PROFILE",
                   help=f"hardware profile: a name in profiles/ (h100-80gb, a100-40gb, ..., cpu-gloo) or a TOML "
                   f"path (default: {default_text})")


def add_timings(p: argparse.ArgumentParser, *, default_text: str = "none: compute is priced from FLOPs") -> None:
    p.add_argument("--timings", default=None, metavar="FILE",
                   help="measured module times from `shard-planner calibrate --model` (this model, this device, "
                   f"--dtype): compute is priced from them instead of FLOPs (default: {default_text})")


def add_dtype(p: argparse.ArgumentParser, *, more: str = "") -> None:
    """``--dtype``; :func:`param_dtype` reads it (None when not given: bf16)."""
    p.add_argument("--dtype", default=None, choices=sorted(DTYPE_NAMES),
                   help="mixed-precision param dtype: what the model is traced, planned, timed and run in "
                   f"(default bf16){more}")


def param_dtype(args: argparse.Namespace) -> str:
    """--dtype as a torch dtype name (``"bfloat16"`` when not given). Given for a transformers config that
    names another, it is said once (hf.warn_if_other_dtype); bf16 by default is not (many configs say fp32)."""
    if args.dtype is None:
        return DTYPE_NAMES["bf16"]
    dtype = DTYPE_NAMES[args.dtype]
    if getattr(args, "model", None):
        from shard_planner.model.hf import warn_if_other_dtype

        warn_if_other_dtype(args.model, dtype)
    return dtype


def add_recipe(p) -> None:
    """``--recipe NAME``: one of shard_planner/plan/recipes.py's recipes (light: the planner is not imported). ``p``
    may be a mutually exclusive group (with ``--plan``)."""
    from shard_planner.plan.recipes import RECIPE_NAMES

    p.add_argument("--recipe", choices=RECIPE_NAMES, default=None, metavar="NAME",
                   help="price a named recipe (the FSDP2 policy a stack applies) instead of a plan file: "
                   f"{', '.join(RECIPE_NAMES)}; needs --gpus (--mem: the profile's device by default)")


def add_micro_batch(p, *, default: str) -> None:
    """``--micro-batch B`` (alias ``--batch-size``): samples per GPU in one forward and backward. ``p``
    may be a mutually exclusive group."""
    p.add_argument("--micro-batch", "--batch-size", dest="micro_batch", type=positive_int, default=None,
                   metavar="B", help=f"micro-batch per GPU: samples in one forward and backward (default: {default})")


def add_batch_search(p: argparse.ArgumentParser) -> None:
    """The batch a plan search works to: ``--micro-batch`` or ``--search-batch``; ``--global-batch`` or
    ``--global-batch-tokens``."""
    batch = p.add_mutually_exclusive_group()
    add_micro_batch(batch, default="the model file's TRAINING['micro_batch'], which a trace.json carries too, else 1")
    batch.add_argument("--search-batch", action="store_true",
                       help="also choose the micro-batch that maximises throughput")
    gb = p.add_mutually_exclusive_group()
    gb.add_argument("--global-batch", type=positive_int, default=None, metavar="N",
                    help="samples per optimizer step over all GPUs: the plan reaches it as micro-batch x gradient "
                    "accumulation steps x GPUs, choosing the micro-batch (or using --micro-batch), the steps and "
                    "whether gradients sync every micro-step or only on the last; an N no plan can reach is refused "
                    "with the nearest that work")
    gb.add_argument("--global-batch-tokens", type=token_count, default=None, metavar="N",
                    help="the same in tokens (samples x the model's sequence length), e.g. 4194304 or 4M (K, M, G: "
                    "powers of 1024)")


def add_time_limit(p: argparse.ArgumentParser) -> None:
    p.add_argument("--time-limit", type=positive_float, default=1.0, metavar="S",
                   help="CP-SAT effort per solve (default 1): S x 0.05 s of CP-SAT's deterministic time, so the "
                   "plan does not depend on the machine's load, and at most 3 x S s of wall clock; the plan's "
                   "solver status says whether the answer was proven optimal")


def add_engine(p: argparse.ArgumentParser) -> None:
    """``--engine``: what runs the plan (plan/engine.py)."""
    p.add_argument("--engine", choices=("fsdp2", "single"), default=None,
                   help="what runs the plan: fsdp2 (fully_shard), or single, one device without sharding (plain "
                   "PyTorch, every parameter cast to the compute dtype, as torchtune's single-device recipes "
                   "train). Default: single at --gpus 1 when the model is already stored in the compute dtype "
                   "(nothing is cast), else fsdp2 (on one GPU it keeps fp32 weights as master weights)")
    p.add_argument("--optimizer-in-backward", action="store_true",
                   help="with --engine single: step each parameter as soon as its gradient is ready and free the "
                   "gradient (torchtune's optimizer_in_bwd): the gradients never all live together; no gradient "
                   "accumulation")


def add_tp_arguments(p: argparse.ArgumentParser, *, tp_default, tp_help: str) -> None:
    """``--tp N`` (its default and what it means for the command's search) and the two TP switches."""
    tp = p.add_argument_group("tensor parallelism (inside a node; FSDP or HSDP over the rest)")
    tp.add_argument("--tp", type=positive_int, default=tp_default, metavar="N",
                    help="tensor-parallel degree: N GPUs of a node split every block (it must divide the GPUs per "
                    f"node and the model's heads, MLP width and vocabulary); {tp_help}")
    tp.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                    help="with tensor parallelism, keep the norms and the block inputs whole on every rank instead of "
                    "split along the sequence (torchtitan's default splits them)")
    tp.add_argument("--no-loss-parallel", dest="loss_parallel", action="store_false",
                    help="with tensor parallelism, gather the logits before the loss instead of computing the "
                    "cross-entropy on each rank's slice of the vocabulary")


def add_output(p: argparse.ArgumentParser, *, what: str, default: str | None) -> None:
    p.add_argument("-o", "--output", default=default, metavar="FILE",
                   help=f"where to write the {what} (default {default or 'standard output'})")


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    """``--report-dir DIR`` (alias ``--report``) and ``--no-report``; :func:`report_dir` reads them."""
    p.add_argument("--report-dir", "--report", dest="report_dir", metavar="DIR",
                   help="report folder (default: beside the plan, <plan name>.report/; plan.json -> plan.report/)")
    p.add_argument("--no-report", dest="report", action="store_false", help="skip the report")


def report_dir(args: argparse.Namespace):
    """The report folder :func:`add_report_arguments` asks for (beside ``args.output`` by default), None
    with --no-report."""
    from pathlib import Path

    from shard_planner.plan import report_dir_for

    if not args.report:
        return None
    return Path(args.report_dir) if args.report_dir else report_dir_for(args.output)


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the ranks run: cuda (NCCL, one GPU per rank) or cpu (gloo); auto: cuda when this "
                   "machine has a GPU, else cpu (default auto)")


def add_debug(p: argparse.ArgumentParser, *, top: bool) -> None:
    """``--debug``, before or after the command (``shard-planner run plan.json --debug``). A subcommand's
    default is SUPPRESS, so that it does not undo a --debug given before the command."""
    p.add_argument("--debug", action="store_true", default=False if top else argparse.SUPPRESS,
                   help="show tracebacks and debug logs")
