"""Argument types every command shares, and the parser that reports a bad value in one line.

    p.add_argument("--gpus", type=positive_int, required=True)
    p.add_argument("--mem", type=byte_size, required=True)

A type that rejects a value raises ``argparse.ArgumentTypeError("must be ..., got '0'")``; :class:`Parser`
turns argparse's ``argument --gpus: must be ...`` into :class:`ArgumentValueError` (``--gpus must be a
positive integer, got '0'``), which the entry point prints as one line and exits 2. Other argparse
errors (a missing argument, an unknown choice) keep argparse's usage message.
"""

from __future__ import annotations

import argparse
import re

from shard_planner.errors import UserError
from shard_planner.units import parse_bytes

# argparse words a rejected value as "argument <flags>: <the type's message>" (argparse.ArgumentError).
_REJECTED_VALUE = re.compile(r"argument (\S+): (must be .*)")


class ArgumentValueError(UserError):
    """A command-line value of the right shape but out of range (``--gpus 0``, ``--mem forty``)."""


class Parser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose type errors become one-line :class:`ArgumentValueError`\\ s
    (sub-command parsers inherit the class)."""

    def error(self, message: str):
        m = _REJECTED_VALUE.fullmatch(message)
        if m:
            raise ArgumentValueError(f"{m.group(1)} {m.group(2)}")
        super().error(message)


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
    """``type=`` for memory sizes: ``"40GB"`` -> bytes (:func:`shard_planner.units.parse_bytes`)."""
    try:
        return parse_bytes(text)
    except UserError:
        raise argparse.ArgumentTypeError(
            f"must be a positive memory size such as 40GB, 80GiB or 512MB, got {text!r}") from None
