"""Child processes that never outlive the command that started them."""

from __future__ import annotations

import sys


def die_with_parent() -> None:
    """In a child process: on Linux, ask for SIGKILL when the parent dies, so that even a parent killed
    outright (no ``finally`` runs) leaves no child behind (PR_SET_PDEATHSIG, prctl(2)). Elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
