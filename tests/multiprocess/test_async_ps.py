"""AsyncParameterServerStrategy on 2 ranks over real RPC, with no process group (as under a launcher).

Against the single-process reference: s = 0 is synchronous data-parallel training step for step (with
momentum, a per-step LR scheduler, norm clipping, AdamW and accumulation), validation sees the global
model on the whole validation set, a checkpoint holds the server's state and resumes exactly. With
s = 2 and rank 1 slowed 3x, the fast rank takes more steps, no applied gradient is staler than 2, and
every rank ends with the same model. A worker that raises stops the other with an error naming it.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
from _lightning_reference import (
    BATCH,
    ENV,
    EQ_TOL,
    _check_against,
    _quiet_rank,
    _reference,
    _state,
    _TiedModule,
    _token_data,
    _trainer,
)
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sync import AsyncParameterServerStrategy, comms
from lightning_sync.diagnostics import SlowRank
from lightning_sync.testing import Checks, DistributedRankError, assert_all_ranks_passed, run_distributed

EPOCH_SAMPLES = 24  # 2 ranks x batch 4: 3 steps an epoch
# Bytes one push carries: the 2281 trainable float32 values of _TiedNet (it has no buffers).
PUSH_BYTES = 2281 * 4


class _Validating(_TiedModule):
    """Records the parameters at the first validation batch and counts validation batches."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.in_validation: list[dict[str, torch.Tensor]] = []
        self.val_batches = 0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.in_validation.append(_state(self))
        self.val_batches += 1

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(self.ds, batch_size=BATCH)


def _synchronous(ck: Checks, world: int, rank: int) -> None:
    # 1. s = 0 with SGD + momentum, a per-step StepLR and norm clipping: the data-parallel reference
    module = _TiedModule("sgd", scheduler=True)
    init = _state(module)
    ref = _reference(_TiedModule("sgd", scheduler=True), module.ds, world, steps=6, clip=0.5)
    trainer = _trainer(world, AsyncParameterServerStrategy(max_staleness=0), max_steps=6, gradient_clip_val=0.5)
    trainer.fit(module)
    _check_against(ck, "[s=0 sgd]", module, ref["state"], init, tol=EQ_TOL)
    ck.true(
        "[s=0 sgd] 6 global steps, 6 own steps",
        (trainer.strategy.global_step, trainer.global_step) == (6, 6),
        (trainer.strategy.global_step, trainer.global_step),
    )
    ck.true(
        "[s=0 sgd] no gradient was stale",
        trainer.strategy.staleness_histogram == {0: 12},
        trainer.strategy.staleness_histogram,
    )
    ck.true("[s=0 sgd] max_steps restored after fit", trainer.max_steps == 6, trainer.max_steps)
    ck.close(
        "[s=0 sgd] the worker's optimizer reports the global LR",
        torch.tensor(trainer.optimizers[0].param_groups[0]["lr"]),
        torch.tensor(ref["lrs"][-1] * 0.5),
        rtol=0.0,
        atol=0.0,
    )  # the step after the last one halves it again
    stats = trainer.strategy.comm.observer.snapshot()
    sent, received = stats.get("rpc_send", comms.OpStats()), stats.get("rpc_recv", comms.OpStats())
    if rank == 0:  # the server's own worker calls it directly: nothing on the wire
        ck.true("[bytes] rank 0 sends nothing", sent.bytes == 0, sent)
        ck.true("[bytes] rank 0 receives nothing", received.bytes == 0, received)
    else:  # 6 pushes; replies to the setup pull, 6 pushes and the final finish
        ck.true("[bytes] rank 1 pushes 6 gradients", sent.bytes == 6 * PUSH_BYTES, sent)
        ck.true("[bytes] rank 1 receives 8 models", received.bytes == 8 * PUSH_BYTES, received)
    # 2. s = 0 with AdamW and accumulation 2
    module = _TiedModule("adamw")
    init = _state(module)
    ref = _reference(_TiedModule("adamw"), module.ds, world, steps=4, accumulate=2)
    _trainer(world, AsyncParameterServerStrategy(max_staleness=0), max_steps=4, accumulate_grad_batches=2).fit(module)
    _check_against(ck, "[s=0 adamw acc2]", module, ref["state"], init, tol=EQ_TOL)


