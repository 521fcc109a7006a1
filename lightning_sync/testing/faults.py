"""Fault injection for reliability tests: a rank that dies with a real signal at a chosen point of a step.

From the command line of a test run::

    lightning-sync train '+diagnostics.fault={_target_: lightning_sync.testing.faults.KillAtStep, rank: 1, step: 5}'
"""

from __future__ import annotations

import os
import signal as _signal
import lightning.pytorch as pl
import torch

__all__ = ["KillAtStep"]


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
        for name, value, low in (("rank", rank, 0), ("step", step, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
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
