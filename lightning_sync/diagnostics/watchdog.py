"""``HangWatchdog``: the Lightning face of :mod:`lightning_sync.comms.watchdog`.

It starts the comms watchdog once the process group exists (``setup``) and stops it in ``teardown``.
Every collective our strategies issue (gradient buckets, shards, ``self.log(..., sync_dist=True)``,
``reduce_boolean_decision``, barriers, broadcasts) then goes through it, so:

* a rank that skips a collective, or takes another code path (logs a key with ``sync_dist`` that the
  others do not), makes every rank raise a :class:`~lightning_sync.comms.watchdog.CollectiveTimeout`
  within ``collective_timeout + 3 * interval`` seconds, naming the op, its sequence number and the ranks;
* a rank that dies makes the others raise :class:`~lightning_sync.comms.watchdog.RankLost` naming it (gloo
  reports "Connection closed by peer" within about 2 s; the heartbeats say which peer);
* ranks whose collectives paired up across different calls (rank 0 syncs the logged key ``a`` while rank 1
  syncs ``b``: nothing hangs, both get wrong values) all raise a
  :class:`~lightning_sync.comms.watchdog.CollectiveMismatch` naming the first call that differed, at the next
  check: every ``verify_every`` optimizer steps and at the end of training, validation and testing.

An error raised outside ``comms`` (say, a collective of Lightning's own ``ddp`` strategy, which does not
use our layer) gets a note naming the lost ranks, when there are any. Strategies built on another
collectives layer are not covered beyond that note.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_sync._checks import check_int
from lightning_sync.comms import CommContext, watchdog

__all__ = ["HangWatchdog"]

log = logging.getLogger("lightning_sync.diagnostics")


class HangWatchdog(pl.Callback):
    """Turn hung and failed collectives into errors on every rank that name the culprit ranks.

    Args:
        collective_timeout: seconds a collective may take before it is declared hung (> 0). Set it
            above the longest legitimate wait: a slow rank's step, or a checkpoint written by one rank
            while the others wait in a barrier.
        interval: heartbeat and polling period in seconds (default ``min(1, collective_timeout / 5)``).
        exit_after: seconds after an abort before a rank blocked outside ``comms`` ends its process with
            exit code 1 (default ``collective_timeout``).
        verify_every: optimizer steps between checks that every rank issued the same collectives (an int >= 0;
            0: only at the end of training, validation and testing). Each check is one small
            ``all_gather_object``.
    """

    def __init__(
        self,
        collective_timeout: float = 300.0,
        interval: float | None = None,
        exit_after: float | None = None,
        verify_every: int = 100,
    ) -> None:
        watchdog.check_args(collective_timeout, interval, exit_after)
        self.collective_timeout, self.interval, self.exit_after = collective_timeout, interval, exit_after
        self.verify_every = check_int("verify_every", verify_every, 0)
        self._verified_step = -1
        self._comm: Any = None
        self._verifies = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if getattr(trainer.strategy, "live", None) is not None:
            # the fault-tolerance agent watches every rank's heartbeat and kills a hung one; its peers then go on
            # without it, where this watchdog would end them all
            rank_zero_info("HangWatchdog: off under the fault-tolerance agent, which watches the ranks itself")
            return
        self._comm = getattr(trainer.strategy, "comm", None)
        # Another strategy (Lightning's own ddp) issues its collectives outside our layer: a context of the
        # watchdog's own still runs the heartbeats, so a lost rank is named, and nothing is there to verify.
        self._verifies = self._comm is not None
        if self._comm is None:
            self._comm = CommContext()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._comm.start_watchdog(self.collective_timeout, self.interval, self.exit_after)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = trainer.global_step  # with gradient accumulation, several batches end one step
        if self.verify_every and step % self.verify_every == 0 and step != self._verified_step:
            self._verified_step = step
            self._verify()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._verify()  # after the last epoch's logged values were synced

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._verify()

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._verify()

    def _verify(self) -> None:
        if self._verifies:
            self._comm.verify()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._comm is not None:
            self._comm.stop_watchdog(clean=True)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        wd = self._comm.watchdog if self._comm is not None else None
        if wd is None:
            return
        if not isinstance(exception, watchdog.CollectiveError):
            try:
                lost = wd.lost_ranks()
            except Exception as err:  # noqa: BLE001 - the store host itself is gone: say that instead
                note = f"lightning_sync watchdog: {wd.store_lost(err)}"
            else:
                note = f"lightning_sync watchdog: ranks {lost} lost (no heartbeat)" if lost else ""
            if note:
                exception.add_note(note)
                log.error("rank %d: %s", wd.rank, note)
        self._comm.stop_watchdog(clean=False)
