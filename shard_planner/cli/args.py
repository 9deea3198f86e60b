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
"""

from __future__ import annotations

import argparse
import re

from shard_planner.argtypes import byte_size, non_negative_int, positive_float, positive_int
from shard_planner.errors import UserError

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

    def error(self, message: str):
        m = _REJECTED_VALUE.fullmatch(message)
        if m:
            raise ArgumentValueError(f"{m.group(1)} {m.group(2)}")
        m = _MISSING_VALUE.fullmatch(message)
        if m:  # `--mem -1GB`: argparse reads a value that starts with '-' as the next option
            message = (f"{m.group(1)} needs a value (one that starts with '-' is read as an option: "
                       f"write {m.group(1)}=VALUE)")
        raise ArgumentValueError(f"{message}; see {self.prog} --help")


def add_hf_arguments(p: argparse.ArgumentParser) -> None:
    """``--hf-task``, ``--seq-len`` and the fine-tune (``--lora``, ``--lora-targets``, ``--qlora``,
    ``--freeze``: shard_planner/finetune.py): for a MODEL that is a transformers config (shard_planner.hf)."""
    from shard_planner.finetune import parse_targets
    from shard_planner.hf import HF_TASKS

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
    """The :class:`~shard_planner.hf.HfOptions` of :func:`add_hf_arguments`' arguments; None when none
    is given (a model file then loads as before)."""
    from shard_planner.finetune import FineTune
    from shard_planner.hf import HfOptions

    finetune = None
    if args.lora is not None or args.lora_targets or args.qlora or args.freeze:
        finetune = FineTune(args.lora, args.lora_targets, args.qlora, tuple(args.freeze))
    if args.hf_task is None and args.seq_len is None and finetune is None:
        return None
    return HfOptions(task=args.hf_task, seq_len=args.seq_len, finetune=finetune)
