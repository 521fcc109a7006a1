"""The communication context a diagnostic callback issues its own collectives through."""

from __future__ import annotations

from typing import Any

from lightning_sync import comms

__all__ = ["blocked_seconds", "comm_of"]


def comm_of(trainer: Any) -> comms.CommContext:
    """The strategy's context, so the callback's collectives are numbered, watched and measured with the job's;
    under a strategy that is not ours, a bare context (its calls go to the default process group unmeasured)."""
    comm = getattr(trainer.strategy, "comm", None)
    return comm if isinstance(comm, comms.CommContext) else comms.CommContext()


def blocked_seconds(trainer: Any) -> float:
    """Seconds this rank has spent blocked in its strategy's collectives (0 where the strategy measures none: a
    waiting rank is then counted as busy, which can only hide a straggler, never invent one)."""
    observer = getattr(getattr(trainer.strategy, "comm", None), "observer", None)
    blocked = getattr(observer, "blocked_seconds", None)
    return blocked() if blocked is not None else 0.0
