"""``StragglerDetector``: every N optimizer steps, name the ranks whose own work is slower than x times the median.

In synchronous training every rank's *wall* step time is the same: the fast ones wait for the slow one in
the next collective. So each rank measures its *own* time: from the start of a training batch to its end,
minus the time it spent blocked in ``lightning_sync.comms`` collectives meanwhile
(:meth:`~lightning_sync.comms.stats.CommStats.blocked_seconds`), summed over the micro-batches of a step.
Lightning's per-step broadcast falls before the batch starts. (Strategies whose collectives bypass
``comms``, such as Lightning's own ``ddp``, hide their waits from it: there a fast rank's wait counts as
its own time, and only a straggler well above the others stands out.) Every ``every_n_steps``
optimizer steps the ranks all-gather their mean per step; a rank above ``threshold`` x the median is
flagged: one warning naming it, with its time, the median and the steps, and the metrics
``straggler/max_ratio`` and ``straggler/slowest_rank`` (logged on every window, flagged or not).
Under a strategy that rebalances (``rebalance=True``) every rank's step takes about as long, which is the point: the
ranks are compared by their time per sample instead, and the warning says what share of each batch the slow rank
computes and the compute seconds the split saved so far (logged as ``rebalance/*`` by the strategy).
:attr:`StragglerDetector.flags` keeps ``(global_step, rank, ratio)`` of every flag.

With 2 ranks the median is the mean of both, so a rank k times slower shows a ratio of 2k / (k + 1)
(below 2 whatever k): use ``threshold`` below that, or 3 or more ranks.

From Hydra::

    lightning-sync train \
        '+trainer.callbacks=[{_target_: lightning_sync.diagnostics.StragglerDetector, every_n_steps: 20}]'
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_sync._checks import check_int
from lightning_sync.diagnostics._comm import blocked_seconds
from lightning_sync.diagnostics._steps import optimizer_step_ended

__all__ = ["StragglerDetector"]

log = logging.getLogger("lightning_sync.diagnostics")


class StragglerDetector(pl.Callback):
    """Flag ranks whose own step time exceeds ``threshold`` x the median, every ``every_n_steps`` steps.

    Args:
        every_n_steps: optimizer steps per measurement window (an int >= 1).
        threshold: how many times the median a rank's time must exceed to be flagged (a number > 1).
    """

    def __init__(self, every_n_steps: int = 50, threshold: float = 1.5) -> None:
        check_int("every_n_steps", every_n_steps, 1)
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 1 < threshold < math.inf:
            raise ValueError(f"threshold must be a finite number > 1, got {threshold!r}")
        self.every_n_steps, self.threshold = every_n_steps, float(threshold)
        self.flags: list[tuple[int, int, float]] = []
        self.windows: list[list[float]] = []  # every window's per-rank mean seconds per step, in rank order
        self._start: tuple[float, float] | None = None
        self._busy = 0.0
        self._steps = 0
        self._samples: int | None = None  # under rebalancing: the samples this rank had computed at the window's start

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._start = (time.perf_counter(), blocked_seconds(trainer))
        rebalance = getattr(trainer.strategy, "rebalance", None)
        if rebalance is not None and self._samples is None:
            self._samples = rebalance.samples

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._start is not None:
            started, blocked = self._start
            self._busy += (time.perf_counter() - started) - (blocked_seconds(trainer) - blocked)
            self._start = None
        if not optimizer_step_ended(trainer):
            return  # mid-window of an accumulated step: the same decision on every rank
        self._steps += 1
        if self._steps < self.every_n_steps:
            return
        rebalance = getattr(trainer.strategy, "rebalance", None)
        samples = rebalance.samples - self._samples if rebalance is not None and self._samples is not None else 0
        mine = torch.tensor([self._busy / self._steps, float(samples)], dtype=torch.float64)
        self._busy, self._steps, self._samples = 0.0, 0, None
        gathered = trainer.strategy.all_gather(mine).reshape(-1, 2)
        times = [float(t) for t in gathered[:, 0]]
        self.windows.append(times)
        # under rebalancing every rank's step takes about as long (that is its point): compare time per sample
        counts = [float(n) for n in gathered[:, 1]]
        per = [t / n for t, n in zip(times, counts)] if min(counts) > 0 else times
        median = statistics.median(per)
        ratios = [t / median if median > 0 else 1.0 for t in per]
        slowest = max(range(len(ratios)), key=ratios.__getitem__)
        pl_module.log_dict(
            {"straggler/max_ratio": ratios[slowest], "straggler/slowest_rank": float(slowest)}, rank_zero_only=True
        )
        for rank, ratio in enumerate(ratios):
            if ratio > self.threshold:
                self.flags.append((trainer.global_step, rank, ratio))
                if trainer.is_global_zero:
                    log.warning(
                        "straggler: rank %d took %.2fx the median %s (%.1f ms against %.1f ms) over steps %d-%d%s",
                        rank,
                        ratio,
                        "time per sample" if per is not times else "step time",
                        1e3 * per[rank],
                        1e3 * median,
                        trainer.global_step - self.every_n_steps + 1,
                        trainer.global_step,
                        _rebalanced(rebalance, rank),
                    )


def _rebalanced(rebalance: Any, rank: int) -> str:
    """What rebalancing does about it, for the warning: the rank's share of each batch and the seconds saved."""
    rebalancer = getattr(rebalance, "rebalancer", None)
    if rebalancer is None:
        return ""
    share = rebalancer.shares()[rank]
    return (
        f"; rebalanced: it computes {100 * share:.0f}% of each batch (even: {100 / rebalancer.world:.0f}%), "
        f"{rebalancer.seconds_saved:.2f} s of compute saved so far"
    )
