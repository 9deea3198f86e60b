"""Each warning once per command.

[Note: each warning once per cause]
A command's warnings are printed once per cause, never once per tensor-parallel degree or per re-plan:
``plan`` runs the planner once per degree, in this process and in its forked helpers
(cli/background.py), and ``tune`` runs it again at several budgets, so "budget exceeds the memory of the
device" or "no plan fits without CPU offload" came three or four times. The cause of a warning is its
text (logger and formatted message): two records with the same text are one cause, two with different
figures are two. The command's processes share what they have printed through one file, created before
any helper forks (an unlinked temporary file whose descriptor the helpers inherit), read and appended
under a POSIX record lock (``fcntl.lockf``: per process, so a parent and its forked child exclude each
other, where ``flock`` on an inherited descriptor would not). Without fcntl (Windows: no fork either)
each process remembers on its own.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None


class OncePerCause(logging.Filter):
    """A handler's filter that lets a WARNING (or worse) through only the first time its text is seen by
    any process of the command; debug and info records pass (see [Note: each warning once per cause])."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()  # record locks do not exclude the threads of one process
        self._seen: set[str] = set()  # without fcntl
        self._file = tempfile.TemporaryFile() if fcntl is not None else None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = hashlib.sha1(f"{record.name}\0{record.getMessage()}".encode()).hexdigest()
        with self._lock:
            if self._file is None:
                first = key not in self._seen
                self._seen.add(key)
                return first
            return self._first_in_file(key)

    def _first_in_file(self, key: str) -> bool:
        fd = self._file.fileno()
        fcntl.lockf(fd, fcntl.LOCK_EX)
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            seen = b""
            while chunk := os.read(fd, 1 << 16):
                seen += chunk
            if key.encode() in seen.split(b"\n"):
                return False
            os.lseek(fd, 0, os.SEEK_END)
            os.write(fd, key.encode() + b"\n")
            return True
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
