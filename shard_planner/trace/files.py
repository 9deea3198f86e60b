"""Trace files: read a trace.json (written with ``ModelTrace.to_json``), or trace a model file instead."""

from __future__ import annotations

import json
from pathlib import Path

from shard_planner.errors import UserError, first_line
from shard_planner.model.hf import CONFIG_NAME
from shard_planner.model.modelfile import is_trace_file
from shard_planner.trace.types import ModelTrace
from shard_planner.units import compute_dtype_name


def load_trace(path: str | Path) -> ModelTrace:
    """Read a trace.json written by ``shard-planner trace``; UserError in one line if it is not one, saying
    what the file was taken for (:func:`_taken_for`) and what is wrong with it."""
    p = Path(path)

    def wrong(problem: str) -> UserError:
        return UserError(f"{path}: {_taken_for(p)}, but {problem}")

    try:
        text = p.read_text()
    except OSError as exc:
        raise wrong("there is no such file" if isinstance(exc, FileNotFoundError)
                    else f"it cannot be read ({exc.strerror or exc})") from exc
    try:
        data = json.loads(text)
    except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
        where = f"{exc.msg} at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else exc
        raise wrong(f"it is not JSON: {where}") from exc
    if p.name == CONFIG_NAME and not isinstance(data, dict):
        raise wrong("it is not a JSON object")
    if p.name == CONFIG_NAME:
        raise wrong("it has no model_type")
    try:
        return ModelTrace.from_json(text)
    except UserError as exc:
        raise wrong(f"it is not one: {exc}") from exc
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise wrong(f"it is not one ({type(exc).__name__}: {first_line(exc)})") from exc


def _taken_for(path: Path) -> str:
    """What a .json argument was taken for: a file named config.json is a transformers config (one that
    has a model_type is read as one before this); any other .json that is not one
    (:func:`shard_planner.model.modelfile.is_trace_file`) is read as a trace.json."""
    if path.name == CONFIG_NAME:
        return "taken for a transformers config (by its name)"
    return "taken for a trace.json from shard-planner trace (a .json that is not a transformers config, which has a " \
           "model_type)"


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
