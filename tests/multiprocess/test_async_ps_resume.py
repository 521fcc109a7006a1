"""AsyncParameterServerStrategy resumed from a checkpoint (the module docstring's "Checkpoints" bullet).

Two ranks over real RPC, 24 samples (3 steps an epoch), SGD with momentum and a per-step StepLR on the
global clock; the checkpoint is the one of step 3, an epoch end (a mid-epoch resume restarts the epoch:
the data position is not the strategy's to restore).

* **The restore wins over early pushes** (s = 2). The server's rank restores its optimizer only once
  rank 1 is about to push, and then waits ``RACE_DELAY_S`` more so that the push reaches the server
  during the restore (the delay only widens the race: nothing below depends on when the push arrives).
  When the restore completes the server holds exactly the checkpoint: its version, model, optimizer
  state and scheduler. Every step applied afterwards is recorded on the server; replaying those steps
  in one process on a server loaded from the checkpoint gives the resumed run's final model bit for bit,
  the version and clock continue from the saved ones by exactly those steps, and none was staler than 2.
* **Exact where the schedule is deterministic.** At s = 0 the resumed run equals the uninterrupted one
  bit for bit (each step sums the same two gradients, in either order: exact in fp32), and so does a
  one-worker run at s = 2 with lookahead (one worker is never stale), with SGD and with AdamW.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
import torch
from _lightning_reference import (
    ENV,
    _quiet_rank,
    _state,
    _TiedModule,
    _token_data,
    _trainer,
)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_sync import AsyncParameterServerStrategy
from lightning_sync.sync.ps.server import ParameterServer
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

EPOCH_SAMPLES = 24  # 2 ranks x batch 4: 3 steps an epoch
RACE_DELAY_S = 2.0  # how long the restore waits after rank 1 is about to push (widens the race only)
RANK1_PUSHING = "test_async_ps_resume/rank1_pushing"
EXACT = {"rtol": 0.0, "atol": 0.0}  # the same fp32 operations on the same values, in the same order


def _store() -> torch.distributed.TCPStore:
    """The harness's rendezvous store, as a client: a flag rank 1 raises and the server's rank waits on."""
    return torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
    )


class _RaiseFlagBeforeFirstPush(Callback):
    """Rank 1: raise the flag just before its first push (after its backward)."""

    def __init__(self) -> None:
        self.raised = False

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if not self.raised:
            _store().set(RANK1_PUSHING, "1")
            self.raised = True


class _SlowRestore(AsyncParameterServerStrategy):
    """On the server's rank: restore the optimizer only while rank 1's first push is on its way, take the
    server's state the moment the restore is complete (before training starts), and record every step the
    server applies afterwards."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.at_restore: dict[str, Any] | None = None
        self.steps: list[tuple[int, list[Any]]] = []  # (version before the step, its pushes)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if self.server is not None:
            server, step = self.server, self.server._step

            def recorded(take: list[Any]) -> None:
                self.steps.append((server.version, list(take)))
                step(take)

            server._step = recorded  # type: ignore[method-assign]
            _store().wait([RANK1_PUSHING])
            time.sleep(RACE_DELAY_S)
        super().load_optimizer_state_dict(checkpoint)

    def on_train_start(self) -> None:
        if self.server is not None:
            self.at_restore = self.server.snapshot()
        super().on_train_start()


def _replay(ckpt: dict[str, Any], steps: list[tuple[int, list[Any]]], ds: Any, budget: int) -> ParameterServer:
    """A server loaded from ``ckpt`` in this process, the same way the strategy loads it, that has taken
    ``steps``: the single-process reference of the resumed run."""
    module = _TiedModule("sgd", ds, scheduler=True)
    module.load_state_dict(ckpt["state_dict"])
    configured = module.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    params = [p for p in module.parameters() if p.requires_grad]
    server = ParameterServer(params, list(module.buffers()), optimizer, 2, 2, budget)
    optimizer.load_state_dict(ckpt["optimizer_states"][0])
    scheduler.load_state_dict(ckpt["lr_schedulers"][0])
    server.load_state_dict(ckpt["lightning_sync/async_ps"])
    server.on_global_step = lambda _: scheduler.step()  # a per-step scheduler, frequency 1, on the global clock
    for _, take in steps:
        server._step(take)
    return server


