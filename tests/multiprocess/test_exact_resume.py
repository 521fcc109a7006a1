"""Exact mid-epoch resume on 2 real gloo ranks, by both ways a run stops: a preemption signal
(``RequeueOnSignal``) and a step-interval ``ModelCheckpoint`` resumed with ``ckpt_path``.

For ``num_workers`` 0, 2 and 2 with persistent workers, the resumed run must train on exactly the sample
indices an uninterrupted run trains on, in the same order of global batches, draw the same numbers from
Python's, NumPy's and torch's RNGs in user code, and end with bitwise the same weights (same batches, same
ops, same order). The uninterrupted run itself equals the single-process reference within ``EQ_TOL``.

The stops are chosen where resume used to go wrong: inside an accumulation window's epoch (the preemption,
epoch 0) and in a later epoch (the checkpoint, epoch 1, whose sampler epoch must be restored before the
loader's workers prefetch).
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from _lightning_reference import (
    ENV,
    _check_against,
    _quiet_rank,
    _reference,
    _state,
    _TiedModule,
    _token_data,
    _trainer,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_sync import BucketedDDPStrategy, ShardedStrategy
from lightning_sync.launch.requeue import RequeueOnSignal, latest_checkpoint
from lightning_sync.resume import RANK_STATES
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

N, BATCH, ACCUMULATE = 128, 4, 2  # 2 ranks: 16 micro-batches per rank and epoch, 8 optimizer steps
STEPS = 12  # reaches epoch 1
SIGNAL_AT = 5  # rank 1 signals itself after micro-batch 5 (1-based, epoch 0): the stop waits for step 3
PREEMPT_STEP = 3
CKPT_STEP = 10  # epoch 1, its micro-batch 4
LOADERS = {
    "workers0": {"num_workers": 0},
    "workers2": {"num_workers": 2},
    "persistent2": {"num_workers": 2, "persistent_workers": True},
}


class _Recorded(_TiedModule):
    """``_TiedModule`` whose batches carry their sample indices; records them, and what user code draws
    from Python's, NumPy's and torch's RNGs, at every training step."""

    def __init__(self, loader: dict[str, Any]) -> None:
        super().__init__("adamw", _token_data(N), scheduler=True)
        ids, y = self.ds.tensors
        self.indexed = TensorDataset(ids, y, torch.arange(len(y)))
        self.loader = loader
        self.seen: list[list[int]] = []
        self.draws: list[tuple[float, float, float]] = []

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        ids, y, idx = batch
        self.seen.append(idx.tolist())
        self.draws.append((random.random(), float(np.random.random()), float(torch.rand(()))))
        return super().training_step((ids, y), batch_idx)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.indexed, batch_size=BATCH, shuffle=True, **self.loader)


