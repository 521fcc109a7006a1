"""``SlowRank``: make one rank a straggler, by a known factor, to see what a strategy does with it.

Rank ``rank`` measures its own compute time of every training batch (from the batch start to the end
of backward: forward, loss and backward, plus whatever a strategy synchronizes inside backward) and
then sleeps ``(factor - 1)`` times that, so its steps take about ``factor`` times as long. Other ranks
are untouched; synchronous strategies then wait for the slow one, asynchronous ones need not.

From Hydra (any training job)::

    lightning-sync train '+trainer.callbacks=[{_target_: lightning_sync.diagnostics.SlowRank, rank: 1, factor: 2}]'
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl

from lightning_sync._checks import check_int

__all__ = ["SlowRank"]


class SlowRank(pl.Callback):
    """Delay rank ``rank``'s training steps by ``(factor - 1)`` x its measured compute time.

    Args:
        rank: the global rank to slow down (>= 0).
        factor: how many times slower its steps become (a finite number >= 1; 1 does nothing).

    Attributes:
        measured: this rank's compute seconds per batch (only on the slowed rank).
        delays: the seconds slept after each batch (only on the slowed rank).
    """

    def __init__(self, rank: int, factor: float) -> None:
        check_int("rank", rank, 0)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 <= factor < math.inf:
            raise ValueError(f"factor must be a finite number >= 1, got {factor!r}")
        self.rank, self.factor = rank, float(factor)
        self.measured: list[float] = []
        self.delays: list[float] = []
        self._start: float | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.rank >= trainer.world_size:
            raise ValueError(
                f"SlowRank(rank={self.rank}) but the job has {trainer.world_size} ranks "
                f"(allowed: 0..{trainer.world_size - 1})"
            )

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank != self.rank or self._start is None:
            return
        elapsed = time.perf_counter() - self._start
        delay = (self.factor - 1.0) * elapsed
        self.measured.append(elapsed)
        self.delays.append(delay)
        if delay > 0:
            time.sleep(delay)
        self._start = time.perf_counter()  # the next micro-batch of an accumulation window starts now
