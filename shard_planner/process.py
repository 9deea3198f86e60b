"""Child processes that never outlive the command that started them."""

from __future__ import annotations

import signal
import sys


def die_with_parent() -> None:
    """In a child process: on Linux, ask for SIGKILL when the parent dies, so that even a parent killed
    outright (no ``finally`` runs) leaves no child behind (PR_SET_PDEATHSIG, prctl(2)). Elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def exit_status(code: int) -> str:
    """'was killed by SIGKILL' / 'exited with code 3', from a return code as subprocess gives it (a signal's
    is negative; ``os.waitstatus_to_exitcode`` turns a waitpid status into one)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