class _SignalAt(pl.Callback):
    """A real SIGUSR1 to this process after micro-batch ``SIGNAL_AT`` of epoch 0, on rank 1 only."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_rank == 1 and trainer.current_epoch == 0 and args[-1] + 1 == SIGNAL_AT:
            os.kill(os.getpid(), signal.SIGUSR1)


def _fit(
    strategy: Any,
    loader: dict[str, Any],
    callbacks: list[Any],
    max_steps: int = STEPS,
    ckpt: Path | None = None,
    **kw: Any,
) -> tuple[pl.Trainer, _Recorded]:
    # every fit starts from the same RNG states; a resume must replace them with the saved ones
    random.seed(100 + torch.distributed.get_rank())
    np.random.seed(200)
    torch.manual_seed(300)
    module = _Recorded(loader)
    trainer = _trainer(2, strategy, max_steps=max_steps, accumulate_grad_batches=ACCUMULATE, callbacks=callbacks, **kw)
    trainer.fit(module, ckpt_path=ckpt)
    return trainer, module


def _same_run(ck: Checks, tag: str, whole: _Recorded, first: _Recorded | None, resumed: _Recorded, steps: int) -> None:
    """The stopped run's and the resumed run's batches and draws, joined, are the uninterrupted run's
    (``first`` None: the checkpoint was written by the uninterrupted run itself, which went on)."""
    done = steps * ACCUMULATE  # micro-batches trained before the stop
    if first is None:
        first_seen = whole.seen[:done]
    else:
        first_seen = first.seen
        ck.true(f"{tag} stopped run trained {done} micro-batches", len(first_seen) == done, len(first_seen))
    joined = first_seen + resumed.seen
    diverged = next((i for i, (a, b) in enumerate(zip(joined, whole.seen)) if a != b), None)
    ck.true(
        f"{tag} sample indices of every batch equal the uninterrupted run's",
        len(joined) == len(whole.seen) and diverged is None,
        (
            len(joined),
            len(whole.seen),
            diverged,
            joined[diverged] if diverged is not None else None,
            whole.seen[diverged] if diverged is not None else None,
        ),
    )
    ck.true(
        f"{tag} RNG draws in user code continue the uninterrupted run's",
        resumed.draws == whole.draws[done:],
        (resumed.draws[:1], whole.draws[done : done + 1]),
    )
    for key, value in _state(resumed).items():
        # same batches, same ops, same order as the uninterrupted run: bitwise equal
        ck.true(
            f"{tag} resumed == uninterrupted: {key}",
            torch.equal(value, _state(whole)[key]),
            (value - _state(whole)[key]).abs().max().item(),
        )


def _worker(rank: int, world: int, tmpdir: str, strategy: str, loaders: list[str]) -> tuple[list[str], int]:
    _quiet_rank()
    make = {
        "bucketed_ddp": lambda: BucketedDDPStrategy(bucket_cap_mb=0.001),
        "zero3": lambda: ShardedStrategy(stage=3, bucket_cap_mb=0.001),
    }[strategy]
    ck = Checks()
    ds = _token_data(N)
    init = _state(_TiedModule("adamw", ds, scheduler=True))
    ref = _reference(_TiedModule("adamw", ds, scheduler=True), ds, world, STEPS, accumulate=ACCUMULATE)
    for name in loaders:
        loader = LOADERS[name]
        # the uninterrupted run of this loader (a persistent one draws its workers' base seed from torch's
        # RNG once, not at every epoch, so each loader has its own stream of draws); it also writes the
        # step-interval checkpoint the checkpoint path resumes from below, and goes on past it, as a run
        # that checkpoints every n steps and is then lost does
        dirpath = Path(tmpdir) / strategy / name / "checkpoints"
        saver = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=CKPT_STEP, save_top_k=-1)
        _, whole = _fit(make(), loader, [saver], enable_checkpointing=True)
        _check_against(ck, f"[{name} uninterrupted]", whole, ref["state"], init)

        # the preemption path: a signal on one rank, a stop at the next step boundary, a fresh Trainer
        directory = Path(tmpdir) / strategy / name / "requeue"
        trainer, first = _fit(make(), loader, [RequeueOnSignal(directory, "USR1", requeue=False), _SignalAt()])
        ck.true(
            f"[{name} signal] stopped at step {PREEMPT_STEP}", trainer.global_step == PREEMPT_STEP, trainer.global_step
        )
        _, resumed = _fit(
            make(), loader, [RequeueOnSignal(directory, "USR1", requeue=False)], ckpt=latest_checkpoint(directory)
        )
        _same_run(ck, f"[{name} signal]", whole, first, resumed, PREEMPT_STEP)

        # the checkpoint path: the uninterrupted run's step-interval checkpoint, resumed with ckpt_path
        written = sorted(dirpath.iterdir())
        ck.true(
            f"[{name} checkpoint] one written, at step {CKPT_STEP} of epoch 1",
            [p.name for p in written] == [f"epoch=1-step={CKPT_STEP}.ckpt"],
            written,
        )
        ckpt = written[-1]
        _, resumed = _fit(make(), loader, [], ckpt=ckpt)
        _same_run(ck, f"[{name} checkpoint]", whole, None, resumed, CKPT_STEP)
    return ck.result()


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("strategy", "loaders"),
    [
        ("bucketed_ddp", list(LOADERS)),
        # the data position is the strategy's to carry, not the loader's: one loader with workers suffices here
        ("zero3", ["workers2"]),
    ],
)
def test_mid_epoch_resume_is_exact_with_workers(tmp_path: Path, strategy: str, loaders: list[str]) -> None:
    results = run_distributed(_worker, 2, str(tmp_path), strategy, loaders, timeout=360, env=ENV)
    assert_all_ranks_passed(results, min_checks=20 * len(loaders), same_count=False)


class _SaveAtEnd(pl.Callback):
    """Saves a checkpoint when training ends (the bucketer and its compressor still exist), and records the
    collectives the save issued."""

    def __init__(self, path: Path) -> None:
        self.path, self.used = path, {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stats = trainer.strategy.comm.observer
        before = {op: (s.calls, s.bytes) for op, s in stats.snapshot().items()}
        trainer.save_checkpoint(self.path)
        after = {op: (s.calls, s.bytes) for op, s in stats.snapshot().items()}
        self.used = {
            op: (n - before.get(op, (0, 0))[0], b - before.get(op, (0, 0))[1])
            for op, (n, b) in after.items()
            if (n, b) != before.get(op, (0, 0))
        }


def _powersgd_save(rank: int, world: int, tmpdir: str) -> tuple[list[str], int]:
    """Saving gathers every rank's state to rank 0 once: PowerSGD's error feedback differs per rank and only
    rank 0 writes, so an all-gather would send each rank's state to every other rank for nothing."""
    _quiet_rank()
    ck = Checks()
    saver = _SaveAtEnd(Path(tmpdir) / "saved.ckpt")
    strategy = BucketedDDPStrategy(compression="powersgd", powersgd_warmup_steps=0)
    _trainer(world, strategy, max_steps=2, callbacks=[saver]).fit(_TiedModule("sgd"))
    ck.true(
        "saving gathers the per-rank states once, to rank 0, and all-gathers nothing",
        saver.used.get("gather", (0, 0))[0] == 1 and "all_gather" not in saver.used,
        saver.used,
    )
    if rank == 0:
        states = torch.load(saver.path, map_location="cpu", weights_only=True)[RANK_STATES]
        errors = [s["bucketer"]["compressor"]["error"] for s in states]
        ck.true(
            "every rank's error feedback is in the checkpoint, each its own",
            len(errors) == world
            and all(errors)
            and not all(torch.equal(errors[0][i], errors[1][i]) for i in errors[0]),
            [list(e) for e in errors],
        )
    return ck.result()


@pytest.mark.timeout(200)
def test_a_checkpoint_gathers_the_per_rank_states_once(tmp_path: Path) -> None:
    assert_all_ranks_passed(
        run_distributed(_powersgd_save, 2, str(tmp_path), timeout=150, env=ENV), min_checks=1, same_count=False
    )
