"""Validation on 2 real gloo ranks counts every sample exactly once.

Lightning gives evaluation loaders a ``DistributedSampler`` that pads the dataset to a multiple of the world
size by repeating samples, and warns about it in ``trainer.validate()``. A lightning_sync strategy shards
evaluation without repeats instead, so the synced ``val_acc`` and ``val_loss`` of the package's models are
those of one process over the whole set. Where the shards' batch counts would differ (a collective in every
evaluation step, such as ZeRO-3's gathers, would then hang), it keeps the padding and says how many samples
are counted twice.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _lightning_reference import _QUIET, _quiet_rank
from torch.utils.data import DataLoader, TensorDataset

from lightning_sync import BucketedDDPStrategy, ShardedStrategy
from lightning_sync.models.digits import DigitsMLP
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

BATCH = 4
# 2 ranks: 27 samples are shards of 14 and 13, 4 batches each; 25 are 13 and 12: 4 batches and 3
EVEN_BATCHES, UNEVEN_BATCHES = 27, 25
# the single-process reference sums the same float32 losses in another order: 1e-6 relative covers it,
# while one sample counted twice moves the mean loss of 25-27 samples by ~1e-2 (and the accuracy by 1/N)
LOSS_TOL = {"rtol": 1e-6, "atol": 0.0}


class _Digits(DigitsMLP):
    def __init__(self, n: int) -> None:
        torch.manual_seed(0)  # the same untrained weights everywhere: predictions of every class occur
        super().__init__(hidden=16)
        g = torch.Generator().manual_seed(1)
        self.data = TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=BATCH)


def _reference(module: _Digits) -> dict[str, float]:
    x, y = module.data.tensors
    with torch.no_grad():
        logits = module(x)
    return {
        "val_loss": float(torch.nn.functional.cross_entropy(logits, y)),
        "val_acc": float((logits.argmax(1) == y).float().mean()),
    }


def _validate(strategy: Any, n: int) -> tuple[dict[str, float], dict[str, float], list[str]]:
    module = _Digits(n)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, **_QUIET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = trainer.validate(module, verbose=False)[0]
    return metrics, _reference(module), [str(w.message) for w in caught]


def _worker(rank: int, world: int) -> tuple[list[str], int]:
    _quiet_rank()
    ck = Checks()
    cases = {
        "bucketed_ddp": (lambda: BucketedDDPStrategy(), EVEN_BATCHES),
        "zero3": (lambda: ShardedStrategy(stage=3), EVEN_BATCHES),
    }
    for name, (make, n) in cases.items():
        metrics, ref, said = _validate(make(), n)
        ck.close(
            f"[{name}] val_loss over every sample once",
            torch.tensor(metrics["val_loss"]),
            torch.tensor(ref["val_loss"]),
            **LOSS_TOL,
        )
        ck.true(
            f"[{name}] val_acc over every sample once",
            metrics["val_acc"] == pytest.approx(ref["val_acc"], abs=1e-7),
            (metrics["val_acc"], ref["val_acc"]),
        )
        ck.true(
            f"[{name}] no warning about repeated samples", not any("replicates some samples" in m for m in said), said
        )
    # shards of 4 and 3 batches would leave a collective of every step (ZeRO-3's gathers, a metric synced on
    # every step) without a partner on rank 1: the padding stays, and the strategy says what it costs
    metrics, ref, said = _validate(BucketedDDPStrategy(), UNEVEN_BATCHES)
    said_here = any("1 sample of 25 is evaluated twice" in m for m in said)
    ck.true("[uneven batch counts] rank 0 says one sample is counted twice", said_here == (rank == 0), said)
    ck.true(
        "[uneven batch counts] and not Lightning's general warning",
        not any("replicates some samples" in m for m in said),
        said,
    )
    return ck.result()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_validation_counts_every_sample_once(tmp_path: Path) -> None:
    assert_all_ranks_passed(run_distributed(_worker, 2, timeout=200), min_checks=7, same_count=False)
