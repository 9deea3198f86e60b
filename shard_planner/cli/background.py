"""A helper process for one command: functions run in a forked child, one after another, while the
command goes on.

`plan` spends most of its first seconds importing: torch (~1.1 s here), torch._dynamo (~0.9 s, which
FakeTensorMode imports when the tracer creates it), CP-SAT and matplotlib (~0.5 s), and its last second
rendering three figures (~0.25 s each). Only the trace needs dynamo, only the planner and the report need
CP-SAT and matplotlib, and figures render independently, so on a machine with two cores or more the
command forks a helper before torch is imported: the helper traces while the command imports the planner
and the report and loads the profile, then imports matplotlib while the command plans, then renders
figures while the command renders the others. When the trace cache already holds the trace there is
nothing to overlap with the imports, and ``plan`` imports the planner before it forks its helpers, which
inherit it; the report is imported by the rendering helper and by the command while it waits for a search
(cli/plan.py [Note: Importing before the helpers fork]). Calls and results
travel pickled through pipes (the Llama 8B trace: 0.5 MB, 16 ms to pickle; a report figure ~0.1 MB, 8 ms,
rendering byte-identical PNGs). What arrives through a pipe is unpickled, and each call runs, without the
cyclic collector (cli/collector.py [Note: the collector during a command]): traces and searches build objects
that stay until the command ends.

[Note: when the helper is not forked]
Each call runs in this process instead, when its result is asked for, where forking would not pay or
would not be safe: no ``os.fork`` (Windows), one CPU, or torch already imported here (forking a process
whose torch may have started thread pools can deadlock the child; it is also the case in which there is
no import left to overlap, e.g. the test suite calling the CLI in-process).

[Note: failures and interrupts]
An exception in a call is pickled back and raised by :meth:`Call.result` (with the helper's traceback as
a note, which ``--debug`` shows); one whose class the command may not have (a model file's own) becomes a
RuntimeError naming its type and message. A helper that dies (killed, ``os._exit`` in a model file) is
reported with its exit status. Leaving :func:`helper_process`'s block (normally, on an error, Ctrl-C or
SIGTERM) kills the helper and reaps it; it also dies with this process (PR_SET_PDEATHSIG). A Ctrl-C in the
terminal reaches both: the helper's KeyboardInterrupt comes back as its call's result, this process's
unwinds.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import struct
import sys
import threading
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from shard_planner.cli.collector import without_collections
from shard_planner.process import die_with_parent, exit_status

_LENGTH = struct.Struct("<Q")  # every message: its length, then the pickle


class HelperDied(RuntimeError):
    """The helper process ended without answering a call (killed, crashed, ``os._exit``); ``ended`` says
    how (``"exited with code 3"``, ``"was killed by SIGKILL"``)."""

    def __init__(self, message: str, ended: str = ""):
        super().__init__(message)
        self.ended = ended


def _worth_forking() -> bool:
    """See [Note: when the helper is not forked]."""
    return hasattr(os, "fork") and (os.cpu_count() or 1) >= 2 and "torch" not in sys.modules


class Call:
    """One call given to the helper; :meth:`result` waits for it."""

    def __init__(self, helper: "Helper", fn: Callable[..., Any], args: tuple) -> None:
        self._helper, self._fn, self._args = helper, fn, args
        self._done, self._value = False, None

    def result(self) -> Any:
        """``fn(*args)``'s result, or its exception raised here."""
        if not self._done:
            self._value = self._helper._result_of(self)
            self._done = True
        kind, value, child_traceback = self._value
        if kind == "ok":
            return value
        if child_traceback:
            value.add_note(f"in the helper process (shard_planner/cli/background.py):\n{child_traceback}")
        raise value