def _check_restore(
    ck: Checks, strategy: _SlowRestore, ckpt: dict[str, Any], final: dict[str, torch.Tensor], ds: Any
) -> None:
    snap, saved = strategy.at_restore, ckpt["lightning_sync/async_ps"]
    assert snap is not None
    clock = snap["state"]
    ck.true(
        "[restore] the version, pushes and clock are the checkpoint's",
        {k: clock[k] for k in saved} == saved,
        (clock, saved),
    )
    trainable = [k for k, v in _TiedModule("sgd", ds).named_parameters() if v.requires_grad]
    for name, value in zip(trainable, snap["params"]):
        ck.close(f"[restore] the server's {name} is the checkpoint's", value, ckpt["state_dict"][name], **EXACT)
    state, want = snap["optimizer"]["state"], ckpt["optimizer_states"][0]["state"]
    ck.true("[restore] a momentum buffer per trainable parameter", sorted(state) == sorted(want), sorted(state))
    for i in want:
        ck.close(f"[restore] momentum buffer {i}", state[i]["momentum_buffer"], want[i]["momentum_buffer"], **EXACT)
    ck.true(
        "[restore] the learning rate is the checkpoint's",
        snap["optimizer"]["param_groups"][0]["lr"] == ckpt["optimizer_states"][0]["param_groups"][0]["lr"],
        snap["optimizer"]["param_groups"],
    )
    ck.true(
        "[restore] the scheduler is the checkpoint's", snap["schedulers"] == ckpt["lr_schedulers"], snap["schedulers"]
    )
    # after the restore: the recorded steps, and nothing else, took the checkpoint to the final model
    stale = Counter(version - p.read_version for version, take in strategy.steps for p in take)
    ck.true(
        "[after] every push was applied (none was held for ever, none lost)",
        sum(stale.values()) == 12 - saved["pushes"],
        stale,
    )
    ck.true("[after] no applied gradient staler than 2", max(stale) <= 2, stale)
    end = strategy._final
    assert end is not None
    ck.true(
        "[after] the version continued by exactly the steps taken",
        end["state"]["version"] == saved["version"] + len(strategy.steps),
        (end["state"], len(strategy.steps)),
    )
    ck.true(
        "[after] the global clock reached the budget from the saved one",
        (saved["global_step"], end["state"]["global_step"]) == (3, 6),
        end["state"],
    )
    ck.true(
        "[after] the staleness histogram continued",
        end["state"]["staleness"] == dict(Counter(saved["staleness"]) + stale),
        end["state"]["staleness"],
    )
    replay = _replay(ckpt, strategy.steps, ds, budget=6)
    ck.true("[replay] the same version", replay.version == end["state"]["version"], replay.version)
    for name, value in zip(trainable, replay.params):
        ck.close(
            f"[replay] resumed = checkpoint + the steps taken after the restore: {name}",
            final[name],
            value.detach(),
            **EXACT,
        )


def _two_ranks(rank: int, world: int, tmpdir: str) -> tuple[list[str], int, dict[str, torch.Tensor]]:
    _quiet_rank()
    ck = Checks()
    ds = _token_data(EPOCH_SAMPLES)
    # the uninterrupted run (s = 0: a deterministic schedule), with the checkpoint of step 3
    every3 = ModelCheckpoint(dirpath=tmpdir, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    whole = _TiedModule("sgd", ds, scheduler=True)
    _trainer(
        world, AsyncParameterServerStrategy(max_staleness=0), max_steps=6, callbacks=[every3], enable_checkpointing=True
    ).fit(whole)
    path = os.path.join(tmpdir, "step=3.ckpt")
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    # s = 2, rank 1 pushing while the server's rank restores
    raced = _TiedModule("sgd", ds, scheduler=True)
    strategy = _SlowRestore(max_staleness=2)
    callbacks = [_RaiseFlagBeforeFirstPush()] if rank == 1 else []
    _trainer(world, strategy, max_steps=6, callbacks=callbacks).fit(raced, ckpt_path=path)
    if rank == 0:
        _check_restore(ck, strategy, ckpt, _state(raced), ds)
    # s = 0 resumed: the uninterrupted run bit for bit
    resumed = _TiedModule("sgd", ds, scheduler=True)
    strategy0 = AsyncParameterServerStrategy(max_staleness=0)
    _trainer(world, strategy0, max_steps=6).fit(resumed, ckpt_path=path)
    for name, value in _state(resumed).items():
        ck.close(f"[s=0] resumed 3 -> 6 = uninterrupted: {name}", value, _state(whole)[name], **EXACT)
    ck.true("[s=0] the global clock continued", strategy0.global_step == 6, strategy0.global_step)
    return ck.failures, ck.count, _state(raced)


@pytest.mark.timeout(300)
def test_resume_restores_the_server_before_any_push_and_is_exact_at_s0(tmp_path: Any) -> None:
    results = run_distributed(_two_ranks, 2, str(tmp_path), timeout=240, env=ENV, process_group=False)
    assert_all_ranks_passed(
        [(f, n) for f, n, _ in results], min_checks=11, same_count=False
    )  # rank 0 checks the server
    assert results[0][1] >= 40, f"rank 0 ran {results[0][1]} checks"
    for k, v in results[0][2].items():  # after the raced fit both ranks hold the final global model
        torch.testing.assert_close(results[1][2][k], v, **EXACT)


def _one_worker(rank: int, world: int, tmpdir: str) -> tuple[list[str], int]:
    _quiet_rank()
    ck = Checks()
    ds = _token_data(12)  # 1 rank x batch 4: 3 steps an epoch
    for optimizer in ("sgd", "adamw"):
        every3 = ModelCheckpoint(
            dirpath=os.path.join(tmpdir, optimizer), filename="{step}", every_n_train_steps=3, save_top_k=-1
        )
        whole = _TiedModule(optimizer, ds, scheduler=True)
        _trainer(
            world,
            AsyncParameterServerStrategy(max_staleness=2),
            max_steps=6,
            callbacks=[every3],
            enable_checkpointing=True,
        ).fit(whole)
        resumed = _TiedModule(optimizer, ds, scheduler=True)
        strategy = AsyncParameterServerStrategy(max_staleness=2)
        _trainer(world, strategy, max_steps=6).fit(resumed, ckpt_path=os.path.join(tmpdir, optimizer, "step=3.ckpt"))
        for name, value in _state(resumed).items():
            ck.close(f"[{optimizer}] resumed 3 -> 6 = uninterrupted: {name}", value, _state(whole)[name], **EXACT)
        ck.true(
            f"[{optimizer}] the version continued from 3 to 6, never stale",
            (strategy._last.version, strategy.staleness_histogram) == (6, {0: 6}),
            (strategy._last.version, strategy.staleness_histogram),
        )
    return ck.failures, ck.count


@pytest.mark.timeout(200)
def test_one_worker_resumes_exactly(tmp_path: Any) -> None:
    results = run_distributed(_one_worker, 1, str(tmp_path), timeout=150, env=ENV, process_group=False)
    assert_all_ranks_passed(results, min_checks=20)
