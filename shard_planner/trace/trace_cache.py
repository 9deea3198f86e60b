"""A cache on disk of what ``plan`` traces (each degree's trace, the tensor-parallel styles), so that planning
the same model again, at another budget or GPU count, does not trace it again.

    trace = cached(CacheKey("trace", model_path, (hf, dtype, degree, styles)), lambda: trace_model(...))

[Note: What a cached trace is keyed by]
  A trace is a function of the model's code and its inputs, and of the code that traces it. The key of an
  entry is a SHA-256 of:
  - the model argument's bytes (the model file, or a transformers config.json, also inside a folder given
    as the model) and its resolved path, and the working directory;
  - the whole environment, but for the variables named in ``_VOLATILE`` (a model file may read any variable,
    as examples/llama.py reads SHARD_PLANNER_SIZE);
  - every source file of shard_planner (its "version": any edit to the planner is another key) and the
    versions of Python, torch, transformers, peft and torchao;
  - what the caller passes as ``parts``: the kind, the transformers options, the compute dtype, the degree and
    its styles, the sequence- and loss-parallel switches.
  The sequence length and the micro-batch a trace is made at come from the model file (its TRAINING) or
  the transformers options, so they are in the key; the model's fingerprint (trace/structure.py) is a
  function of the same inputs, so an entry can never hold another model's trace. The Python files the model
  file imports from outside the installed packages (a sibling module) are not known before it runs: each entry
  records their SHA-256 when it is written (its ``sources``), and a lookup re-reads them and misses when one
  changed or is gone. Data files a model file reads itself (a YAML of sizes) are not followed: set
  SHARD_PLANNER_TRACE_CACHE=off for such a model, or clear the cache after changing them.

[Note: Where the cache lives and how it is cleaned]
  ``$SHARD_PLANNER_TRACE_CACHE`` when set (``off``, ``0`` or empty: no cache), else
  ``$XDG_CACHE_HOME/shard-planner/traces`` (``~/.cache/shard-planner/traces``). One file per entry, written
  atomically (a temporary file renamed), so concurrent commands never read half a file. After each write the
  least recently used entries are deleted until the folder holds at most ``MAX_CACHE_BYTES`` (a hit marks
  its entry used); an entry keyed by an older shard_planner is never hit again and ages out the same way.
  An entry that cannot be read (truncated, from another format) is a miss and is deleted. Deleting the folder
  at any time is safe.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, fields, is_dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable, TypeVar

logger = logging.getLogger(__name__)

CACHE_ENV = "SHARD_PLANNER_TRACE_CACHE"
# One degree's trace of the Llama example: 0.65 MB at 8B, 1.6 MB at 70B, so this holds the four degrees of about
# 80 different 70B models (or dtypes, fine-tunes, sequence lengths), 200 of 8B
MAX_CACHE_BYTES = 512 * 2**20
FORMAT = 1  # the layout of an entry file: (FORMAT, sources, logged, value)
# Environment variables that change between two runs of the same command in one shell, and one that torch sets
# in the middle of a command (torch 2.13's dynamo, on its first import: TORCHINDUCTOR_CACHE_DIR), so that a
# process that traced before it computes a key computes the same key as one that did not; no trace reads them
_VOLATILE = frozenset({"_", "OLDPWD", "SHLVL", "TERM_SESSION_ID", "WINDOWID", CACHE_ENV, "TORCHINDUCTOR_CACHE_DIR"})
_LIBRARIES = ("torch", "transformers", "peft", "torchao")
_PACKAGE = Path(__file__).resolve().parent.parent  # shard_planner/

T = TypeVar("T")


@dataclass(frozen=True)
class CacheKey:
    """What one cached value depends on beyond the model's code and the planner's ([Note: What a cached trace
    is keyed by]): ``kind`` (what is cached: "model" for degree 1's trace with the model file's defaults,
    "trace", "styles"), the model argument, and ``parts`` (strings, numbers, tuples, dicts, frozen
    dataclasses: :func:`_canonical`)."""

    kind: str
    model: str
    parts: tuple

    def digest(self) -> str:
        h = hashlib.sha256()
        for piece in (FORMAT, self.kind, _canonical(self.parts), _planner_digest(), _model_digest(self.model),
                      os.getcwd(), _environment_digest()):
            h.update(repr(piece).encode())
            h.update(b"\0")
        return h.hexdigest()


def _canonical(value):
    """``value`` as nested tuples whose ``repr`` does not depend on insertion order (a dict's, a set's: the
    tensor-parallel styles are a dict built in an order that may differ between processes)."""
    if is_dataclass(value) and not isinstance(value, type):
        return (type(value).__qualname__, *((f.name, _canonical(getattr(value, f.name))) for f in fields(value)))
    if isinstance(value, dict):
        return ("dict", *sorted((repr(k), _canonical(v)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return ("set", *sorted(repr(_canonical(v)) for v in value))
    if isinstance(value, (tuple, list)):
        return tuple(_canonical(v) for v in value)
    return value


def cache_dir() -> Path | None:
    """See [Note: Where the cache lives and how it is cleaned]; None when the cache is off."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in ("", "0", "off", "no", "false") else Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "shard-planner" / "traces"


