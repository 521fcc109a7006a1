"""The communication context a diagnostic callback issues its own collectives through."""

from __future__ import annotations

from typing import Any

from lightning_sync import comms

__all__ = ["comm_of"]


def comm_of(trainer: Any) -> comms.CommContext:
    """The strategy's context, so the callback's collectives are numbered, watched and measured with the job's;
    under a strategy that is not ours, a bare context (its calls go to the default process group unmeasured)."""
    comm = getattr(trainer.strategy, "comm", None)
    return comm if isinstance(comm, comms.CommContext) else comms.CommContext()
