"""``NonFiniteGuard`` on 2 real gloo ranks: an Inf written into rank 1's gradient *after* the all-reduce (so
rank 0's gradients are finite) makes both ranks skip that step and only that step, the replicas stay
identical, and the steps before it match the single-process reference; three bad steps in a row with
``max_consecutive=3`` stop every rank with an error naming them."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _lightning_reference import ENV, EQ_TOL, _quiet_rank, _reference, _state, _TiedModule, _trainer

from lightning_sync import BucketedDDPStrategy, comms
from lightning_sync.diagnostics import NonFiniteGuard
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

# The communication context of this process's checks (a strategy owns one the same way).
CTX = comms.CommContext(observer=comms.CommStats())


class _InfAt(pl.Callback):
    """After backward (the gradients are synchronized by then), put an Inf into this rank's gradient at the
    given 1-based optimizer steps, on rank ``rank`` only."""

    def __init__(self, rank: int, steps: set[int]) -> None:
        self.rank, self.steps = rank, steps

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == self.rank and trainer.global_step + 1 in self.steps:
            pl_module.net.fc1.weight.grad[0, 0] = float("inf")


class _Record(pl.Callback):
    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.states.append(_state(pl_module))


def _worker(rank: int, world: int) -> tuple[list[str], int]:
    _quiet_rank()
    ck = Checks()
    guard, record, module = NonFiniteGuard(max_consecutive=3), _Record(), _TiedModule("sgd")
    _trainer(world, BucketedDDPStrategy(), max_steps=5, callbacks=[_InfAt(1, {3}), guard, record]).fit(module)
    ck.true("one step skipped, step 3", guard.skipped == 1 and guard.skipped_steps == [3], guard.skipped_steps)
    for name, value in record.states[2].items():
        ck.true(f"step 3 left {name} alone", torch.equal(value, record.states[1][name]))
    ck.true("steps 4-5 trained", any(not torch.equal(v, record.states[2][k]) for k, v in record.states[4].items()))
    ref = _reference(_TiedModule("sgd"), module.ds, world, steps=2)["state"]
    for name, value in record.states[1].items():
        ck.close(f"step 2 = reference: {name}", value, ref[name], **EQ_TOL)
    everyone = CTX.all_gather_object(_state(module))
    for name in everyone[0]:
        ck.true(f"replicas identical: {name}", torch.equal(everyone[0][name], everyone[1][name]))
    ck.raises(
        "three in a row stop every rank",
        lambda: _trainer(
            world,
            BucketedDDPStrategy(),
            max_steps=6,
            callbacks=[_InfAt(1, {2, 3, 4}), NonFiniteGuard(max_consecutive=3)],
        ).fit(_TiedModule("sgd")),
        r"3 consecutive optimizer steps had non-finite gradients \(steps \[2, 3, 4\]\); max_consecutive=3",
        exc=RuntimeError,
    )
    return ck.result()


@pytest.mark.timeout(240)
def test_an_inf_on_one_rank_skips_that_step_everywhere_and_a_run_of_them_stops() -> None:
    assert_all_ranks_passed(run_distributed(_worker, 2, timeout=180, env=ENV), min_checks=20)


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, None])
def test_bad_limit_is_named(bad: Any) -> None:
    with pytest.raises(ValueError, match=f"max_consecutive must be an int >= 1, got {bad!r}"):
        NonFiniteGuard(max_consecutive=bad)