def cached(key: CacheKey, compute: Callable[[], T]) -> T:
    """``compute()``'s value, from the cache when an entry for ``key`` is there and its sources are unchanged
    (what ``compute`` logged then is logged again: [Note: A cached trace's log]); else computed and stored. A
    cache that cannot be read or written is a miss, never an error; so is a model that is not a file (a
    ``package.module`` name)."""
    folder = cache_dir()
    if folder is None or not Path(key.model).expanduser().exists():
        return compute()
    path = folder / f"{key.digest()}.pickle"
    found = _read(path)
    if found is not None:
        logged, value = found
        logger.debug("trace cache: %s of %s from %s", key.kind, key.model, path)
        for name, level, message in logged:
            logging.getLogger(name).log(level, "%s", message)
        return value
    with _Logged() as logged:
        value = compute()
    _store(path, (logged.records, value), _local_sources())
    return value


def holds(key: CacheKey) -> bool:
    """Whether the cache has an entry for ``key`` (its sources unchecked: for deciding who does what, never
    for an answer, which :func:`cached` gives)."""
    folder = cache_dir()
    return folder is not None and Path(key.model).expanduser().exists() and (folder / f"{key.digest()}.pickle").is_file()


class _Logged(logging.Handler):
    """[Note: A cached trace's log] What the package's loggers emit while a value is computed (a trace's
    warnings: data-dependent routing assumed, identical blocks not reused), as (logger, level, message), so
    that a hit says the same as the trace it stands for."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.levelno, record.getMessage()))

    def __enter__(self) -> "_Logged":
        logging.getLogger("shard_planner").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("shard_planner").removeHandler(self)


def _read(path: Path):
    """The entry's (logged, value), or None (no entry, a changed source, an unreadable file: deleted)."""
    try:
        with open(path, "rb") as f:
            fmt, sources, logged, value = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception as exc:  # truncated, or written by another format
        logger.debug("trace cache: dropping unreadable %s (%s)", path, exc)
        _unlink(path)
        return None
    if fmt != FORMAT or any(_file_digest(Path(p)) != d for p, d in sources.items()):
        return None
    try:
        os.utime(path)  # used now: the last to be pruned
    except OSError:
        pass
    return logged, value


def _store(path: Path, entry: tuple, sources: dict[str, str]) -> None:
    try:
        data = pickle.dumps((FORMAT, sources, *entry), protocol=pickle.HIGHEST_PROTOCOL)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
    except Exception as exc:  # a read-only disk, an unpicklable value: no cache, the same answer
        logger.debug("trace cache: not written to %s (%s)", path, exc)
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as exc:  # a full disk
        logger.debug("trace cache: not written to %s (%s)", path, exc)
        _unlink(Path(tmp))
        return
    prune(path.parent)


def prune(folder: Path, max_bytes: int = MAX_CACHE_BYTES) -> None:
    """Delete the least recently used entries of ``folder`` until they hold at most ``max_bytes``."""
    entries = []
    for p in folder.glob("*.pickle"):
        try:
            st = p.stat()
        except OSError:
            continue
        entries.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in entries)
    for _, size, p in sorted(entries):
        if total <= max_bytes:
            break
        _unlink(p)
        total -= size


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _file_digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _model_digest(model: str) -> tuple:
    """The model argument's resolved path and bytes (a folder: its config.json)."""
    path = Path(model).expanduser().resolve()
    read = path / "config.json" if path.is_dir() else path
    return str(path), _file_digest(read)


@functools.cache
def _planner_digest() -> str:
    """shard_planner's sources and the libraries' versions (once per process: 167 files, 0.04 s)."""
    h = hashlib.sha256(sys.version.encode())
    for name in _LIBRARIES:
        try:
            h.update(f"{name}={metadata.version(name)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{name}=absent".encode())
    for p in sorted(_PACKAGE.rglob("*.py")):
        h.update(str(p.relative_to(_PACKAGE)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def _environment_digest() -> str:
    env = sorted((k, v) for k, v in os.environ.items() if k not in _VOLATILE)
    return hashlib.sha256(repr(env).encode()).hexdigest()


def _local_sources() -> dict[str, str]:
    """path -> SHA-256 of the source file of each loaded module that is neither installed nor shard_planner's
    (the model file and what it imports from beside it). The installed ones are told by their path's prefix,
    as written and resolved (1,800 modules with torch and transformers loaded: a few ms; resolving every path
    took 0.09 s)."""
    skipped = tuple(_installed_prefixes())
    sources = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not isinstance(file, str) or file.startswith(skipped):
            continue
        path = Path(file).resolve()
        if path.is_file() and not str(path).startswith(skipped):
            sources[str(path)] = _file_digest(path)
    return sources


@functools.cache
def _installed_prefixes() -> frozenset[str]:
    """The folders of the interpreter's libraries and site-packages, and shard_planner's own, each as written
    and resolved, ending in a separator."""
    folders = [Path(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")] + [_PACKAGE]
    return frozenset(os.path.join(str(f), "") for folder in folders for f in (folder, folder.resolve()))
