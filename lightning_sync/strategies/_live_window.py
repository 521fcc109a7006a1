"""What a live window trained, so that it can be trained again after a loss.

A *window* is what the members commit at once: for gradient averaging (``bucketed_ddp``) one optimizer step's
accumulation window; for the periodic strategies (``local_sgd``, ``diloco``) a whole period, its inner steps and
the sync that ends it. An aborted window is replayed in the next membership epoch on the same samples, each
micro-batch shared out over the new members. :class:`WindowRecord` keeps what that needs:

* every micro-batch trained so far, by its index in its epoch and the global-order entries it held. The entries,
  not the index alone, because a period may begin in the epoch before (Lightning steps at an epoch's end, so one
  optimizer step never spans two epochs, but a period of several steps may);
* for each of the window's earlier optimizer steps, the optimizer's hyperparameters it stepped with (the learning
  rate a per-step schedule set then), since the schedulers have moved on and are not rewound.

:class:`WindowReplay` trains a recorded window again: from the state at its start (the strategy's
``_live_reset``), each earlier step's micro-batches through closures Lightning builds for them and its optimizer
step with the settings it had, then the step in progress, its last micro-batch through Lightning's own closure.

A replayed window also logs again. :class:`MetricMarks` keeps the torchmetrics states of the module at a window's
start, so that each micro-batch counts once in them too (Lightning's own epoch accumulation of logged tensors is
put back by :func:`lightning_sync._lightning.restore_logged_state`).

Imports Lightning only through :mod:`lightning_sync._lightning`.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torchmetrics import Metric

from lightning_sync._lightning import batch_index, closure_for, restore_logged_state, trainer_of

__all__ = ["MetricMarks", "MicroBatch", "WindowRecord", "WindowReplay", "hyperparameters", "set_hyperparameters"]

#: a micro-batch: its index in its epoch, and the global-order entries (dataset indices) of the whole micro-batch
MicroBatch = tuple[int, list[int]]


def hyperparameters(optimizer: Any) -> list[dict[str, Any]]:
    """Each parameter group's settings (all but its parameters), copied: what the next step applies."""
    return [copy.deepcopy({k: v for k, v in group.items() if k != "params"}) for group in optimizer.param_groups]


def set_hyperparameters(optimizer: Any, settings: list[dict[str, Any]]) -> None:
    """Put :func:`hyperparameters` back (copied again: a tensor learning rate is the group's own object)."""
    for group, saved in zip(optimizer.param_groups, settings):
        group.update(copy.deepcopy(saved))


@dataclass
class WindowRecord:
    """The micro-batches and steps of the window in progress (module docstring)."""

    #: the window's earlier optimizer steps: their micro-batches and the settings each stepped with
    steps: list[tuple[list[MicroBatch], list[dict[str, Any]]]] = field(default_factory=list)
    #: the micro-batches of the optimizer step in progress
    micro: list[MicroBatch] = field(default_factory=list)
    #: the settings of the step in progress, at its optimizer step
    now: list[dict[str, Any]] = field(default_factory=list)
    #: whether a window is in progress (it opens at its first micro-batch and closes when committed)
    open: bool = False
    #: what was logged at its start (the epoch, Lightning's accumulation, :class:`MetricMarks`), put back by a replay
    logged: Any = None
    #: the window committed last, its steps and what was logged at its start, while a replay may still need it
    previous: tuple[list[tuple[list[MicroBatch], list[dict[str, Any]]]], Any] | None = None

    def start(self, logged: Any = None) -> None:
        """A window's first micro-batch."""
        self.steps, self.micro, self.now, self.open, self.logged = [], [], [], True, logged

    def add(self, j: int, entries: list[int]) -> None:
        """Micro-batch ``j`` of its epoch, trained for the first time (a replay adds nothing, nor does a closure that
        runs again: a step that failed part way runs Lightning's closure once more, skipped)."""
        if not self.micro or self.micro[-1][0] != j:
            self.micro.append((j, list(entries)))

    def end_step(self, settings: list[dict[str, Any]]) -> None:
        """An optimizer step inside the window, with the settings it applied: its micro-batches become an earlier
        step."""
        self.steps.append((self.micro, settings))
        self.micro = []

    def close(self) -> None:
        """The window was committed: it is replayed again only after :meth:`reopen_previous`."""
        last = [(self.micro, self.now)] if self.micro else []
        self.previous = ([*self.steps, *last], self.logged)
        self.steps, self.micro, self.now, self.open, self.logged = [], [], [], False, None

    def reopen_previous(self) -> None:
        """The window before goes back in front of this one (the strategy's state goes back to its start): a replay
        trains both. For a strategy whose state at this window's start is not safe yet when a loss comes (ZeRO's
        snapshot, still on its way to the buddies)."""
        if self.previous is None:
            raise RuntimeError("WindowRecord: no committed window to reopen")
        steps, logged = self.previous
        self.steps, self.logged, self.previous = [*steps, *self.steps], logged, None

    def forget_previous(self) -> None:
        """The state at this window's start is safe: the window before is never replayed again."""
        self.previous = None

    def earlier_micro(self, last: int) -> list[MicroBatch]:
        """The step in progress's micro-batches before its last, ``last`` (whether the failed attempt trained that
        one or not). They are all in the current epoch."""
        return [m for m in self.micro if m[0] != last]


