"""The per-step arithmetic of the communication telemetry (``strategies/_telemetry.py``) in one process, on a
real :class:`~lightning_sync.comms.CommStats` driven by a hand-set clock, so every figure is exact; and that
without a logger (or off rank 0) nothing is measured at all."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lightning_sync.comms import CommStats
from lightning_sync.diagnostics import NonFiniteGuard
from lightning_sync.strategies._parts import StrategyParts
from lightning_sync.strategies._telemetry import CommTelemetry, StepTelemetry, blocked

BYTES, MB, SECONDS, EXPOSED = "comm/bytes_per_step", "comm/MB_per_step", "comm/seconds_per_step", "comm/exposed_pct"


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _telemetry(**kw: Any) -> tuple[StepTelemetry, CommStats, _Clock]:
    clock = _Clock()
    stats = CommStats(clock=clock)
    return StepTelemetry(stats, clock=clock, **kw), stats, clock


def test_a_step_counts_every_micro_batch_and_nothing_between_steps() -> None:
    tel, stats, clock = _telemetry()
    stats.record("all_reduce", 500)  # setup traffic, before the first step: in no step
    tel.begin()  # micro-batch 1 of 2
    stats.record("all_gather", 100)
    clock.now += 1.0
    tel.begin()  # micro-batch 2: the step started at micro-batch 1
    stats.record("all_gather", 100)
    stats.record("reduce_scatter", 400)
    clock.now += 1.0
    first = tel.end()
    stats.record("all_reduce", 7)  # validation between steps: in no step
    clock.now += 5.0
    tel.begin()
    stats.record("all_reduce", 40)
    clock.now += 1.0
    second = tel.end()
    assert (first[BYTES], first[MB]) == (600.0, 600 / 1e6)
    assert second[BYTES] == 40.0


def test_seconds_are_blocked_plus_covered_and_exposed_is_blocked_over_the_step() -> None:
    tel, stats, clock = _telemetry()
    tel.begin()
    stats.block_begin()  # launch an async collective: 0.5 s blocked in the launch
    clock.now += 0.5
    stats.block_end(0.5, issued_async=True)
    clock.now += 2.0  # 2 s of compute with it in flight: covered
    stats.block_begin()
    clock.now += 0.5  # 0.5 s blocked in its wait
    stats.block_end(0.5, completed_async=True)
    clock.now += 1.0  # 1 s of compute with nothing in flight
    out = tel.end()
    assert out[SECONDS] == pytest.approx(3.0, abs=1e-12)  # 1 s blocked + 2 s covered
    assert out[EXPOSED] == pytest.approx(25.0, abs=1e-9)  # 1 s blocked of a 4 s step


def test_exposed_is_capped_at_100_and_a_zero_length_step_is_0() -> None:
    tel, stats, clock = _telemetry()
    tel.begin()
    clock.now += 1.0
    stats.block_begin()
    stats.block_end(3.0)  # three threads blocked for the whole second
    assert tel.end()[EXPOSED] == 100.0
    assert tel.end()[EXPOSED] == 0.0  # no time passed since


def test_a_step_no_micro_batch_began_starts_where_the_last_one_ended() -> None:
    tel, stats, _ = _telemetry()
    tel.begin()
    stats.record("all_reduce", 10)
    tel.end()
    stats.record("all_reduce", 20)  # a second manual optimizer.step() in the same batch
    assert tel.end()[BYTES] == 20.0


def test_counters_are_logged_as_their_increase_and_gauges_as_they_are() -> None:
    count = {"comm/staleness": 3.0}
    tel, _, _ = _telemetry(counters=lambda: dict(count), gauges=lambda: {"comm/buckets": 4.0})
    tel.begin()
    count["comm/staleness"] = 5.0
    out = tel.end()
    assert (out["comm/staleness"], out["comm/buckets"]) == (2.0, 4.0)


def test_without_stats_only_the_strategy_figures() -> None:
    tel = StepTelemetry(None, gauges=lambda: {"comm/buckets": 2.0})
    tel.begin()
    assert tel.end() == {"comm/buckets": 2.0}


def test_blocked_counts_the_block_as_blocked_time() -> None:
    clock = _Clock()
    stats = CommStats(clock=clock)
    with blocked(stats):
        pass
    assert stats.blocked_seconds() > 0.0
    with blocked(None):  # no observer: nothing to do
        pass


# ---------------------------------------------------------------------------------------------- the hooks


class _Untouchable:
    """An observer and a module that fail the test when read: the hooks must not touch them."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"touched {name}")


