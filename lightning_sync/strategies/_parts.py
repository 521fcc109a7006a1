"""``StrategyParts``: what every lightning_sync strategy holds and does alike, on a process group or without one.

Both Lightning bases of the strategies (``DDPStrategy`` under :class:`~lightning_sync.strategies._base.SyncStrategy`,
``ParallelStrategy`` under :class:`~lightning_sync.strategies._no_process_group.NoProcessGroupStrategy`) get it
first in their method resolution order, so these lines exist once:

* the objects: ``comm``, the strategy's own :class:`~lightning_sync.comms.CommContext`, and ``telemetry``, its
  :class:`~lightning_sync.strategies._telemetry.CommTelemetry`, which reads that context;
* pickling: a context lives in one process, so a pickled strategy takes none along and gets a fresh one;
* an atomic ``checkpoint_io`` unless the user sets one (:mod:`lightning_sync.strategies._checkpoint_io`);
* the Lightning hooks that call them: a fit begins from clean communication state, and the telemetry measures
  each optimizer step together with what the subclass synchronizes right after it.

A subclass says what it adds to a step through three methods, read by the objects above:
:meth:`StrategyParts._after_optimizer_step`, :meth:`StrategyParts._comm_counters` and
:meth:`StrategyParts._comm_gauges`.
"""

from __future__ import annotations

from typing import Any

from lightning_sync import comms
from lightning_sync._lightning import set_checkpoint_io, trainer_of
from lightning_sync.strategies._checkpoint_io import atomic_unless_set
from lightning_sync.strategies._common import new_comm
from lightning_sync.strategies._live_env import refuse_under_agent
from lightning_sync.strategies._telemetry import CommTelemetry

__all__ = ["StrategyParts"]


class StrategyParts:
    """The parts every lightning_sync strategy shares (module docstring). It names a Lightning strategy as its
    next base, so each method below overrides Lightning's and calls it through ``super()``."""

    #: True where the strategy keeps training through a lost rank under the fault-tolerance agent
    _live_capable = False

    def __init__(self, **kwargs: Any) -> None:
        if not self._live_capable:
            refuse_under_agent(type(self).__name__)
        #: this strategy's collectives, sequence numbers, hang watchdog and node groups, and a
        #: :class:`~lightning_sync.comms.CommStats` observer that measures them (``comm.observer = None``
        #: measures nothing); nothing of it is shared with another strategy
        self.comm: comms.CommContext = new_comm()
        self.telemetry = CommTelemetry(self, self._comm_counters, self._gauges)
        super().__init__(**kwargs)

    def __getstate__(self) -> dict[str, Any]:
        """A context lives in one process (it holds locks): a pickled strategy (the spawn launcher's) takes
        none along, and the new process gets a fresh one."""
        state = super().__getstate__()
        state.pop("comm", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.comm = new_comm()

    @property
    def is_distributed(self) -> bool:
        """Always True: Lightning then shards the training data with a DistributedSampler and turns
        ``sync_dist`` on (without the deprecation warning ``DDPStrategy``'s own property emits)."""
        return True

    @property
    def checkpoint_io(self) -> Any:
        atomic_unless_set(self)
        return super().checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        set_checkpoint_io(self, io)

    # ------------------------------------------------------------------ what a subclass adds to a step
    def _after_optimizer_step(self) -> None:
        """Synchronize what follows an optimizer step (nothing here)."""

    def _gauges(self) -> dict[str, float]:
        """The subclass's gauges and, where it trains live or rebalances, the fault-tolerance or the split's figures."""
        gauges = self._comm_gauges()
        for part in (getattr(self, "live", None), getattr(self, "rebalance", None)):
            if part is not None:
                gauges.update(part.gauges())
        return gauges

    def _comm_counters(self) -> dict[str, float]:
        """Cumulative counts whose per-step increase is logged (none here)."""
        return {}

    def _comm_gauges(self) -> dict[str, float]:
        """Values logged as they are after each step (none here)."""
        return {}

    # ------------------------------------------------------------------ Lightning's hooks
    def setup_environment(self) -> None:
        """Every fit starts from clean communication state (a second fit of this strategy too, or a multirun's
        next job in the same process)."""
        trainer = trainer_of(self.lightning_module)
        if trainer is not None and trainer.state.fn == "fit":
            self.comm.begin_job()
        super().setup_environment()

    def on_train_start(self) -> None:
        super().on_train_start()
        self.telemetry.start()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.telemetry.batch_start()

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._after_optimizer_step()
        self.telemetry.step_end()
        return out