class Helper:
    """The helper process (or, where it is not forked, this process); see the module docstring."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self._to_child = self._from_child = None
        self._pending: list[Call] = []  # calls sent whose result has not been read, oldest first
        self.forked = _worth_forking()
        if self.forked:
            self._fork()

    def _fork(self) -> None:
        sys.stdout.flush()  # what is buffered now must not be written twice, by both processes
        sys.stderr.flush()
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the helper: never returns
            os.close(requests_w)
            os.close(replies_r)
            _serve(requests_r, replies_w)
        os.close(requests_r)
        os.close(replies_w)
        self.pid = pid
        self._to_child, self._from_child = os.fdopen(requests_w, "wb"), os.fdopen(replies_r, "rb")

    def submit(self, fn: Callable[..., Any], *args: Any) -> Call:
        """Start ``fn(*args)`` (``fn`` a module-level function) in the helper; here, it runs on
        :meth:`Call.result`."""
        call = Call(self, fn, args)
        if self.pid is not None:
            _write(self._to_child, pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL))
            self._pending.append(call)
        return call

    def _result_of(self, call: Call) -> tuple:
        if call not in self._pending:  # run here
            try:
                return "ok", call._fn(*call._args), ""
            except Exception as exc:
                return "error", exc, ""
        while True:  # replies come in the order of the calls
            first = self._pending.pop(0)
            reply = self._read_reply(first)
            if first is call:
                return reply
            first._value, first._done = reply, True

    def _read_reply(self, call: Call) -> tuple:
        data = _read(self._from_child)
        if data is None:
            _, status = os.waitpid(self.pid, 0)
            self.pid = None
            ended = exit_status(os.waitstatus_to_exitcode(status))
            return "error", HelperDied(f"the helper process {ended} during {call._fn.__name__}", ended), ""
        try:
            with without_collections():
                return pickle.loads(data)
        except Exception as exc:
            return "error", RuntimeError(f"the result of {call._fn.__name__} could not be read from the helper "
                                         f"process: {exc}"), ""

    def close(self) -> None:
        """End the helper (killed if it is still running a call) and reap it."""
        for f in (self._to_child, self._from_child):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        self._to_child = self._from_child = None
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(self.pid, 0)
            self.pid = None


@contextmanager
def helper_process() -> Iterator[Helper]:
    """A :class:`Helper` for the block; ended with it (see [Note: failures and interrupts])."""
    helper = Helper()
    try:
        yield helper
    finally:
        helper.close()


def _serve(requests_fd: int, replies_fd: int) -> None:
    """The helper's life: run each call read from ``requests_fd``, write its pickled ``(kind, value,
    traceback)`` to ``replies_fd``, until the command closes the pipe; exit without running the
    command's cleanup (atexit handlers, ``finally`` blocks up the stack)."""
    code = 0
    try:
        die_with_parent()
        with os.fdopen(requests_fd, "rb") as requests, os.fdopen(replies_fd, "wb") as replies:
            for data in _drained(requests):
                with without_collections():
                    fn, args = pickle.loads(data)
                    reply = _reply(fn, args)
                _write(replies, reply)
                _flush_stdio()
    except BaseException:  # the command is gone (broken pipe) or interrupted us: nothing left to tell it
        code = 1
    finally:
        _flush_stdio()
        os._exit(code)


def _drained(requests) -> Iterator[bytes]:
    """The requests, read by a thread as they come, so that the command never waits to write one while this
    process writes a reply the command has not asked for yet (a request and a reply larger than a pipe holds,
    64 KiB on Linux, would wait on each other: the command sending the next degree's trace while this process
    sends the last search's answer)."""
    waiting: queue.Queue[bytes | None] = queue.Queue()

    def read_all() -> None:
        try:
            while (data := _read(requests)) is not None:
                waiting.put(data)
        finally:
            waiting.put(None)

    threading.Thread(target=read_all, daemon=True).start()
    while (data := waiting.get()) is not None:
        yield data


def _reply(fn: Callable[..., Any], args: tuple) -> bytes:
    try:
        payload = ("ok", fn(*args), "")
    except BaseException as exc:  # every failure goes back to the command, KeyboardInterrupt too
        payload = ("error", _sendable(exc), traceback.format_exc())
    try:
        return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        failed = payload[1] if payload[0] == "error" else exc
        return pickle.dumps(("error", RuntimeError(f"{_name(failed)}: {failed} (could not be sent from the helper "
                                                   "process)"), payload[2] or traceback.format_exc()))


def _sendable(exc: BaseException) -> BaseException:
    """``exc``, or a RuntimeError naming it when its class may not exist in the command (a model
    file's own exception class lives in a module only the helper imported)."""
    if type(exc).__module__.split(".")[0] in ("builtins", "shard_planner", "torch"):
        return exc
    return RuntimeError(f"{_name(exc)}: {exc}")


def _name(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}"


def _write(f, data: bytes) -> None:
    f.write(_LENGTH.pack(len(data)))
    f.write(data)
    f.flush()


def _read(f) -> bytes | None:
    """One message, or None at the end of the pipe."""
    head = f.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    return f.read(_LENGTH.unpack(head)[0])


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
