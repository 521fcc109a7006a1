"""Fault injection for reliability tests: a rank that dies with a real signal at a chosen point of a step
(:class:`KillAtStep`), and a pickle that runs a command when loaded (:class:`UnpicklePayload`).

From the command line of a test run::

    lightning-sync train '+diagnostics.fault={_target_: lightning_sync.testing.faults.KillAtStep, rank: 1, step: 5}'
"""

from __future__ import annotations

import os
import signal as _signal
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_sync._checks import check_int

__all__ = ["KillAtStep", "UnpicklePayload"]


class KillAtStep(pl.Callback):
    """Send ``signal`` (default SIGKILL: no handler, no cleanup) to this process on global rank ``rank``
    between the forward pass and the backward pass of optimizer step ``step`` (1-based): mid-step, after
    the step's forward and before any of its gradient collectives.

    Args:
        rank: the global rank that dies (an int >= 0).
        step: the 1-based optimizer step in which it dies (an int >= 1).
        signal: the signal's name or number (``"KILL"``, ``"SIGTERM"``, 9, ...).
    """

    def __init__(self, rank: int, step: int, signal: str | int = "KILL") -> None:
        check_int("rank", rank, 0)
        check_int("step", step, 1)
        names = sorted(s.name for s in _signal.Signals)
        try:
            self.signal = _signal.Signals(signal) if isinstance(signal, int) else \
                _signal.Signals[signal if str(signal).startswith("SIG") else f"SIG{signal}"]
        except (KeyError, ValueError):
            raise ValueError(f"signal must name a signal, got {signal!r}; allowed: {names}") from None
        self.rank, self.step = rank, step

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if trainer.global_rank == self.rank and trainer.global_step + 1 == self.step:
            os.kill(os.getpid(), self.signal)


class UnpicklePayload:
    """Unpickling this runs ``touch <marker>`` through ``os.system``: a hostile checkpoint entry whose effect
    (the marker file) shows whether a loader ran arbitrary code."""

    def __init__(self, marker: str | os.PathLike[str]) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch '{self.marker}'",))
