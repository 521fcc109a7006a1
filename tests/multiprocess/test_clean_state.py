"""Every fit starts from clean communication state, as in a fresh process: a Hydra multirun's next job, or a
second ``trainer.fit`` in one process (of the same strategy or another), must not inherit the previous one's
statistics, sequence numbers, node groups or watchdog namespace.

The reference is a fit in a fresh process: the first of two identical fits in the same ranks. Their
communication (calls and bytes per op, the last sequence number on every group) must be equal, exactly.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from _lightning_reference import ENV, _quiet_rank, _TiedModule, _trainer

from lightning_sync import BucketedDDPStrategy, ShardedStrategy, comms
from lightning_sync.diagnostics import HangWatchdog
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

# The communication context of this process's checks (a strategy owns one the same way).
CTX = comms.CommContext(observer=comms.CommStats())

TIMEOUT, INTERVAL = 30.0, 0.5  # the watchdog's: no collective here comes near either


class _LoggedLoss(_TiedModule):
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss.detach(), on_step=True, sync_dist=True)
        return loss


def _calls_and_bytes(comm: comms.CommContext) -> dict[str, tuple[int, int]]:
    return {op: (s.calls, s.bytes) for op, s in comm.observer.snapshot().items()}


class _Snapshot(pl.Callback):
    """What comms and the hang watchdog hold when training starts (after the strategy set up) and ends."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen["stats at start"] = _calls_and_bytes(trainer.strategy.comm)
        self.seen["node groups at start"] = len(trainer.strategy.comm._node_groups)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        wd = trainer.strategy.comm.watchdog
        assert wd is not None
        self.seen["stats at end"] = _calls_and_bytes(trainer.strategy.comm)
        self.seen["last sequence numbers"] = dict(wd._last)
        peer = 1 - trainer.global_rank
        record = wd._read([peer])[peer]  # published in this rank's watchdog namespace, by this fit's peer
        self.seen["the peer's record in this namespace"] = None if record is None else record["last"]


def _three_fits(rank: int, k: int) -> tuple[list[str], int, list[dict[str, Any]]]:
    """Bucketed DDP, then ZeRO-2, then bucketed DDP again, in the same processes: each strategy owns its context,
    so the third fit must communicate exactly as the first (a fresh process), and nothing the later fits do may
    reach the first one's statistics."""
    _quiet_rank()
    ck = Checks()
    fits, strategies = [], []
    for strategy in (BucketedDDPStrategy(comm_algorithm="hierarchical"), ShardedStrategy(stage=2), None):
        strategy = strategy or BucketedDDPStrategy(comm_algorithm="hierarchical")
        snapshot = _Snapshot()
        trainer = _trainer(
            k, strategy, max_steps=3, callbacks=[HangWatchdog(TIMEOUT, interval=INTERVAL, verify_every=1), snapshot]
        )
        trainer.fit(_LoggedLoss("sgd"))
        fits.append(snapshot.seen)
        strategies.append(strategy)
        if len(fits) == 2:  # the ZeRO fit is over: what does the first strategy's context hold now?
            first_after_second = _calls_and_bytes(strategies[0].comm)
    first, second, third = fits
    ck.true("the first fit communicated", first["stats at end"].get("all_reduce", (0, 0))[0] > 0, first)
    ck.true(
        "the first fit built node groups", first["stats at end"].get("hierarchical_all_reduce", (0, 0))[0] > 0, first
    )
    ck.true("the ZeRO fit reduce-scattered", second["stats at end"].get("reduce_scatter", (0, 0))[0] > 0, second)
    ck.true("three contexts", len({id(s.comm) for s in strategies}) == 3, [id(s.comm) for s in strategies])
    ck.true(
        "the ZeRO fit left the first one's statistics alone",
        first_after_second == first["stats at end"],
        (first_after_second, first["stats at end"]),
    )
    for what in first:
        ck.true(
            f"third fit = fresh process: {what}",
            third[what] == first[what],
            f"first {first[what]}, third {third[what]}",
        )
    return (*ck.result(), fits)


