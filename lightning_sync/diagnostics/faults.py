"""Fault injection for reliability tests: a rank that dies with a real signal at a chosen phase of a step
(:class:`KillAtStep`), and a pickle that runs a command when loaded (:class:`UnpicklePayload`).

From the command line of a test run::

    lightning-sync train '+diagnostics.fault={_target_: lightning_sync.diagnostics.faults.KillAtStep, rank: 1, step: 5}'
"""

from __future__ import annotations

import os
import signal as _signal
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_sync._checks import check_int
from lightning_sync.comms.membership_keys import ENV_MEMBER

__all__ = ["PHASES", "KillAtStep", "UnpicklePayload"]


PHASES = ("forward", "before_backward", "backward", "optimizer_step", "checkpoint", "requeue")
"""Where in optimizer step ``step`` :class:`KillAtStep` strikes:

* ``forward``: inside the model's forward pass (a forward pre-hook of the LightningModule);
* ``before_backward``: after the forward, before any gradient collective of the step;
* ``backward``: inside backward, once the first parameter's gradient is ready; autograd reaches the
  first layers last, so the buckets (or ZeRO's reduce-scatters) of the later ones are already in flight;
* ``optimizer_step``: after backward, just before the optimizer steps;
* ``checkpoint``: while the checkpoint saved at that step is assembled (``on_save_checkpoint``), before its
  files are written (needs a checkpoint at that step);
* ``requeue``: the rank signals itself ``requeue_signal`` at the end of the step, and dies while the
  preemption checkpoint that the signal causes is being saved (needs ``RequeueOnSignal``).
"""


class KillAtStep(pl.Callback):
    """Send ``signal`` (default SIGKILL: no handler, no cleanup) to this process on global rank ``rank`` in
    optimizer step ``step`` (1-based), at ``phase`` (one of :data:`PHASES`; by default between the step's
    forward and backward passes).

    Args:
        rank: the global rank that dies (an int >= 0).
        step: the 1-based optimizer step in which it dies (an int >= 1).
        signal: the signal's name or number (``"KILL"``, ``"SIGTERM"``, 9, ...).
        phase: where in the step (see :data:`PHASES`).
        requeue_signal: with ``phase="requeue"``, the signal that asks ``RequeueOnSignal`` to stop.
        member: under the fault-tolerance agent, the member id that dies (``n0s1i0``) instead of a rank: ranks
            move when a member is lost, so a rank would die again in the step's replay.
    """

    def __init__(
        self,
        rank: int = 0,
        step: int = 1,
        signal: str | int = "KILL",
        phase: str = "before_backward",
        requeue_signal: str | int = "USR1",
        member: str | None = None,
    ) -> None:
        check_int("rank", rank, 0)
        check_int("step", step, 1)
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {list(PHASES)}, got {phase!r}")
        self.signal, self.requeue_signal = _resolve(signal), _resolve(requeue_signal)
        self.rank, self.step, self.phase, self.member = rank, step, phase, member
        self._armed = False  # the requeue phase: signalled, waiting for the preemption checkpoint

    def _due(self, trainer: pl.Trainer, phase: str) -> bool:
        return phase == self.phase and self._mine(trainer) and trainer.global_step + 1 == self.step

    def _mine(self, trainer: pl.Trainer) -> bool:
        if self.member is not None:
            return os.environ.get(ENV_MEMBER) == self.member
        return trainer.global_rank == self.rank

    def _die(self) -> None:
        os.kill(os.getpid(), self.signal)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.phase == "forward":
            pl_module.register_forward_pre_hook(lambda *_: self._die() if self._due(trainer, "forward") else None)
        elif self.phase == "backward":
            first = next(p for p in pl_module.parameters() if p.requires_grad)
            first.register_post_accumulate_grad_hook(
                lambda _: self._die() if trainer.training and self._due(trainer, "backward") else None
            )

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._due(trainer, "before_backward"):
            self._die()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._due(trainer, "optimizer_step"):
            self._die()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        # global_step has moved on: the step that just ended is global_step
        if self.phase == "requeue" and self._mine(trainer) and trainer.global_step == self.step and not self._armed:
            self._armed = True
            os.kill(os.getpid(), self.requeue_signal)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        if self._armed or (self.phase == "checkpoint" and self._mine(trainer) and trainer.global_step == self.step):
            self._die()


def _resolve(signal: str | int) -> _signal.Signals:
    names = sorted(s.name for s in _signal.Signals)
    try:
        return (
            _signal.Signals(signal)
            if isinstance(signal, int)
            else _signal.Signals[signal if str(signal).startswith("SIG") else f"SIG{signal}"]
        )
    except (KeyError, ValueError):
        raise ValueError(f"signal must name a signal, got {signal!r}; allowed: {names}") from None


class UnpicklePayload:
    """Unpickling this runs ``touch <marker>`` through ``os.system``: a hostile checkpoint entry whose effect
    (the marker file) shows whether a loader ran arbitrary code."""

    def __init__(self, marker: str | os.PathLike[str]) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch '{self.marker}'",))
