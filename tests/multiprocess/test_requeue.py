"""Preemption stop and exact resume (``RequeueOnSignal``) on 2 real gloo ranks.

A real SIGUSR1 reaches only rank 1, in the middle of an accumulation window and of an epoch. Both ranks
must stop together at the next optimizer step, with one atomically published checkpoint; a fresh Trainer
resumed from it must finish with exactly the weights of an uninterrupted run (same ops in the same order:
bitwise), and both must equal the single-process reference within EQ_TOL. Checked for BucketedDDP (one
checkpoint file) and ZeRO-3 (a sharded checkpoint directory). Nothing is requeued here: the BucketedDDP run
asks to requeue a job id with no ``scontrol`` on PATH, which must be logged while the checkpoint is still
saved; the Slurm tier checks the requeue itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from _lightning_reference import ENV, _check_against, _quiet_rank, _reference, _state, _TiedModule, _trainer

from lightning_sync import BucketedDDPStrategy, ShardedStrategy
from lightning_sync.launch.requeue import POINTER, RequeueOnSignal, latest_checkpoint
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

STEPS, ACCUMULATE = 24, 2  # 36 batches per rank and epoch at 2 ranks: 18 steps per epoch, so epoch 2 is reached
SIGNAL_AT_BATCH = 13  # rank 1 signals itself after micro-batch 13, the first half of step 7's window: the stop
STOP_STEP = 7  # must wait for the step boundary (micro-batch 14), optimizer step 7, and not save mid-window


class _SignalAt(pl.Callback):
    """Sends a real ``sig`` to this process after training batch ``batch`` (1-based) on rank ``rank`` only."""

    def __init__(self, rank: int, batch: int, sig: signal.Signals = signal.SIGUSR1) -> None:
        self.rank, self.batch, self.sig = rank, batch, sig

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        batch_idx = args[-1]
        if trainer.global_rank == self.rank and trainer.current_epoch == 0 and batch_idx + 1 == self.batch:
            os.kill(os.getpid(), self.sig)


@contextlib.contextmanager
def _no_scontrol_job() -> Iterator[list[str]]:
    """A SLURM job id, a PATH without scontrol, and the ``lightning_sync.launch`` log lines said meanwhile."""
    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler, logger = _Keep(), logging.getLogger("lightning_sync.launch")
    saved = {k: os.environ.get(k) for k in ("SLURM_JOB_ID", "PATH")}
    with tempfile.TemporaryDirectory() as empty:
        os.environ.update(SLURM_JOB_ID="4242", PATH=empty)
        logger.addHandler(handler)
        try:
            yield records
        finally:
            logger.removeHandler(handler)
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


class _Draws(pl.Callback):
    """Draws from Python's and NumPy's global RNGs before every training batch, as user augmentations do."""

    def __init__(self) -> None:
        self.draws: list[tuple[float, float]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.draws.append((random.random(), float(np.random.random())))


def _strategies() -> dict[str, Any]:
    return {
        "bucketed_ddp": lambda: BucketedDDPStrategy(bucket_cap_mb=0.001),
        "zero3": lambda: ShardedStrategy(stage=3, bucket_cap_mb=0.001),
    }


def _fit(world: int, strategy: Any, callbacks: list[Any], ckpt: Path | None = None) -> tuple[pl.Trainer, Any]:
    random.seed(100 + torch.distributed.get_rank() if torch.distributed.is_initialized() else 100)
    np.random.seed(200)  # every fit starts from the same host RNG states; a resume must replace them
    module = _TiedModule("adamw", scheduler=True)
    trainer = _trainer(world, strategy, max_steps=STEPS, accumulate_grad_batches=ACCUMULATE, callbacks=callbacks)
    trainer.fit(module, ckpt_path=ckpt)
    return trainer, module


def _worker(rank: int, world: int, tmpdir: str) -> tuple[list[str], int]:
    _quiet_rank()
    ck = Checks()
    init = _state(_TiedModule("adamw", scheduler=True))
    ref = _reference(_TiedModule("adamw", scheduler=True), _TiedModule().ds, world, STEPS, accumulate=ACCUMULATE)
    for name, make in _strategies().items():
        directory = Path(tmpdir) / name
        whole_draws = _Draws()
        _, whole = _fit(world, make(), [whole_draws])
        _check_against(ck, f"[{name} uninterrupted]", whole, ref["state"], init)

        # bucketed_ddp: asked to requeue "job 4242" with no scontrol on PATH: it must say so and still save
        requeue = name == "bucketed_ddp"
        stopper = RequeueOnSignal(directory, "USR1", requeue=requeue)
        with _no_scontrol_job() as records:
            trainer, _ = _fit(world, make(), [stopper, _SignalAt(1, SIGNAL_AT_BATCH), _Draws()])
        ck.true(f"[{name}] every rank stopped", stopper.preempted)
        ck.true(f"[{name}] not requeued", not stopper.requeued)
        if requeue and rank == 0:
            said = [r for r in records if "scontrol is not on PATH, so job 4242 is NOT requeued" in r]
            ck.true(f"[{name}] the missing scontrol is logged", len(said) == 1, records)
        ck.true(
            f"[{name}] stopped at the step boundary after the signal",
            trainer.global_step == STOP_STEP,
            trainer.global_step,
        )
        ck.true(
            f"[{name}] handler restored",
            signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
            signal.getsignal(signal.SIGUSR1),
        )
        ckpt = latest_checkpoint(directory)
        ck.true(
            f"[{name}] latest.json names the checkpoint", ckpt == directory / f"requeue-step{STOP_STEP:09d}.ckpt", ckpt
        )
        if rank == 0:
            pointer = json.loads((directory / POINTER).read_text())
            ck.true(f"[{name}] pointer step", pointer.get("global_step") == STOP_STEP, pointer)
            left = sorted(p.name for p in directory.iterdir())
            ck.true(f"[{name}] no temporary left", left == sorted([POINTER, ckpt.name]), left)

        resumed_stopper, resumed_draws = RequeueOnSignal(directory, "USR1", requeue=False), _Draws()
        trainer, resumed = _fit(world, make(), [resumed_stopper, resumed_draws], ckpt=ckpt)
        # Python's and NumPy's RNGs go on from where the stopped run left them: the resumed run draws
        # exactly what the uninterrupted run drew for the same batches (the fit's own seeding is replaced)
        tail = whole_draws.draws[len(whole_draws.draws) - len(resumed_draws.draws) :]
        ck.true(
            f"[{name}] host RNG draws continue the uninterrupted run's",
            len(resumed_draws.draws) == (STEPS - STOP_STEP) * ACCUMULATE and resumed_draws.draws == tail,
            (len(resumed_draws.draws), resumed_draws.draws[:2], tail[:2]),
        )
        ck.true(f"[{name}] the resumed run was not stopped", not resumed_stopper.preempted)
        ck.true(f"[{name}] resumed run ends at max_steps", trainer.global_step == STEPS, trainer.global_step)
        for key, value in _state(resumed).items():
            # same batches, same ops, same order as the uninterrupted run: bitwise equal
            ck.true(
                f"[{name}] resumed == uninterrupted: {key}",
                torch.equal(value, _state(whole)[key]),
                (value - _state(whole)[key]).abs().max().item(),
            )
        _check_against(ck, f"[{name} resumed]", resumed, ref["state"], init)
    return ck.result()


@pytest.mark.timeout(300)
def test_signal_on_one_rank_stops_both_and_resume_is_exact(tmp_path: Path) -> None:
    results = run_distributed(_worker, 2, str(tmp_path), timeout=240, env=ENV)
    assert_all_ranks_passed(results, min_checks=20, same_count=False)