@pytest.mark.timeout(240)
def test_fits_in_one_process_have_independent_communication_state() -> None:
    results = run_distributed(_three_fits, 2, timeout=210, env=ENV)
    assert_all_ranks_passed([r[:2] for r in results], min_checks=10)


def _relaunched_peer(rank: int, k: int) -> tuple[list[str], int]:
    ck = Checks()
    if rank == 0:  # the multirun's previous job, in the process that stays (the peers relaunched for it are gone)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        CTX.start_watchdog(TIMEOUT, interval=INTERVAL)
        CTX.all_reduce(torch.ones(2))
        CTX.stop_watchdog()
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method="env://")  # this job; rank 1 is a fresh process
    wd = CTX.start_watchdog(TIMEOUT, interval=INTERVAL)
    CTX.barrier()  # both watchdogs have published (start publishes a first record before it returns)
    peer = wd._read([1 - rank])[1 - rank]
    ck.true("the peer's heartbeat is in this rank's watchdog namespace", peer is not None, "no record")
    ck.true("and it is the peer's", peer is not None and peer["pid"] != os.getpid(), peer)
    CTX.stop_watchdog()
    return ck.result()


@pytest.mark.timeout(90)
def test_a_relaunched_peer_shares_the_watchdog_namespace_of_a_process_that_ran_a_job_before() -> None:
    assert_all_ranks_passed(run_distributed(_relaunched_peer, 2, timeout=60, process_group=False), min_checks=2)


def _job_under_a_running_watchdog(rank: int, k: int) -> tuple[list[str], int]:
    ck = Checks()
    wd = CTX.start_watchdog(TIMEOUT, interval=INTERVAL)  # started by the user, before both jobs
    CTX.all_reduce(torch.ones(2))
    CTX.all_gather(torch.ones(rank + 1))
    CTX.begin_job()
    ck.true("the watchdog forgot the previous job's calls", wd._last == {}, wd._last)
    ck.true("the stats too", CTX.observer.snapshot() == {}, CTX.observer.snapshot())
    work = CTX.all_reduce(torch.full((2,), float(rank)), async_op=True)
    ck.true("sequence numbers start again", work.seq == 1, work)
    ck.close("the job's first all_reduce", work.wait(), torch.full((2,), 1.0))  # 0 + 1: exact
    CTX.verify()  # the ranks' hashes restarted alike
    ck.true("no mismatch", wd.error is None, wd.error)
    CTX.stop_watchdog()
    return ck.result()


@pytest.mark.timeout(90)
def test_a_job_that_begins_under_a_running_watchdog_counts_from_one() -> None:
    assert_all_ranks_passed(run_distributed(_job_under_a_running_watchdog, 2, timeout=60), min_checks=5)


def _two_async_fits(rank: int, k: int) -> tuple[list[str], int]:
    """The parameter server's RPC traffic is counted by the strategy's observer: a second fit starts from zero."""
    from lightning_sync import AsyncParameterServerStrategy

    _quiet_rank()
    ck = Checks()
    seen = []
    for _ in range(2):
        trainer = _trainer(k, AsyncParameterServerStrategy(max_staleness=0), max_steps=4)
        trainer.fit(_TiedModule("sgd"))
        seen.append(_calls_and_bytes(trainer.strategy.comm))
    # rank 1 pushes and pulls over RPC (rank 0's own worker talks to the server in process): at s = 0 both
    # fits make the same calls with the same bytes
    ck.true("[async_ps] the fit counted RPC traffic", rank == 0 or seen[0].get("rpc_send", (0, 0))[0] > 0, seen[0])
    ck.true("[async_ps] second fit = fresh process: calls and bytes per op", seen[1] == seen[0], seen)
    return ck.result()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_second_async_ps_fit_counts_from_zero() -> None:
    results = run_distributed(_two_async_fits, 2, timeout=150, env=ENV, process_group=False)
    assert_all_ranks_passed(results, min_checks=2)
