"""LocalSGDStrategy on 2 real gloo ranks, against a single-process reference and against the average
of the replicas computed from every rank's own copy."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _lightning_reference import (
    ENV,
    EQ_TOL,
    _check_against,
    _quiet_rank,
    _reference,
    _state,
    _TiedModule,
    _trainer,
)

from lightning_sync import DiLoCoStrategy, LocalSGDStrategy, comms
from lightning_sync.sync.bucketing import GradBucketer
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

# The communication context of this process's checks (a strategy owns one the same way).
CTX = comms.CommContext(observer=comms.CommStats())

# averaging K replicas in fp32: a few ulps of weights ~1
AVG_TOL = {"rtol": 0.0, "atol": 1e-6}


class _Recording(_TiedModule):
    """Snapshots of the parameters after every training batch, in every validation step, and at the
    start of every training batch."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.after_batch: list[dict[str, torch.Tensor]] = []
        self.in_validation: list[dict[str, torch.Tensor]] = []
        self.before_batch: list[dict[str, torch.Tensor]] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.before_batch.append(_state(self))

    def on_train_batch_end(self, *args: Any) -> None:
        self.after_batch.append(_state(self))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.in_validation.append(_state(self))

    def val_dataloader(self) -> Any:
        return self.train_dataloader()


class _Holds(pl.Callback):
    """What the strategy holds for the gradients when training starts: its bucketer, or "absent"."""

    def __init__(self) -> None:
        self.bucketer: Any = "absent"

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.bucketer = getattr(trainer.strategy, "bucketer", "absent")


def _mean(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: sum(s[k] for s in states) / len(states) for k in states[0]}


def _worker(rank: int, world: int, tmpdir: str) -> tuple[list[str], int]:
    _quiet_rank()
    ck = Checks()
    # 1. H=1 with the momentum buffers averaged too is DDP exactly: the average of K local SGD+momentum
    #    steps from equal weights and equal averaged buffers is linear in the gradients
    module = _TiedModule("sgd")
    init = _state(module)
    ref = _reference(_TiedModule("sgd"), module.ds, world, steps=6)["state"]
    holds = _Holds()
    strategy = LocalSGDStrategy(sync_every=1, average_optimizer_state=True)
    _trainer(world, strategy, max_steps=6, callbacks=[holds]).fit(module)
    ck.true("[H=1] no warm-up, no gradient bucketer", holds.bucketer is None, holds.bucketer)
    _check_against(ck, "[H=1]", module, ref, init, tol=EQ_TOL)
    # 2. H=3, warm-up 2: replicas equal through warm-up, differ between syncs, identical right after
    #    each sync (steps 5 and 8); validation at step 4 sees the average, training resumes from the replica
    rec, holds = _Recording("sgd"), _Holds()
    trainer = _trainer(
        world,
        LocalSGDStrategy(sync_every=3, warmup_steps=2),
        max_steps=8,
        val_check_interval=4,
        limit_val_batches=1,
        callbacks=[holds],
    )
    trainer.fit(rec)
    ck.true("[H=3] the warm-up holds a gradient bucketer", isinstance(holds.bucketer, GradBucketer), holds.bucketer)
    everyone = CTX.all_gather_object(rec.after_batch)
    for step in range(8):
        diff = max((everyone[0][step][k] - everyone[1][step][k]).abs().max().item() for k in everyone[0][step])
        if step + 1 in (1, 2, 5, 8):
            ck.true(f"[H=3] replicas identical after step {step + 1}", diff == 0.0, diff)
        else:
            ck.true(f"[H=3] replicas differ after step {step + 1}", diff > 1e-6, diff)
    ck.true("[H=3] validations after steps 4 and 8", len(rec.in_validation) == 2, len(rec.in_validation))
    average_at_4 = _mean([everyone[r][3] for r in range(world)])
    for k, v in rec.in_validation[0].items():
        ck.close(f"[H=3] validation sees the average: {k}", v, average_at_4[k], **AVG_TOL)
    for k, v in rec.in_validation[-1].items():  # step 8 is a sync: validation sees the (equal) replicas as they are
        ck.close(f"[H=3] validation after a sync: {k}", v, rec.after_batch[7][k], rtol=0.0, atol=0.0)
    for k, v in rec.before_batch[4].items():  # after validation, training goes on from this rank's replica
        ck.close(f"[H=3] replica restored after validation: {k}", v, rec.after_batch[3][k], rtol=0.0, atol=0.0)
    # 3. a checkpoint between syncs holds the average of the replicas (one consistent model)
    path = os.path.join(tmpdir, "local.ckpt")
    module3 = _TiedModule("sgd")
    trainer3 = _trainer(world, LocalSGDStrategy(sync_every=3), max_steps=4)
    trainer3.fit(module3)
    mine = _state(module3)
    trainer3.save_checkpoint(path)
    replicas = CTX.all_gather_object(mine)
    saved = torch.load(path, map_location="cpu", weights_only=False)
    average = _mean(replicas)
    for k in average:
        ck.close(f"[ckpt] saved weights are the average: {k}", saved["state_dict"][k], average[k], **AVG_TOL)
    ck.true(
        "[ckpt] replicas did drift", max((replicas[0][k] - replicas[1][k]).abs().max().item() for k in average) > 1e-6
    )
    ck.true(
        "[ckpt] schedule state saved",
        saved["lightning_sync/local_sgd"]["steps"] == 4,
        saved.get("lightning_sync/local_sgd"),
    )
    _check_diloco(ck, world, tmpdir)
    return ck.failures, ck.count


