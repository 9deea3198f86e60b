"""Command-line value types (``type=`` for argparse), shared by the CLI and the launched worker process.

A type that rejects a value raises ``argparse.ArgumentTypeError("must be ..., got '0'")``;
``shard_planner.cli.args.Parser`` turns that into a one-line error. Kept outside ``shard_planner.cli``
so that ``execute/worker.py``, which parses its own command line as a spawned process, does not import
the CLI package.
"""

from __future__ import annotations

import argparse
import re

from shard_planner.errors import UserError
from shard_planner.units import parse_bytes


def _int(text: str, least: int, wanted: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < least:
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """``type=`` for counts: GPUs, ranks, steps, micro-batch (1, 2, ...)."""
    return _int(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """``type=`` for counts that may be zero: warm-up steps."""
    return _int(text, 0, "a non-negative integer")


def positive_float(text: str) -> float:
    """``type=`` for durations in seconds: time limits, timeouts."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def byte_size(text: str) -> int:
    """``type=`` for memory sizes: ``"40GB"`` -> bytes (:func:`shard_planner.units.parse_bytes`). A number
    without a unit is refused: ``--mem 40`` meant 40 GB, never 40 bytes."""
    if re.fullmatch(r"\s*[0-9.]+\s*", text):
        raise argparse.ArgumentTypeError(
            f"must be a memory size with its unit such as 40GB, 80GiB or 512MB, got {text!r} (a number alone "
            "would be bytes)")
    try:
        return parse_bytes(text)
    except UserError:
        raise argparse.ArgumentTypeError(
            f"must be a positive memory size such as 40GB, 80GiB or 512MB, got {text!r}") from None


_TOKEN_SUFFIXES = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def token_count(text: str) -> int:
    """``type=`` for token counts: ``4194304``, or with K, M, G as powers of 1024 (``4M`` = 4,194,304: the
    "4M tokens" global batch of the Llama papers is 2048 sequences of 2048 tokens)."""
    t = text.strip().upper().removesuffix("-TOKENS").removesuffix("TOKENS")
    suffix = t[-1:] if t[-1:] in _TOKEN_SUFFIXES else ""
    try:
        value = int(t[: len(t) - len(suffix)]) * _TOKEN_SUFFIXES[suffix]
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of tokens such as 4194304 or 4M, got {text!r}")
    return value
