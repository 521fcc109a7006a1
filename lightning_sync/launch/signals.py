"""The signals a run may be told to stop on, by name or number, without importing Lightning: the sbatch
renderer validates ``launch.signal`` with it before anything heavier is loaded."""

from __future__ import annotations

import signal
from typing import Any

__all__ = ["ALLOWED_SIGNALS", "resolve_signal"]

ALLOWED_SIGNALS = ("USR1", "USR2", "TERM", "INT", "HUP", "CONT", "URG", "XCPU")


def resolve_signal(value: Any) -> signal.Signals:
    """``"USR1"``, ``"SIGUSR1"``, ``10`` or ``signal.SIGUSR1`` -> ``signal.SIGUSR1``; anything else: ValueError."""
    if isinstance(value, signal.Signals):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return signal.Signals(value)
        except ValueError:
            pass
    elif isinstance(value, str):
        name = value.strip().upper().removeprefix("SIG")
        if name in ALLOWED_SIGNALS:
            return signal.Signals[f"SIG{name}"]
    raise ValueError(f"signal must be one of {list(ALLOWED_SIGNALS)} (or its number), got {value!r}")
