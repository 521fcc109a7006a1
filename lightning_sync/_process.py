"""A child process's bond to the process that started it.

A process started to do part of a job (a rank of the fault-tolerance agent, a Hogwild worker) must not outlive its
parent: if the parent is killed, the job is over, and a child left running would train on unwatched, holding CPU,
memory and ports. On Linux the kernel sends the child a signal when its parent dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> None:
    """Have this process killed (SIGKILL) when its parent dies; with ``parent``, the pid it was started by: if that
    one is gone already (it died before the bond was made), end now. Does nothing where Linux's prctl is missing.
    Safe between fork and exec."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
