"""Communication telemetry on real gloo ranks, read back from the file Lightning's ``CSVLogger`` wrote.

Each fit logs with ``log_every_n_steps=1`` (DiLoCo's with 2, so the rows written must be those steps' figures);
rank 0 reads ``metrics.csv`` and checks every logged figure against the strategy's own accounting, the
single-process reference of this feature:

* the known payload of each step: bucketed DDP all-reduces the 2281 fp32 gradient values of ``_TiedNet``
  (its buckets hold no padding: each is one shard), ZeRO-3 all-gathers this rank's padded parameter shard
  once per micro-batch and reduce-scatters the padded full gradient once per optimizer step, DiLoCo
  all-reduces the pseudo-gradient every H-th step and nothing between; the ``async_ps`` worker on the
  server's rank and Hogwild's processes send nothing over a wire;
* :class:`_Probe`'s own reading of the strategy's :class:`~lightning_sync.comms.CommStats` around each
  optimizer step and over the whole of training (the sum of the logged bytes is the run's total);
* the bucketer's and the ZeRO engine's own bucket counts, the parameter server's staleness histogram, and
  the Hogwild processes' own update order (forced with barriers).

Bytes are compared exactly (they are integers, logged as float64). Times are compared with the probe's
windows, which enclose the telemetry's (see :func:`_check_step_figures`).

Three spawned groups: one with a process group runs the bucketed DDP, ZeRO-3 and DiLoCo fits in turn; one
without runs ``async_ps``; a driver starts Hogwild's own processes.
"""

from __future__ import annotations

import csv
import math
import os
import time
from collections import Counter
from typing import Any

import lightning.pytorch as pl
import torch
from _lightning_reference import ENV, _quiet_rank, _TiedModule, _trainer
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sync import (
    AsyncParameterServerStrategy,
    BucketedDDPStrategy,
    DiLoCoStrategy,
    HogwildStrategy,
    ShardedStrategy,
)
from lightning_sync.diagnostics import SlowRank
from lightning_sync.diagnostics._steps import optimizer_step_ended
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

GRAD_BYTES = 2281 * 4  # _TiedNet's trainable fp32 values (it has no buffers)
BYTES, MB, SECONDS, EXPOSED = "comm/bytes_per_step", "comm/MB_per_step", "comm/seconds_per_step", "comm/exposed_pct"
BUCKETS, STALENESS = "comm/buckets", "comm/staleness"
# Times: the probe reads the same CommStats, but its window of a step (its on_train_batch_start to its
# on_train_batch_end) encloses the telemetry's, with no collective in between, so blocked and covered time
# agree up to float rounding of sums of ~1e-3 s values (1e-9 s); the probe's wall time is the longer one.
TIME_ATOL = 1e-9
PCT_ATOL = 1e-6  # the same, as a percentage of steps of >= 1 ms