class _Strategy:
    def on_train_start(self) -> None:
        pass

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        pass

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        return "stepped"


class _Hooked(StrategyParts, _Strategy):
    """The real hooks of ``StrategyParts`` (what ``SyncStrategy`` and ``NoProcessGroupStrategy`` run) over a stub
    Lightning strategy; built without ``StrategyParts.__init__`` so the test picks the comm and the module."""

    def __init__(self, loggers: list[Any], rank_zero: bool, comm: Any, module: Any = None) -> None:
        self.lightning_module = module or SimpleNamespace(_trainer=SimpleNamespace(loggers=loggers, callbacks=[]))
        self.is_global_zero, self.comm = rank_zero, comm
        self.telemetry = CommTelemetry(self, self._comm_counters, self._comm_gauges)


@pytest.mark.parametrize(("loggers", "rank_zero"), [([], True), (["a logger"], False)])
def test_no_logger_or_not_rank_0_measures_nothing(loggers: list[Any], rank_zero: bool) -> None:
    strategy = _Hooked(loggers, rank_zero, comm=_Untouchable())
    strategy.on_train_start()
    assert strategy.telemetry.step is None
    strategy.lightning_module = _Untouchable()  # from here on the hooks read neither module nor observer
    strategy.on_train_batch_start(None, 0)
    assert strategy.optimizer_step(None, None) == "stepped"


def _logging_strategy(
    every: int, bar: bool, callbacks: list[Any] | None = None
) -> tuple[_Hooked, CommStats, Any, dict[str, tuple[float, bool]]]:
    logged: dict[str, tuple[float, bool]] = {}
    trainer = SimpleNamespace(
        loggers=["a logger"],
        callbacks=callbacks or [],
        log_every_n_steps=every,
        global_step=0,
        should_stop=False,
        progress_bar_callback=object() if bar else None,
    )

    class _Module:
        _trainer = trainer

        def log(self, name: str, value: Any, *, prog_bar: bool, **kw: Any) -> None:
            logged[name] = (float(value), prog_bar)

    stats = CommStats()
    strategy = _Hooked([], True, comm=SimpleNamespace(observer=stats), module=_Module())
    strategy.lightning_module.trainer = trainer
    strategy.on_train_start()
    return strategy, stats, trainer, logged


def test_with_a_logger_rank_0_logs_every_figure_and_only_mb_on_the_progress_bar() -> None:
    strategy, stats, _, logged = _logging_strategy(every=1, bar=True)
    strategy.on_train_batch_start(None, 0)
    stats.record("all_reduce", 3_000_000)
    strategy.optimizer_step(None, None)
    assert logged[BYTES] == (3e6, False)
    assert logged[MB] == (3.0, True)
    assert [name for name, (_, bar) in logged.items() if bar] == [MB]


@pytest.mark.parametrize("bar", [False, True])
def test_figures_are_logged_on_the_steps_lightning_writes_and_mb_on_every_step_with_a_bar(bar: bool) -> None:
    strategy, stats, trainer, logged = _logging_strategy(every=3, bar=bar)
    for step in range(6):  # Lightning writes after its 3rd and 6th stepping batch: global_step 2 and 5 here
        trainer.global_step = step
        logged.clear()
        strategy.on_train_batch_start(None, step)
        stats.record("all_reduce", 1000 * (step + 1))
        strategy.optimizer_step(None, None)
        if step % 3 == 2:
            assert logged[BYTES] == (1000.0 * (step + 1), False), step
        else:
            assert set(logged) == ({MB} if bar else set()), step
    trainer.should_stop = True  # a last step Lightning writes because training stops
    logged.clear()
    strategy.optimizer_step(None, None)
    assert BYTES in logged


def test_the_nonfinite_guard_count_is_logged_when_the_guard_is_there() -> None:
    guard = NonFiniteGuard()
    strategy, _, _, logged = _logging_strategy(every=1, bar=False, callbacks=[guard])
    guard.skipped = 2  # what the guard counts when it skips a step
    strategy.optimizer_step(None, None)
    assert logged["comm/nonfinite_skipped"] == (2.0, False)
    strategy, _, _, logged = _logging_strategy(every=1, bar=False)
    strategy.optimizer_step(None, None)
    assert "comm/nonfinite_skipped" not in logged