class _AfterInner(pl.Callback):
    """The parameters right after each inner optimizer step (before any outer step) and after each batch."""

    def __init__(self) -> None:
        self.after_inner: list[dict[str, torch.Tensor]] = []
        self.after_batch: list[dict[str, torch.Tensor]] = []

    def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        trainer.optimizers[0].register_step_post_hook(lambda *a: self.after_inner.append(_state(module)))

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.after_batch.append(_state(module))


def _check_diloco(ck: Checks, world: int, tmpdir: str) -> None:
    """H=2: after inner step 2 every replica becomes w0 - lr * (g + mu * g), g = mean_r(w0 - local_r) (the
    first outer step's Nesterov momentum buffer is g itself); replicas differ after steps 1 and 3."""
    module, rec, holds = _TiedModule("sgd"), _AfterInner(), _Holds()
    w0 = _state(module)
    trainer = _trainer(
        world, DiLoCoStrategy(sync_every=2, outer_lr=0.7, outer_momentum=0.9), max_steps=3, callbacks=[rec, holds]
    )
    trainer.fit(module)
    ck.true("[diloco] holds no gradient bucketer", holds.bucketer == "absent", holds.bucketer)
    inner = CTX.all_gather_object(rec.after_inner)
    after = CTX.all_gather_object(rec.after_batch)
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    for name in trainable:
        g = sum(w0[name] - inner[r][1][name] for r in range(world)) / world
        want = w0[name] - 0.7 * (g + 0.9 * g)
        # fp32: an average of 2 values and two multiply-adds on weights ~1 -> a few ulps
        ck.close(f"[diloco] outer step by hand: {name}", after[0][1][name], want, rtol=0.0, atol=1e-6)
    for step, same in ((0, False), (1, True), (2, False)):
        diff = max((after[0][step][k] - after[1][step][k]).abs().max().item() for k in trainable)
        ck.true(
            f"[diloco] replicas {'identical' if same else 'differ'} after step {step + 1}",
            (diff == 0.0) if same else (diff > 1e-6),
            diff,
        )
    path = os.path.join(tmpdir, "diloco.ckpt")
    trainer.save_checkpoint(path)  # after step 3 (drifted): the checkpoint holds the global model of step 2
    saved = torch.load(path, map_location="cpu", weights_only=False)
    for name in trainable:
        ck.close(
            f"[diloco] checkpoint holds the global model: {name}",
            saved["state_dict"][name],
            after[0][1][name],
            rtol=0.0,
            atol=0.0,
        )
    ck.true(
        "[diloco] outer optimizer state saved",
        len(saved["lightning_sync/diloco"]["outer_optimizer"]["state"]) == len(trainable),
    )


@pytest.mark.timeout(240)
def test_local_sgd_equals_ddp_at_h1_syncs_on_schedule_and_saves_the_average(tmp_path: Any) -> None:
    results = run_distributed(_worker, 2, str(tmp_path), timeout=200, env=ENV)
    assert_all_ranks_passed(results, min_checks=40)


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"sync_every": 0}, "sync_every"),
        ({"sync_every": 2.5}, "sync_every"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"average_optimizer_state": "yes"}, "average_optimizer_state"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_arguments_are_named(kw: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        LocalSGDStrategy(**kw)


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"sync_every": 0}, "sync_every"),
        ({"outer_lr": 0}, "outer_lr"),
        ({"outer_momentum": 1}, "outer_momentum"),
        ({"outer_momentum": 0.0}, "nesterov"),
        ({"warmup_steps": 5}, "warmup_steps"),
    ],
)
def test_diloco_bad_arguments_are_named(kw: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        DiLoCoStrategy(**kw)