class MetricMarks:
    """The states of every torchmetrics ``Metric`` in a module at a window's start, put back before its replay.

    A tensor state is cloned (updates add in place); a list state (``cat`` metrics, growing all epoch) is only
    measured, since updates append to it, and cut back to that length: a mark costs the few scalars a metric
    holds, not the epoch's values again.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._marks: list[tuple[Metric, dict[str, Any], int]] = []
        for metric in module.modules():
            if isinstance(metric, Metric):
                states = {
                    name: len(value) if isinstance(value, list) else value.detach().clone()
                    for name in metric._defaults
                    for value in [getattr(metric, name)]
                }
                self._marks.append((metric, states, metric._update_count))

    def restore(self) -> None:
        for metric, states, count in self._marks:
            for name, value in states.items():
                if isinstance(value, int):
                    del getattr(metric, name)[value:]
                else:
                    setattr(metric, name, value.clone())
            metric._update_count = count
            metric._computed = None


class WindowReplay:
    """Trains the window ``window`` records again, for this member's new shares (module docstring).

    Args:
        owner: the strategy (``_live_reset``, ``_live_inner_step``, ``block_backward_sync``).
        window: the record of the window in progress.
        entries: the global-order entries of micro-batch ``j`` of the current epoch.
    """

    def __init__(self, owner: Any, window: WindowRecord, entries: Callable[[int], list[int]]) -> None:
        self._owner, self._window, self._entries = owner, window, entries
        #: the micro-batch being replayed, whose share ``training_step`` rebuilds; None outside a replay
        self.current: MicroBatch | None = None
        self.redone = 0.0  # seconds the last replay spent before its last micro-batch

    def run(self, optimizer: Any, closure: Callable[[], Any], step: Callable[[Callable[[], Any]], Any] | None) -> Any:
        """The whole window, ending with the step in progress: ``closure()`` (Lightning's, for its last
        micro-batch, trained or not: a failure skips it), or ``step(closure)`` where the step is in the vote."""
        trainer = self._restart(optimizer)
        last = batch_index(trainer)
        started = time.perf_counter()
        try:
            set_hyperparameters(optimizer, self._window.now)
            self._accumulate(trainer, optimizer, self._window.earlier_micro(last))
            self.redone += time.perf_counter() - started
            self.current = (last, self._entries(last))
            return closure() if step is None else step(closure)
        finally:
            self.current = None

    def run_steps(self, optimizer: Any) -> None:
        """The window's finished steps only (a fit that ended inside a period), the settings put back after."""
        settings = hyperparameters(optimizer)
        self._restart(optimizer)
        set_hyperparameters(optimizer, settings)

    def _restart(self, optimizer: Any) -> Any:
        """Back to the window's start (the strategy's state and what it logged), then its earlier steps again."""
        owner = self._owner
        owner._live_reset()
        trainer = trainer_of(owner.lightning_module)
        epoch, logged, marks = self._window.logged
        if epoch == trainer.current_epoch:  # what the window logged counts once (an ended epoch's is logged already)
            restore_logged_state(trainer, logged)
            marks.restore()
        started = time.perf_counter()
        try:
            for micro, settings in self._window.steps:
                set_hyperparameters(optimizer, settings)
                *accumulated, (j, entries) = micro
                self._accumulate(trainer, optimizer, accumulated)
                self.current = (j, entries)
                owner._live_inner_step(optimizer, closure_for(trainer, optimizer, j, None))
        finally:
            self.current = None
        self.redone = time.perf_counter() - started
        return trainer

    def _accumulate(self, trainer: Any, optimizer: Any, micro: list[MicroBatch]) -> None:
        """Micro-batches that accumulate gradients without a step (each rebuilt in ``training_step``)."""
        for j, entries in micro:
            self.current = (j, entries)
            with self._owner.block_backward_sync():
                closure_for(trainer, optimizer, j, None)()
