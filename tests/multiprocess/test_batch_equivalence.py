"""``batch.global_size=256 batch.per_device=32`` on 2 gloo ranks with ``BucketedDDPStrategy`` trains
to the same weights as one process taking one batch of 256 samples per step.

The numbers come from :func:`~lightning_sync.batch.derive_batch` (accumulate 4 at world 2), as the train app
derives them: its ``per_device`` is the DataLoader's batch size and its ``accumulate`` the Trainer's
``accumulate_grad_batches``. The reference is ``_reference(world=1, batch=global_size)`` from the shared
``_lightning_reference.py``: one process, one forward/backward on ``global_size`` samples, one optimizer step.
It walks the same samples as the 2 ranks: Lightning's ``DistributedSampler(shuffle=True, seed=PL_GLOBAL_SEED)``
draws the same permutation for any number of replicas and hands rank ``r`` every 2nd index of it, so the 4
micro-batches of 32 on both ranks are exactly the permutation's next 256 indices, which the 1-replica sampler
gives as one batch.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
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
from torch.utils.data import DataLoader

from lightning_sync import BucketedDDPStrategy
from lightning_sync.batch import derive_batch
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

__all__: list[str] = []

WORLD, GLOBAL, PER_DEVICE = 2, 256, 32  # the batch.global_size=256 batch.per_device=32 on 2 ranks
N_SAMPLES = 2 * GLOBAL  # 2 optimizer steps an epoch: no short last batch, no sampler padding
STEPS = 4  # two epochs: the second reshuffles (set_epoch), so the epoch boundary is covered too
# The bound. The two sides differ only in float32 rounding order: the reference takes one mean over
# 256 per-sample losses, the ranks take 4 means of 32 each, scale each by 1/4 (Lightning's accumulation) and
# average the two ranks' summed gradients with an all-reduce (sum, then / 2). That is ~1e-7 relative per
# gradient value; over 4 steps of SGD+momentum (lr 0.1) or AdamW (lr 0.01) on weights of magnitude <= ~1 it
# stays far below 1e-5 (observed max 1.2e-7), while a wrong accumulation count, a missing
# average or different samples move weights by >= ~1e-3 (and _check_against checks they moved > 1e-2).
TOL = {"rtol": 0.0, "atol": 1e-5}


class _BatchSizes(pl.Callback):
    """The size of every training micro-batch this rank saw."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.sizes.append(int(batch[0].shape[0]))


def _worker(rank: int, world: int) -> tuple[list[str], int, float, dict[str, dict[str, torch.Tensor]]]:
    _quiet_rank()
    ck = Checks()
    plan = derive_batch(world, global_size=GLOBAL, per_device=PER_DEVICE)
    ck.true("derived accumulation", (plan.per_device, plan.accumulate) == (PER_DEVICE, 4), plan.describe())
    ds = _token_data(N_SAMPLES)
    worst, finals = 0.0, {}  # max |distributed - reference|; final weights per optimizer
    for opt in ("sgd", "adamw"):
        tag = f"[{plan.describe()} {opt}]"
        init = _state(_TiedModule(opt))
        ref = _reference(_TiedModule(opt), ds, world=1, steps=STEPS, batch=plan.global_size)["state"]
        module, sizes = _TiedModule(opt, ds), _BatchSizes()
        trainer = _trainer(
            world, BucketedDDPStrategy(), max_steps=STEPS, accumulate_grad_batches=plan.accumulate, callbacks=[sizes]
        )
        trainer.fit(module, train_dataloaders=DataLoader(ds, batch_size=plan.per_device, shuffle=True))
        ck.true(f"{tag} optimizer steps", trainer.global_step == STEPS, trainer.global_step)
        ck.true(
            f"{tag} micro-batches of per_device samples, accumulate per step",
            sizes.sizes == [plan.per_device] * (STEPS * plan.accumulate),
            sizes.sizes,
        )
        _check_against(ck, tag, module, ref, init, tol=TOL)
        finals[opt] = _state(module)
        worst = max(worst, max((v - ref[k]).abs().max().item() for k, v in finals[opt].items()))
    return (*ck.result(), worst, finals)


@pytest.mark.timeout(120)
def test_global_256_per_device_32_on_2_ranks_matches_one_process_batch_256() -> None:
    results = run_distributed(_worker, WORLD, timeout=90, env=ENV)
    assert_all_ranks_passed(results, min_checks=1 + 2 * 4)
    print(f"max |distributed - one process| over all weights: {max(r[2] for r in results):.3g}")
    for opt, state in results[1][3].items():  # both ranks applied the same averaged gradients: bit-identical
        assert all(torch.equal(v, results[0][3][opt][k]) for k, v in state.items()), f"rank 1 drifted ({opt})"