def _validation_and_checkpoint(ck: Checks, world: int, tmpdir: str) -> None:
    # 3. 24 samples, 2 ranks, batch 4: 3 steps an epoch. Validation at the end of epoch 0 sees the global
    #    model (the reference after 3 steps), on the whole validation set
    ds = _token_data(EPOCH_SAMPLES)
    module = _Validating("sgd", ds, scheduler=True)
    init = _state(module)
    ref3 = _reference(_TiedModule("sgd", ds, scheduler=True), ds, world, steps=3)["state"]
    ref6 = _reference(_TiedModule("sgd", ds, scheduler=True), ds, world, steps=6)["state"]
    every3 = ModelCheckpoint(dirpath=tmpdir, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    trainer = _trainer(
        world, AsyncParameterServerStrategy(max_staleness=0), max_steps=6, callbacks=[every3], enable_checkpointing=True
    )
    trainer.fit(module)  # returns once every worker has finished: rank 0's checkpoints are written by then
    _check_against(ck, "[6 steps, 2 epochs]", module, ref6, init, tol=EQ_TOL)
    ck.true("[val] two validations", len(module.in_validation) == 2, len(module.in_validation))
    for k, v in module.in_validation[0].items():
        ck.close(f"[val] validation sees the global model: {k}", v, ref3[k], **EQ_TOL)
    ck.true(
        "[val] every worker evaluates the whole set",
        module.val_batches == 2 * EPOCH_SAMPLES // BATCH,
        module.val_batches,
    )
    # 4. the checkpoint of step 3 (an epoch end: Lightning restarts a mid-epoch resume at the epoch's first
    #    batch, its DataLoader being stateless) holds the server's model, optimizer state, scheduler and
    #    clock; resuming it to step 6 equals 6 uninterrupted steps
    path = os.path.join(tmpdir, "step=3.ckpt")
    saved = torch.load(path, map_location="cpu", weights_only=False)
    for k, v in ref3.items():
        ck.close(f"[ckpt] saved weights are the global model: {k}", saved["state_dict"][k], v, **EQ_TOL)
    momentum = saved["optimizer_states"][0]["state"]
    trainable = len([p for p in module.parameters() if p.requires_grad])
    ck.true(
        "[ckpt] the server's momentum buffers",
        len(momentum) == trainable and all("momentum_buffer" in s for s in momentum.values()),
        (len(momentum), trainable),
    )
    ck.true("[ckpt] scheduler at step 3", saved["lr_schedulers"][0]["last_epoch"] == 3, saved["lr_schedulers"])
    clock = saved["lightning_sync/async_ps"]
    ck.true("[ckpt] server clock", (clock["global_step"], clock["pushes"]) == (3, 6), clock)
    resumed = _TiedModule("sgd", ds, scheduler=True)
    strategy = AsyncParameterServerStrategy(max_staleness=0)
    _trainer(world, strategy, max_steps=6).fit(resumed, ckpt_path=path)
    _check_against(ck, "[resume 3 -> 6]", resumed, ref6, init, tol=EQ_TOL)
    ck.true("[resume] the global clock continued", strategy.global_step == 6, strategy.global_step)


def _straggler(ck: Checks, world: int, rank: int) -> dict[str, Any]:
    # 5. s = 2, rank 1 three times slower: the fast rank runs ahead by at most 2 versions
    module = _TiedModule("sgd")
    strategy = AsyncParameterServerStrategy(max_staleness=2)
    trainer = _trainer(world, strategy, max_steps=12, callbacks=[SlowRank(rank=1, factor=3)])
    trainer.fit(module)
    hist = strategy.staleness_histogram
    ck.true("[s=2] no applied gradient staler than 2", max(hist) <= 2, hist)
    ck.true("[s=2] 12 global steps = 24 applied pushes", sum(hist.values()) == 24 and strategy.global_step == 12, hist)
    return {"steps": trainer.global_step, "state": _state(module), "hist": hist}


def _worker(rank: int, world: int, tmpdir: str) -> tuple[list[str], int, dict[str, Any]]:
    _quiet_rank()
    ck = Checks()
    ck.true("no process group exists", not torch.distributed.is_initialized())
    _synchronous(ck, world, rank)
    _validation_and_checkpoint(ck, world, tmpdir)
    straggler = _straggler(ck, world, rank)
    return ck.failures, ck.count, straggler


@pytest.mark.timeout(300)
def test_async_ps_synchronous_case_checkpoints_and_bounded_straggler(tmp_path: Any) -> None:
    results = run_distributed(_worker, 2, str(tmp_path), timeout=240, env=ENV, process_group=False)
    assert_all_ranks_passed([(f, n) for f, n, _ in results], min_checks=60)
    fast, slow = results[0][2], results[1][2]
    assert fast["steps"] > slow["steps"], f"fast rank took {fast['steps']} steps, slow rank {slow['steps']}"
    assert fast["steps"] + slow["steps"] >= 24  # every applied push, plus any discarded past the budget
    assert 2 in fast["hist"], f"the bound never bit: {fast['hist']}"  # the slow rank's gradients lag by 2
    for k in fast["state"]:  # after fit every rank holds the final global model
        torch.testing.assert_close(fast["state"][k], slow["state"][k], rtol=0, atol=0)


class _Crashing(_TiedModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1 and self.trainer.global_step == 2:
            raise ValueError("rank 1 hit a bad batch")
        return super().training_step(batch, batch_idx)


def _crash_worker(rank: int, world: int) -> None:
    _quiet_rank()
    _trainer(world, AsyncParameterServerStrategy(max_staleness=1), max_steps=20).fit(_Crashing("sgd"))


@pytest.mark.timeout(180)
def test_a_failing_worker_stops_the_other_with_its_name() -> None:
    with pytest.raises(DistributedRankError) as err:
        run_distributed(_crash_worker, 2, timeout=120, env=ENV, process_group=False)
    message = str(err.value)  # rank 0's own error names the worker that failed, and why
    assert "worker 1 failed, so training stopped: ValueError: rank 1 hit a bad batch" in message, message


def _bad_server_rank(rank: int, world: int) -> None:
    _quiet_rank()
    _trainer(world, AsyncParameterServerStrategy(server_rank=2), max_steps=1).fit(_TiedModule("sgd"))


@pytest.mark.timeout(120)
def test_server_rank_outside_the_job_is_named() -> None:
    with pytest.raises(DistributedRankError, match=r"server_rank must be a rank of this job, in \[0, 1\], got 2"):
        run_distributed(_bad_server_rank, 2, timeout=90, env=ENV, process_group=False)


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"max_staleness": -1}, "max_staleness"),
        ({"max_staleness": "2"}, "max_staleness"),
        ({"max_staleness": True}, "max_staleness"),
        ({"max_staleness": 1.5}, "max_staleness"),
        ({"server_rank": -1}, "server_rank"),
        ({"timeout": 0}, "timeout"),
        ({"start_method": "thread"}, "start_method"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_arguments_are_named(kw: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        AsyncParameterServerStrategy(**kw)


def test_unbounded_staleness_is_accepted() -> None:
    assert AsyncParameterServerStrategy(max_staleness=math.inf).max_staleness == math.inf
