"""Communication telemetry: what each optimizer step cost in communication, logged through Lightning's loggers.

Every lightning_sync strategy logs, after each optimizer step, through ``LightningModule.log`` (so the values
reach TensorBoard, the CSV logger and any other logger at ``log_every_n_steps``):

=========================  =========================================================================================
``comm/bytes_per_step``    payload bytes this rank's collectives carried during the step, as
                           :mod:`lightning_sync.comms.stats` counts them (its buffers as handed to the backend,
                           padding included; RPC requests and replies for ``async_ps``)
``comm/MB_per_step``       the same in MB (10^6 bytes); the one telemetry figure on the progress bar
``comm/seconds_per_step``  wall seconds with communication in progress: blocked in a launch or a wait
                           (:meth:`~lightning_sync.comms.CommStats.blocked_seconds`), or running under compute
                           (:meth:`~lightning_sync.comms.CommStats.covered_seconds`)
``comm/exposed_pct``       the blocked seconds as a percentage of the step's wall time: communication not
                           overlapped with compute (0 to 100)
``comm/buckets``           strategies that bucket: ``bucketed_ddp``'s buckets, ZeRO's units (stage 1/2 buckets,
                           stage 3 wrap units), ``local_sgd``'s warm-up buckets
``comm/nonfinite_skipped`` optimizer steps skipped so far for a NaN or Inf gradient, when a
                           :class:`~lightning_sync.diagnostics.NonFiniteGuard` is among the callbacks (a
                           callback's own figures: see :class:`GaugeSource`)
``comm/staleness``         ``async_ps``: versions the server applied between this worker's pull and its push
                           being applied (the server's own definition; NaN for a push discarded because the
                           budget was spent); ``hogwild``: updates the other processes made to the shared model
                           between this process's first forward of the step and the end of its own update
``ps/global_step``,        ``async_ps`` only: the server's global clock, version, and the mean and largest
``ps/version``,            staleness of every gradient it applied so far
``ps/staleness_mean|max``
=========================  =========================================================================================

A *step* is an optimizer step: it begins when the first micro-batch of an accumulation window starts
(Lightning's ``on_train_batch_start``) and ends after the strategy's ``optimizer_step`` and whatever the
strategy synchronizes right after it (``local_sgd``'s average, DiLoCo's outer step). So its bytes are those of
every micro-batch of the window (ZeRO-3 gathers parameters for each), and what runs between steps (validation,
checkpoints) is in none of them.

The values are **rank 0's**: Lightning's loggers write on rank 0 only, so only rank 0 measures. Nothing of this
runs without a logger: the :class:`StepTelemetry` is built at ``on_train_start`` only on rank 0 of a Trainer
with at least one logger; otherwise the strategy's hooks find ``None`` and return, so ``logger=False`` adds one
attribute test per batch and per optimizer step. With a logger, each step costs two readings of the counters;
``LightningModule.log`` is called only on the steps Lightning writes (every ``log_every_n_steps``), and for
the progress bar's figure on every step while a progress bar is shown.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from lightning_sync._lightning import trainer_of
from lightning_sync.comms import CallHook, CommStats

__all__ = [
    "BUCKETS",
    "NONFINITE",
    "STALENESS",
    "CommTelemetry",
    "GaugeSource",
    "StepTelemetry",
    "TelemetryOwner",
    "blocked",
]

BYTES, MB, SECONDS, EXPOSED = "comm/bytes_per_step", "comm/MB_per_step", "comm/seconds_per_step", "comm/exposed_pct"
BUCKETS, NONFINITE, STALENESS = "comm/buckets", "comm/nonfinite_skipped", "comm/staleness"
PROGRESS_BAR = (MB,)  # the only telemetry figure shown on the progress bar

Values = Callable[[], dict[str, float]]


@runtime_checkable
class GaugeSource(Protocol):
    """A Trainer callback with figures of its own to log with each step's telemetry (the
    :class:`~lightning_sync.diagnostics.NonFiniteGuard`'s count of skipped steps). The strategies find such
    callbacks by this method alone, so they need not import the callbacks (which are built on the strategies)."""

    def comm_gauges(self) -> dict[str, float]:
        """Values logged as they are after each step; the same names at every step."""
        ...


@dataclass(frozen=True)
class _Mark:
    """Cumulative readings at one moment; a step's figures are the difference of two."""

    time: float
    bytes: int
    blocked: float
    covered: float
    counters: dict[str, float]