class _Probe(pl.Callback):
    """Rank 0's own reading of the strategy's CommStats: per micro-batch, per optimizer step, over training."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, float, float]] = []  # (bytes, blocked, covered, wall) per step
        self.micro: list[list[float]] = []  # per step: each micro-batch's bytes
        self.buckets: list[int] = []  # per step: the strategy's own bucket count after it
        self.progress_bar: set[str] = set()
        self.total: tuple[float, ...] = ()
        self.zero: tuple[int, int, int, int] = (0, 0, 0, 0)  # ZeRO: shard bytes, padded bytes, units, parameters
        self._start: tuple[float, ...] | None = None
        self._micro_start: float = 0.0
        self._first: tuple[float, ...] = ()

    @staticmethod
    def _read(trainer: pl.Trainer) -> tuple[float, ...]:
        s = trainer.strategy.comm.observer
        return (float(s.total_bytes), s.blocked_seconds(), s.covered_seconds(), time.perf_counter())

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first = self._read(trainer)
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            flats = [f for u in engine.units for f in u.flats]
            shard = sum(f.layout.shard_numel * f.compute_dtype.itemsize for f in flats)
            padded = sum(f.layout.padded * f.reduce_dtype.itemsize for f in flats)
            self.zero = (shard, padded, sum(1 for u in engine.units if u.numel), len(engine.names))

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        now = self._read(trainer)
        if self._start is None:
            self._start = now
            self.micro.append([])
        self._micro_start = now[0]

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        now = self._read(trainer)
        self.micro[-1].append(now[0] - self._micro_start)
        if not optimizer_step_ended(trainer):
            return
        assert self._start is not None
        self.steps.append(tuple(b - a for a, b in zip(self._start, now)))  # type: ignore[arg-type]
        self._start = None
        bucketer = getattr(trainer.strategy, "bucketer", None)
        if bucketer is not None:
            self.buckets.append(len(bucketer.buckets))
        self.progress_bar |= {k for k in trainer.progress_bar_metrics if k.startswith("comm/")}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.total = tuple(b - a for a, b in zip(self._first, self._read(trainer)))


def _rows(trainer: pl.Trainer) -> list[dict[str, float]]:
    """The rows of the CSV file the logger wrote that hold the telemetry, as numbers."""
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:  # type: ignore[union-attr]
        rows = list(csv.DictReader(f))
    return [{k: float(v) for k, v in row.items() if v != ""} for row in rows if row.get(BYTES, "") != ""]


def _fit(world: int, strategy: Any, tmp: str, name: str, every: int = 1, **kw: Any) -> tuple[pl.Trainer, _Probe]:
    """One fit of a fresh ``_TiedModule`` with a CSV logger writing every ``every`` steps, and a probe."""
    probe = _Probe()
    callbacks = [probe, *kw.pop("callbacks", [])]
    logger = CSVLogger(tmp, name=name, version=0)
    trainer = _trainer(world, strategy, logger=logger, log_every_n_steps=every, callbacks=callbacks, **kw)
    trainer.fit(_TiedModule("sgd"))
    return trainer, probe


def _check_step_figures(
    ck: Checks, tag: str, rows: list[dict[str, float]], probe: _Probe, steps: int, every: int = 1
) -> None:
    """What every strategy logs, against the probe: bytes exactly; seconds (blocked + covered) to TIME_ATOL;
    the exposed percentage in [0, 100] and at least the probe's (same blocked time over its longer window).
    With ``log_every_n_steps=every`` the rows are those of every ``every``-th step."""
    written = probe.steps[every - 1 :: every]
    ck.true(f"{tag} one row per written step", len(rows) == len(written) == steps // every, (len(rows), probe.steps))
    logged = [r[BYTES] for r in rows]
    ck.true(f"{tag} bytes per step = the probe's", logged == [s[0] for s in written], (logged, probe.steps))
    ck.true(
        f"{tag} the steps' bytes add up to the run's",
        sum(s[0] for s in probe.steps) == probe.total[0] and (every > 1 or sum(logged) == probe.total[0]),
        (logged, probe.total),
    )
    ck.true(f"{tag} MB = bytes / 1e6", all(r[MB] == r[BYTES] / 1e6 for r in rows), rows)
    for i, (row, (_, blocked, covered, wall)) in enumerate(zip(rows, written)):
        ck.true(
            f"{tag} step {i} seconds", abs(row[SECONDS] - (blocked + covered)) <= TIME_ATOL, (row, blocked, covered)
        )
        ck.true(
            f"{tag} step {i} exposed % in [probe's, 100]",
            100.0 * blocked / wall - PCT_ATOL <= row[EXPOSED] <= 100.0,
            (row, blocked, wall),
        )
    ck.true(f"{tag} only MB per step on the progress bar", probe.progress_bar == {MB}, probe.progress_bar)


# --------------------------------------------------------------------------- with a process group


def _pg_worker(rank: int, world: int, tmp: str) -> tuple[list[str], int]:
    _quiet_rank()
    ck = Checks()

    # bucketed DDP: buckets of ~2 KiB, so several; rebuilt in ready order after the first step
    strategy = BucketedDDPStrategy(bucket_cap_mb=0.002, first_bucket_mb=0.002)
    trainer, probe = _fit(world, strategy, tmp, "bucketed_ddp", max_steps=4)
    if rank == 0:
        rows = _rows(trainer)
        _check_step_figures(ck, "[ddp]", rows, probe, 4)
        logged = [r[BYTES] for r in rows]
        # every step all-reduces the gradient once; the second also broadcasts the rebuilt bucket order
        ck.true("[ddp] bytes per step = the gradient", logged[:1] + logged[2:] == [GRAD_BYTES] * 3, logged)
        ck.true("[ddp] the rebuild step also sends the order", logged[1] > GRAD_BYTES, logged)
        ck.true("[ddp] buckets = the bucketer's", [r[BUCKETS] for r in rows] == probe.buckets, (rows, probe.buckets))
        ck.true("[ddp] several buckets", min(probe.buckets) > 1, probe.buckets)
        ck.true("[ddp] communication took time", all(r[SECONDS] > 0 and r[EXPOSED] > 0 for r in rows), rows)

    # ZeRO-3 with 2 micro-batches a step: both gather the parameters, the second also reduce-scatters and
    # all-reduces one int32 per trainable parameter (which of them got no gradient on any rank)
    trainer, probe = _fit(world, ShardedStrategy(stage=3), tmp, "zero3", max_steps=3, accumulate_grad_batches=2)
    if rank == 0:
        rows = _rows(trainer)
        _check_step_figures(ck, "[zero3]", rows, probe, 3)
        shard, padded, units, params = probe.zero
        logged = [r[BYTES] for r in rows]
        step = 2 * shard + padded + 4 * params
        ck.true(
            "[zero3] bytes per step = 2 gathers + 1 reduce-scatter + the no-gradient check",
            logged[1:] == [step] * 2,
            (logged, shard, padded, params),
        )
        ck.true("[zero3] the first step also checks the forward order", logged[0] > step, logged)
        ck.true(
            "[zero3] each step = its micro-batches, the first of which gathers",
            all(len(m) == 2 and m[0] > 0 and sum(m) == b for m, b in zip(probe.micro, logged)),
            (probe.micro, logged),
        )
        ck.true("[zero3] buckets = the engine's units", all(r[BUCKETS] == units for r in rows), (rows, units))

    # DiLoCo with H = 3: local steps send nothing, every third step all-reduces the pseudo-gradient. Written
    # every 2 steps (steps 2, 4, 6: local, local, outer), so the figures of a neighbouring step would show
    trainer, probe = _fit(world, DiLoCoStrategy(sync_every=3), tmp, "diloco", every=2, max_steps=6)
    if rank == 0:
        rows = _rows(trainer)
        _check_step_figures(ck, "[diloco]", rows, probe, 6, every=2)
        logged = [r[BYTES] for r in rows]
        ck.true(
            "[diloco] every step: nothing, nothing, the pseudo-gradient",
            [s[0] for s in probe.steps] == [0, 0, GRAD_BYTES] * 2,
            probe.steps,
        )
        ck.true("[diloco] written: steps 2, 4, 6", [r["step"] for r in rows] == [1, 3, 5], rows)
        ck.true("[diloco] their bytes", logged == [0, 0, GRAD_BYTES], logged)
        ck.true("[diloco] local steps expose nothing", [r[EXPOSED] for r in rows[:2]] == [0.0, 0.0], rows)
        ck.true("[diloco] no buckets", not any(BUCKETS in r for r in rows), rows)
    return ck.result()


def test_bucketed_ddp_zero3_and_diloco_log_what_they_send(tmp_path: Any) -> None:
    results = run_distributed(_pg_worker, 2, str(tmp_path), timeout=300, env=ENV)
    assert_all_ranks_passed(results, min_checks=0, same_count=False)
    assert results[0][1] >= 40, results[0]


# --------------------------------------------------------------------------- async_ps: no process group


def _async_worker(rank: int, world: int, tmp: str) -> tuple[list[str], int, list[float]]:
    """Rank 0 hosts the server and is the slow worker: the other runs ahead, up to the bound, so rank 0's
    gradients arrive stale. Its own worker reaches the server in-process: no byte goes on a wire."""
    _quiet_rank()
    ck = Checks()
    strategy = AsyncParameterServerStrategy(max_staleness=2)
    trainer, probe = _fit(world, strategy, tmp, "async_ps", max_steps=6, callbacks=[SlowRank(0, 3)])
    if rank != 0:
        return (*ck.result(), [])
    rows = _rows(trainer)
    _check_step_figures(ck, "[async_ps]", rows, probe, trainer.global_step)
    logged = [r[BYTES] for r in rows]
    ck.true("[async_ps] rank 0's pushes are in-process: no bytes", logged == [0.0] * len(rows), logged)
    ck.true("[async_ps] waiting for the server is exposed", all(r[EXPOSED] > 0 for r in rows), rows)
    # NaN: a push the server discarded, its budget spent (only ever a worker's last)
    stale = [r[STALENESS] for r in rows if not math.isnan(r[STALENESS])]
    histogram = strategy.staleness_histogram  # the server's record of every gradient it applied
    ck.true(
        "[async_ps] rank 0's staleness is among the server's record",
        not Counter(stale) - Counter({float(k): v for k, v in histogram.items()}),
        (stale, histogram),
    )
    ck.true("[async_ps] every step but the last has one", len(stale) >= len(rows) - 1, (stale, rows))
    ck.true(
        "[async_ps] the server's view",
        all(r["ps/staleness_max"] <= 2 and r["ps/version"] >= 1 for r in rows) and rows[-1]["ps/global_step"] >= 1,
        rows,
    )
    return (*ck.result(), stale)


def test_async_ps_logs_its_requests_and_staleness(tmp_path: Any) -> None:
    results = run_distributed(_async_worker, 2, str(tmp_path), timeout=240, env=ENV, process_group=False)
    assert_all_ranks_passed(results, min_checks=0, same_count=False)
    assert results[0][1] >= 10, results[0]
    # the slow rank's gradients were stale at least once (else the comparison above could not fail)
    assert any(s > 0 for s in results[0][2]), results[0][2]


# --------------------------------------------------------------------------- Hogwild: its own processes


class _Ordered(pl.LightningModule):
    """Forces each step's order: both processes read (forward) after a barrier; process 1 updates, then process 0
    waits for it (a second barrier, which process 1 enters after its update) before updating. So exactly one
    update of the other process lands during each step of process 0."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 2, sparse=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.trainer.strategy.barrier()
        if self.global_rank == 0:
            self.trainer.strategy.barrier()
        return self.emb(batch[0]).sum()

    def on_train_batch_end(self, *args: Any) -> None:
        if self.global_rank == 1:
            self.trainer.strategy.barrier()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.arange(16) % 4), batch_size=2)


def _hogwild_driver(rank: int, world: int, tmp: str) -> list[dict[str, float]]:
    _quiet_rank()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=HogwildStrategy(),
        max_steps=4,
        logger=CSVLogger(tmp, name="hogwild", version=0),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(_Ordered())
    return _rows(trainer)


def test_hogwild_logs_the_other_process_updates_as_staleness(tmp_path: Any) -> None:
    rows = run_distributed(_hogwild_driver, 1, str(tmp_path), timeout=150, process_group=False)[0]
    assert [r[STALENESS] for r in rows] == [1.0] * 4, rows
    assert [r[BYTES] for r in rows] == [0.0] * 4, rows  # barriers carry no payload; nothing else is sent
    assert all(0 < r[EXPOSED] <= 100 for r in rows), rows  # the barriers' waiting
