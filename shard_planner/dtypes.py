"""The one table of dtype element sizes (torch.<dtype>.itemsize), by the names traces and plans record.

Names people type ("bf16", "fp32") map to these names in :data:`shard_planner.units.DTYPE_NAMES`.
"""

from __future__ import annotations

from shard_planner.errors import PlanError

# Element sizes of the dtypes a trace or plan may name (torch.<dtype>.itemsize).
DTYPE_BYTES = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
}
# Dtypes FSDP2's mixed precision casts and that get gradients.
FLOAT_DTYPES = ("float64", "float32", "bfloat16", "float16")


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype``; one PlanError line for a name not in :data:`DTYPE_BYTES`."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise PlanError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None
