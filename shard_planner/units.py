"""Conversions at the edges: sizes people type ("40GB", "1.5GiB") and sizes people read."""

from __future__ import annotations

import re

from shard_planner.errors import UserError

# GB follows the GPU datasheets' habit of meaning GiB ("80GB" cards hold 80 GiB of HBM per nvidia-smi
# minus reserved pages); GiB says so explicitly. Decimal units are spelled out as "GBd" nowhere: people
# asking for "--mem 40GB" mean 40 GiB.
_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
          "G": 2**30, "GB": 2**30, "GIB": 2**30, "T": 2**40, "TB": 2**40, "TIB": 2**40}


# Dtype names people type -> the torch dtype name the trace and the plan record.
DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
               "fp32": "float32", "float32": "float32"}


def compute_dtype_name(dtype: str) -> str:
    """``"bf16"`` -> ``"bfloat16"``; UserError for a dtype the tracer does not support."""
    name = DTYPE_NAMES.get(str(dtype).lower())
    if name is None:
        raise UserError(f"unknown compute dtype {dtype!r}: use bf16 or fp32")
    return name


def parse_bytes(text: str) -> int:
    """``"40GB"`` -> 42949672960 (binary units: GB = GiB, as GPU memory is quoted)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise UserError(f"cannot read {text!r} as a memory size: write e.g. 40GB, 80GiB or 512MB")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value <= 0:
        raise UserError(f"memory size {text!r} must be positive")
    return int(value)


def format_duration(seconds: float) -> str:
    """Seconds for people, 4 significant figures, never in exponent form: ``334.1 ms``, ``0.0405 ms``,
    ``10.74 s`` (not ``1.074e+04 ms``), ``12,345 s``."""
    if seconds >= 1000:
        return f"{seconds:,.0f} s"
    if seconds >= 1:
        return f"{seconds:.4g} s"
    ms = seconds * 1e3
    return f"{ms:.4g} ms" if ms >= 1e-3 or ms == 0 else f"{seconds * 1e6:.3g} µs"


def format_bytes(n: float) -> str:
    """Bytes for people: ``format_bytes(3 * 2**30) == "3.00 GiB"``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
