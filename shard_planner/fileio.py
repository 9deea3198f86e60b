"""Files the tool writes: whole or not at all, and only where they can be written.

Every command that writes checks each output place first (:func:`check_output_file`,
:func:`check_output_dir`), before the work starts, so that a long plan or run never ends in a failed
write; and writes through :func:`write_atomic`, so that a reader (or a second command writing the same
file) never sees half a file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from shard_planner.errors import UserError


class OutputPathError(UserError):
    """An output file or folder cannot be written there (the parent is a file, or not writable)."""


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write a whole file (text or bytes) or nothing: a temporary file in the same folder, then rename.

    Two writers of the same path leave one of the two files whole (``os.replace`` is atomic on POSIX and
    Windows); an interrupted writer leaves the old file, or none. A place that cannot be written raises
    :class:`OutputPathError` in one line."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    except OSError as exc:
        check_output_file(p)  # says why in one line: the parent is a file, not writable, ...
        raise OutputPathError(f"{path}: cannot write: {_reason(exc)}") from exc
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a plan or report is for others too
        os.replace(tmp, p)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):  # a full disk, a folder in the file's place, ...
            raise OutputPathError(f"{path}: cannot write: {_reason(exc)}") from exc
        raise


def check_output_file(path: str | os.PathLike, what: str = "output") -> Path:
    """Check, writing nothing, that ``path`` can be written as a file: it is not a folder, and its
    nearest existing parent is a folder this process can create files in (missing folders below it are
    created by :func:`write_atomic`). Raises :class:`OutputPathError` naming the path and the problem."""
    p = Path(path)
    if p.is_dir():
        raise OutputPathError(f"{path}: cannot write the {what} file: it is a folder")
    _check_parent(p, what, "file")
    return p


def check_output_dir(path: str | os.PathLike, what: str = "output") -> Path:
    """Check that ``path`` is, or can be made, a folder to write files in (see :func:`check_output_file`)."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise OutputPathError(f"{path}: cannot write the {what} folder: it is a file")
        _check_writable(p, path, what, "folder")
        return p
    _check_parent(p, what, "folder")
    return p


def _check_parent(p: Path, what: str, kind: str) -> None:
    parent = p.parent  # as given: "afile", not /home/me/afile; a relative path ends at "."
    while not parent.exists() and not parent.is_symlink():
        parent = parent.parent
    if not parent.is_dir():
        why = "a broken link" if parent.is_symlink() and not parent.exists() else "a file, not a folder"
        raise OutputPathError(f"{p}: cannot write the {what} {kind}: {parent} is {why}")
    _check_writable(parent, p, what, kind)


def _check_writable(folder: Path, path, what: str, kind: str) -> None:
    """Create (and remove) an empty file in ``folder``: the only test that holds for root too, whom
    ``os.access`` and permission bits do not stop, but a read-only or virtual file system does."""
    problem = None
    if not os.access(folder, os.W_OK | os.X_OK):
        problem = "permission denied"
    else:
        try:
            fd, probe = tempfile.mkstemp(dir=folder, prefix=".shard-planner-probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            problem = _reason(exc)
    if problem is not None:
        raise OutputPathError(f"{path}: cannot write the {what} {kind}: {folder} is not writable ({problem})")


def _reason(exc: OSError) -> str:
    return (exc.strerror or type(exc).__name__).lower()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def read_json(path: str | os.PathLike, error: type[Exception], what: str):
    """Parse a JSON file, or raise ``error`` with one line: no such file, or where the JSON breaks."""
    p = Path(path)
    if p.is_dir():
        raise error(f"{path}: is a folder, expected a {what} file (JSON)")
    if not p.is_file():
        raise error(f"{path}: no such {what} file")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except UnicodeDecodeError:
        raise error(f"{path}: not a text file; expected a {what} in JSON") from None
    except OSError as exc:
        raise error(f"{path}: cannot read the {what} file: {_reason(exc)}") from None
