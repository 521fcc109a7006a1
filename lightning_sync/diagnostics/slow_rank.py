"""``SlowRank``: make one rank a straggler, by a known factor, to see what a strategy does with it.

Rank ``rank`` measures its own compute time of every training batch (forward and loss, less the time
it was blocked in the strategy's collectives, where the strategy measures it; its backward estimated
from the last batch's ratio of backward to forward) and sleeps ``(factor - 1)`` times that before its
backward starts, so its work takes about ``factor`` times as long and its gradients go out that much
later: a device at ``1/factor`` the speed, whose time grows with the samples it is given. It is slow
from optimizer step ``after_step`` on (0: from the start), so that a rank can also slow down in the
middle of a run, as a throttled GPU does. Other ranks are untouched; synchronous strategies then wait
for the slow one, asynchronous ones need not.

From Hydra (any training job)::

    lightning-sync train '+trainer.callbacks=[{_target_: lightning_sync.diagnostics.SlowRank, rank: 1, factor: 2}]'
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl

from lightning_sync._checks import check_int
from lightning_sync.diagnostics._comm import blocked_seconds

__all__ = ["SlowRank"]


class SlowRank(pl.Callback):
    """Delay rank ``rank``'s training batches by ``(factor - 1)`` x their compute time, before their backward.

    Args:
        rank: the global rank to slow down (>= 0).
        factor: how many times slower its steps become (a finite number >= 1; 1 does nothing).
        after_step: the optimizer step from which it is slow (an int >= 0).

    Attributes:
        measured: this rank's compute seconds per batch, forward measured and backward estimated (only on the
            slowed rank).
        delays: the seconds slept in each batch, ``(factor - 1)`` x measured (only on the slowed rank).
    """

    def __init__(self, rank: int, factor: float, after_step: int = 0) -> None:
        check_int("rank", rank, 0)
        self.after_step = check_int("after_step", after_step, 0)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 <= factor < math.inf:
            raise ValueError(f"factor must be a finite number >= 1, got {factor!r}")
        self.rank, self.factor = rank, float(factor)
        self.measured: list[float] = []
        self.delays: list[float] = []
        self._start: tuple[float, float] | None = None  # (clock, blocked seconds) at the micro-batch's start
        self._backward: tuple[float, float] | None = None  # the same at its backward's start
        self._forward = 0.0  # the micro-batch's own forward seconds
        self._backward_ratio = 2.0  # backward over forward seconds, as last measured (2 before any: a typical net)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.rank >= trainer.world_size:
            raise ValueError(
                f"SlowRank(rank={self.rank}) but the job has {trainer.world_size} ranks "
                f"(allowed: 0..{trainer.world_size - 1})"
            )

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._start = (time.perf_counter(), blocked_seconds(trainer))

    def _own_seconds(self, trainer: pl.Trainer, since: tuple[float, float]) -> float:
        started, blocked = since
        return (time.perf_counter() - started) - (blocked_seconds(trainer) - blocked)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        if trainer.global_rank != self.rank or self._start is None:
            return
        forward = self._own_seconds(trainer, self._start)
        if trainer.global_step >= self.after_step:
            # the whole micro-batch's extra time, slept before any gradient is sent: a slower device is slow before
            # its peers can use its gradients, not after (backward's share estimated from the last micro-batch)
            compute = forward * (1.0 + self._backward_ratio)
            delay = (self.factor - 1.0) * compute
            self.measured.append(compute)
            self.delays.append(delay)
            if delay > 0:
                time.sleep(delay)
        self._forward, self._backward = forward, (time.perf_counter(), blocked_seconds(trainer))

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank != self.rank or self._backward is None:
            return
        backward = self._own_seconds(trainer, self._backward)
        if self._forward > 0:
            self._backward_ratio = backward / self._forward
        self._backward = None
        self._start = (time.perf_counter(), blocked_seconds(trainer))  # the window's next micro-batch starts now
