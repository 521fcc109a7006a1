"""Small helpers every lightning_sync strategy uses: its launch arguments checked the same way, a fresh
communication context, and the one way to hold a backward's gradient collectives back. The strategies'
shared Lightning hooks are :class:`lightning_sync.strategies._base.SyncStrategy`."""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

from lightning_sync import comms
from lightning_sync._checks import check_bool

__all__ = [
    "as_timedelta",
    "check_bool",
    "check_launch_args",
    "new_comm",
    "no_sync_of",
    "PASSTHROUGH",
]

# Lightning components a user may pass explicitly; anything else is a typo and raises.
PASSTHROUGH = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")


def as_timedelta(timeout: float | timedelta) -> timedelta:
    """A collective timeout given in seconds (or already a ``timedelta``), checked."""
    if isinstance(timeout, timedelta) and timeout > timedelta(0):
        return timeout
    if (
        isinstance(timeout, timedelta)
        or not isinstance(timeout, (int, float))
        or isinstance(timeout, bool)
        or not 0 < timeout < math.inf
    ):
        raise ValueError(f"timeout must be a finite number of seconds > 0 or a timedelta > 0, got {timeout!r}")
    return timedelta(seconds=timeout)


def new_comm() -> comms.CommContext:
    """A strategy's own communication context, with a statistics observer (the telemetry reads it)."""
    return comms.CommContext(observer=comms.CommStats())


def no_sync_of(switch: Any | None) -> AbstractContextManager[Any]:
    """``switch.no_sync()`` (a ``SyncSwitch``: the bucketer or the ZeRO engine), or nothing before setup."""
    return switch.no_sync() if switch is not None else nullcontext()


def check_launch_args(owner: str, process_group_backend: Any, start_method: Any, kwargs: dict[str, Any]) -> None:
    """Validate the launch arguments every strategy takes; unknown keyword arguments are typos."""
    if start_method not in ("popen", "spawn", "fork", "forkserver"):
        raise ValueError(f"start_method must be one of ['popen', 'spawn', 'fork', 'forkserver'], got {start_method!r}")
    if process_group_backend not in (None, "gloo", "nccl"):
        raise ValueError(f"process_group_backend must be one of [None, 'gloo', 'nccl'], got {process_group_backend!r}")
    unknown = sorted(set(kwargs) - set(PASSTHROUGH))
    if unknown:
        raise ValueError(f"{owner} got unknown arguments {unknown}; besides its own it accepts {list(PASSTHROUGH)}")
