"""Progress for long work (tracing a large model, solving, running steps): one line on a terminal.

    with progress("solving", total=len(budgets)) as p:
        for budget in budgets:
            ...
            p.advance()

The line is drawn on stderr, redrawn in place (carriage return) at most ``MIN_REDRAW_S`` apart, and
finished with a newline. It is drawn only when stderr is a terminal and the environment variable ``CI``
is not set: in CI, in tests and when output is piped, ``progress`` does nothing visible (the object still
counts, so callers never branch). No logging: a progress line is not a log record.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import IO, Iterator

MIN_REDRAW_S = 0.1  # at most ten redraws a second: a terminal is slower than a tight loop


def progress_enabled(stream: IO | None = None) -> bool:
    """True when a progress line would be seen: ``stream`` (stderr) is a terminal and ``CI`` is unset."""
    stream = sys.stderr if stream is None else stream
    if os.environ.get("CI"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    """Counts steps of one piece of work and, when enabled, redraws ``label: done/total [pct] elapsed``."""

    def __init__(self, label: str, total: int | None = None, *, stream: IO | None = None,
                 enabled: bool | None = None, clock=time.monotonic):
        if total is not None and total < 0:
            raise ValueError(f"progress total must be >= 0, got {total}")
        self.label = label
        self.total = total
        self.done = 0
        self.detail = ""
        self._stream = sys.stderr if stream is None else stream
        self.enabled = progress_enabled(self._stream) if enabled is None else enabled
        self._clock = clock
        self._start_s = clock()
        self._last_draw_s: float | None = None
        self._width = 0  # characters of the last line drawn, to blank leftovers when it shrinks

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self._start_s

    def advance(self, n: int = 1, detail: str | None = None) -> None:
        """``n`` more steps done; ``detail`` (optional) says what is being worked on now."""
        self.done += n
        if detail is not None:
            self.detail = detail
        self._draw(force=False)

    def set_detail(self, detail: str) -> None:
        self.detail = detail
        self._draw(force=False)

    def line(self) -> str:
        """The text of the progress line (also what a test can check)."""
        if self.total:
            pct = 100.0 * min(self.done, self.total) / self.total
            count = f"{self.done}/{self.total} [{pct:3.0f}%] "
        elif self.done:
            count = f"{self.done} "
        else:  # work that is not counted (one trace, one report): a count that stays at 0 says nothing
            count = ""
        text = f"{self.label}: {count}{self.elapsed_s:.1f}s"
        return f"{text} {self.detail}" if self.detail else text

    def _draw(self, force: bool) -> None:
        if not self.enabled:
            return
        now = self._clock()
        if not force and self._last_draw_s is not None and now - self._last_draw_s < MIN_REDRAW_S:
            return
        self._last_draw_s = now
        text = self.line()
        pad = " " * max(0, self._width - len(text))
        self._stream.write("\r" + text + pad)
        self._stream.flush()
        self._width = len(text)

    def close(self) -> None:
        """Draw the final state and end the line."""
        if not self.enabled:
            return
        self._draw(force=True)
        self._stream.write("\n")
        self._stream.flush()


@contextmanager
def progress(label: str, total: int | None = None, *, stream: IO | None = None,
             enabled: bool | None = None) -> Iterator[Progress]:
    """A :class:`Progress` for the duration of the block; the line is finished even on an error."""
    p = Progress(label, total, stream=stream, enabled=enabled)
    p._draw(force=True)
    try:
        yield p
    finally:
        p.close()
