"""Trace files: read a trace.json (written with ``ModelTrace.to_json``), or trace a model file instead."""

from __future__ import annotations

import json
from pathlib import Path

from shard_planner.errors import UserError, first_line
from shard_planner.modelfile import is_trace_file
from shard_planner.trace.types import ModelTrace
from shard_planner.units import compute_dtype_name


def load_trace(path: str | Path) -> ModelTrace:
    """Read a trace.json written by ``shard-planner trace``; UserError in one line if it is not one."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise UserError(f"{path}: cannot read trace file ({exc.strerror or exc})") from exc
    try:
        return ModelTrace.from_json(text)
    except UserError as exc:
        raise UserError(f"{path}: {exc}") from exc
    except (json.JSONDecodeError, TypeError, KeyError, ValueError, AttributeError) as exc:
        raise UserError(f"{path}: not a shard-planner trace file ({type(exc).__name__}: {first_line(exc)})") from exc


def trace_or_load(
    path: str | Path, *, batch_sizes: tuple[int, int] = (1, 2), dtype: str = "bfloat16"
) -> ModelTrace:
    """A trace.json is loaded (its dtype must match ``dtype``); anything else is a model file to trace."""
    if is_trace_file(path):  # a transformers config is a model
        trace = load_trace(path)
        want = compute_dtype_name(dtype)
        if trace.compute_dtype != want:
            raise UserError(
                f"{path}: traced in {trace.compute_dtype}, but {want} was asked for: re-run shard-planner trace --dtype"
            )
        return trace
    from shard_planner.trace.tracer import trace_model  # torch: only to trace

    return trace_model(str(path), batch_sizes=batch_sizes, dtype=dtype)


def trace_model_file(trace: ModelTrace, trace_path: str | Path) -> str:
    """The model file ``trace`` was traced from, as an absolute path: as recorded (absolute, or from the
    current folder), else relative to the trace file's folder; an importable ``package.module`` (or a file
    found nowhere) as recorded. A plan made from a trace.json records this, never the trace.json."""
    given = Path(trace.model_path)
    candidates = [given] + ([Path(trace_path).resolve().parent / given] if not given.is_absolute() else [])
    for c in candidates:
        if c.is_file():
            return str(c.resolve())
    return trace.model_path
