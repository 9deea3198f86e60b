"""The folder of a run's distributed checkpoint: checks before the ranks start, the side file, its size.
No torch, so that the CLI and the runner check a folder without importing it (execute/checkpoint.py
saves and loads)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from shard_planner.errors import UserError, first_line

SIDE_FILE = "shard-planner-checkpoint.json"
METADATA = ".metadata"  # DCP's FileSystemWriter writes it last, after every shard file
SIDE_SCHEMA_VERSION = 1


class CheckpointError(UserError):
    """A checkpoint folder that cannot be used: missing, incomplete, unreadable or corrupted."""


# ---- the folder ----
def check_new_directory(directory: str | os.PathLike, create: bool = True) -> Path:
    """``directory`` for a new checkpoint: absent (created unless not ``create``) or an empty folder; never
    one with files."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"--checkpoint-dir {path}: is a file, not a folder")
    if path.is_dir() and any(path.iterdir()):
        raise CheckpointError(f"--checkpoint-dir {path}: the folder is not empty; give a new or empty folder "
                              "(a checkpoint is never written over another)")
    if not create:
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"--checkpoint-dir {path}: cannot create it: {exc.strerror or exc}") from None
    return path


def read_side_file(directory: str | os.PathLike) -> dict:
    """The saving run's record (execute/checkpoint.py, [Note: checking that every tensor came back]); CheckpointError when the
    folder is not a complete checkpoint written by ``shard-planner run``."""
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    if not (path / METADATA).is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint: DCP's {METADATA} file is missing")
    try:
        record = json.loads((path / SIDE_FILE).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {SIDE_FILE} is missing: not a checkpoint written by shard-planner run "
                              "(it holds the digests the restore is checked against)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}/{SIDE_FILE} is unreadable: {first_line(exc)}") from None
    keys = ("schema_version", "step", "data_ranks", "micro_batch", "losses_after", "digests", "plan_fingerprint")
    if not isinstance(record, dict) or any(k not in record for k in keys) \
            or record["schema_version"] != SIDE_SCHEMA_VERSION:
        raise CheckpointError(f"{path}/{SIDE_FILE} is malformed (expected schema {SIDE_SCHEMA_VERSION} with "
                              f"{', '.join(keys)})")
    return record


def write_side_file(directory: str | os.PathLike, record: dict) -> None:
    tmp = Path(directory) / f".{SIDE_FILE}.tmp"
    tmp.write_text(json.dumps({"schema_version": SIDE_SCHEMA_VERSION, **record}, indent=1))
    os.replace(tmp, Path(directory) / SIDE_FILE)


def directory_bytes(directory: str | os.PathLike) -> int:
    """Bytes on disk of DCP's files in ``directory`` (the shard files and .metadata; not the side file)."""
    return sum(f.stat().st_size for f in Path(directory).iterdir() if f.is_file() and f.name != SIDE_FILE
               and not f.name.startswith(f".{SIDE_FILE}"))