class StepTelemetry:
    """One fit's per-step communication figures, from the deltas of cumulative readings (module docstring).

    Args:
        stats: the strategy context's observer (None: no byte or time figures).
        counters: cumulative counts the strategy keeps (e.g. Hogwild's updates by the other processes);
            each is logged as its increase over the step.
        gauges: values logged as they are after each step (bucket count, the PS's staleness).
        clock: seconds, for the step's wall time (the same clock :class:`~lightning_sync.comms.CommStats` uses).
    """

    def __init__(
        self,
        stats: CommStats | None,
        counters: Values | None = None,
        gauges: Values | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._stats, self._counters, self._gauges, self._clock = stats, counters, gauges, clock
        self._last = self._read()  # the end of the previous step (or the start of training)
        self._start: _Mark | None = None  # the start of the current step, once its first micro-batch began

    def _read(self) -> _Mark:
        s, counters = self._stats, self._counters() if self._counters is not None else {}
        if s is None:
            return _Mark(self._clock(), 0, 0.0, 0.0, counters)
        return _Mark(self._clock(), s.total_bytes, s.blocked_seconds(), s.covered_seconds(), counters)

    def begin(self) -> None:
        """A micro-batch starts: the first one since the last step ended starts the next step."""
        if self._start is None:
            self._start = self._read()

    def end(self) -> dict[str, float]:
        """An optimizer step (and what the strategy synchronizes with it) is done: its figures. A step no
        micro-batch began (a second manual ``optimizer.step()`` in one batch) starts where the last one ended."""
        now = self._read()
        start = self._start if self._start is not None else self._last
        self._start, self._last = None, now
        out: dict[str, float] = {}
        if self._stats is not None:
            nbytes = now.bytes - start.bytes
            blocked = now.blocked - start.blocked
            wall = now.time - start.time
            out[BYTES], out[MB] = float(nbytes), nbytes / 1e6
            out[SECONDS] = blocked + now.covered - start.covered
            # blocked time is summed over threads, so two blocked at once could exceed the wall time
            out[EXPOSED] = min(100.0, 100.0 * blocked / wall) if wall > 0 else 0.0
        for name, value in now.counters.items():
            out[name] = value - start.counters.get(name, 0.0)
        if self._gauges is not None:
            out.update(self._gauges())
        return out


@contextmanager
def blocked(observer: CallHook | None) -> Iterator[None]:
    """Account the block as time the caller is blocked in communication (a request that is not a collective:
    the parameter server's push), so it counts in ``blocked_seconds`` and the exposed percentage; only a
    :class:`~lightning_sync.comms.CommStats` observer keeps that figure."""
    if not isinstance(observer, CommStats):
        yield
        return
    observer.block_begin()
    started = time.perf_counter()
    try:
        yield
    finally:
        observer.block_end(time.perf_counter() - started)


class TelemetryOwner(Protocol):
    """What :class:`CommTelemetry` reads of the strategy that owns it."""

    lightning_module: Any
    is_global_zero: bool
    comm: Any


class CommTelemetry:
    """The per-step communication telemetry a strategy owns (``strategy.telemetry``), called from its
    Lightning hooks: :meth:`start` after ``on_train_start``, :meth:`batch_start` after
    ``on_train_batch_start``, :meth:`step_end` once the optimizer step and what the strategy synchronizes
    with it are done.

    Args:
        owner: the strategy (its module, whether it is rank 0, and its communication context).
        counters: the strategy's cumulative counts whose per-step increase is logged.
        gauges: the strategy's values logged as they are after each step.

    Each of ``counters`` and ``gauges`` must return the same names at every step: a name missing from one
    step's figures would show the previous step's value there (Lightning keeps a logged value until the epoch
    ends).
    """

    def __init__(self, owner: TelemetryOwner, counters: Values | None = None, gauges: Values | None = None) -> None:
        self._owner = owner
        self._counters: Values = counters if counters is not None else dict
        self._gauges: Values = gauges if gauges is not None else dict
        self.step: StepTelemetry | None = None  # this fit's, on rank 0 with a logger; None: measure nothing

    def stats(self) -> CommStats | None:
        """The context's statistics, where its observer keeps them (the one place the observer is read)."""
        observer = self._owner.comm.observer
        return observer if isinstance(observer, CommStats) else None

    def start(self) -> None:
        """Training starts: measure from here, if anything will be written."""
        trainer = trainer_of(self._owner.lightning_module)
        if trainer is None or not trainer.loggers or not self._owner.is_global_zero:
            self.step = None  # nothing would be written: measure nothing
            return
        sources = [cb for cb in trainer.callbacks if isinstance(cb, GaugeSource)]

        def gauges() -> dict[str, float]:
            out = self._gauges()
            for source in sources:
                out.update(source.comm_gauges())
            return out

        self.step = StepTelemetry(self.stats(), self._counters, gauges)

    def batch_start(self) -> None:
        """A micro-batch starts."""
        if self.step is not None:
            self.step.begin()

    def step_end(self) -> None:
        """An optimizer step and what the strategy synchronizes with it are done: log its figures."""
        if self.step is not None:
            self._log(self.step.end())

    def _log(self, figures: dict[str, float]) -> None:
        """Log the step's figures on the steps Lightning writes to the loggers (``LightningModule.log`` costs
        about as much as a small collective), and the progress bar's figure on every step while a bar is shown."""
        module = self._owner.lightning_module
        trainer = module.trainer
        every = trainer.log_every_n_steps  # Lightning writes when its count of stepping batches, this one
        # included, is a multiple of it; global_step counts the steps before this one, as that count does
        written = every > 0 and ((trainer.global_step + 1) % every == 0 or trainer.should_stop)
        bar = trainer.progress_bar_callback is not None
        for name, value in figures.items():
            if not (written or (bar and name in PROGRESS_BAR)):
                continue
            # float64: Lightning keeps it (float32 would round byte counts above 16 MB); rank_zero_only: only
            # rank 0 measures; batch_size: nothing to infer from the batch
            module.log(
                name,
                torch.tensor(value, dtype=torch.float64),
                prog_bar=name in PROGRESS_BAR,
                on_step=True,
                on_epoch=False,
                rank_zero_only=True,
                batch_size=1,
            )
