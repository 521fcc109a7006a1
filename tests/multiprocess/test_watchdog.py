"""The hang watchdog on real gloo ranks: a skipped collective and a diverging code path become errors on
every rank that name the culprit, within ``timeout + 10 s``; collectives that complete are untouched.

The bound is checked without reading a clock: gloo's own timeout (``PG_TIMEOUT``, below timeout + 10 s)
fails the hung request as "failed (...)" if the watchdog has not declared it first, so an error that says
"did not complete within <TIMEOUT> s" was raised by the watchdog after TIMEOUT and before PG_TIMEOUT.
(Measured here: 6.0 s with a 4 s timeout; 5.0 s with 3 s in the Lightning case.)"""

from __future__ import annotations

import datetime
import re
import time
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
    _token_data,
    _trainer,
)

from lightning_sync import BucketedDDPStrategy, comms
from lightning_sync.comms import collectives
from lightning_sync.comms.watchdog import (
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
)
from lightning_sync.diagnostics import HangWatchdog
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

# The communication context of this process's checks (a strategy owns one the same way).
CTX = comms.CommContext(observer=comms.CommStats())

TIMEOUT = 3.0  # the watchdog's collective timeout; the hung collective is declared after this
INTERVAL = 0.5
# gloo's own timeout: above the watchdog's declaration (TIMEOUT + ~3 INTERVAL), below the bound of
# TIMEOUT + 10 s. Tearing the group down waits for the hung request until it passes (gloo cannot abort one).
PG_TIMEOUT = TIMEOUT + 4.0
DECLARED = f"did not complete within {TIMEOUT:g} s"  # the watchdog's own timeout, not gloo's failure
LATE = 3.0  # how late a healthy rank arrives: many watchdog intervals, below the watchdog's timeout


def _skip_one_all_reduce(rank: int, k: int) -> tuple[list[str], int, str]:
    ck = Checks()
    CTX.start_watchdog(TIMEOUT, interval=INTERVAL)
    # phase 1: a slow rank (1.5 s, below the timeout) is not a hang; every sum equals the local reference
    for step in range(3):
        if rank == 2 and step == 1:
            time.sleep(1.5)
        t = torch.full((3,), float(rank + step))
        CTX.all_reduce(t)
        ck.close(
            f"all_reduce step {step}", t, torch.full((3,), float(sum(r + step for r in range(k)))), rtol=0, atol=0
        )  # small integers: exact
    ck.true("no abort after a slow but complete phase", CTX.watchdog.error is None)
    # phase 2: rank 1 skips the all_reduce of step 1, then everyone reaches the final barrier
    message = ""
    try:
        for step in range(3):
            if not (rank == 1 and step == 1):
                CTX.all_reduce(torch.ones(3))
        CTX.barrier()
    except CollectiveTimeout as err:
        message = str(err)
    CTX.stop_watchdog(clean=False)
    return (*ck.result(), message)


@pytest.mark.timeout(90)
def test_skipped_all_reduce_names_the_rank_on_every_rank() -> None:
    results = run_distributed(_skip_one_all_reduce, 3, timeout=60, pg_timeout=PG_TIMEOUT)
    assert_all_ranks_passed([r[:2] for r in results], min_checks=4)
    for rank, (_, _, message) in enumerate(results):
        assert message, f"rank {rank} did not raise CollectiveTimeout"
        assert DECLARED in message, f"rank {rank}: not the watchdog's declaration: {message!r}"
        # ranks 0 and 2 hang in all_reduce #6, rank 1 in barrier #6 (its 5th all_reduce was never issued):
        # every rank names the same split, rank 1 as the minority first
        assert (
            "different code paths at #6: barrier (0 B) on ranks [1]; all_reduce (12 B, float32[3], sum) on "
            "ranks [0, 2]" in message
        ), f"rank {rank}: {message}"


class _ExtraKeyOnRank0(_TiedModule):
    """Rank 0 alone logs one more key with ``sync_dist`` at step 2: Lightning's classic deadlock."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 0 and self.global_step == 1:
            self.log("only_on_rank_0", loss.detach(), sync_dist=True)
        return loss


class _FirstStep(pl.Callback):
    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.state is None:
            self.state = _state(pl_module)


def _diverging_log_key(rank: int, k: int) -> tuple[list[str], int, str]:
    _quiet_rank()
    ck = Checks()
    module, first = _ExtraKeyOnRank0("sgd"), _FirstStep()
    trainer = _trainer(
        k,
        BucketedDDPStrategy(timeout=PG_TIMEOUT),
        max_steps=4,
        callbacks=[HangWatchdog(TIMEOUT, interval=INTERVAL), first],
    )
    message = ""
    try:
        trainer.fit(module)
    except CollectiveError as err:
        message = str(err)
    ref = _reference(_TiedModule("sgd"), module.ds, k, steps=1)["state"]
    for name, value in (first.state or {}).items():
        ck.close(f"step 1 (before the paths diverge) = reference: {name}", value, ref[name], **EQ_TOL)
    return (*ck.result(), message)


@pytest.mark.timeout(120)
def test_a_sync_dist_key_logged_on_one_rank_only_is_named() -> None:
    results = run_distributed(_diverging_log_key, 2, timeout=90, env=ENV, pg_timeout=PG_TIMEOUT)
    assert_all_ranks_passed([r[:2] for r in results], min_checks=3)
    for rank, (_, _, message) in enumerate(results):
        assert DECLARED in message, f"rank {rank}: not the watchdog's declaration: {message!r}"
        # rank 0's extra sync_dist all_reduce (one fp32 scalar, under its logged key) meets rank 1's next
        # collective: both ranks name the split, rank 0 as the odd one
        assert re.search(
            r"took different code paths at #\d+: all_reduce \(4 B, float32\[\], avg, "
            r"'training_step\.only_on_rank_0'\) on ranks \[0\]; [\w/]+ \(\d+ B[^)]*\) on ranks \[1\]",
            message,
        ), f"rank {rank}: {message!r}"


class _RecordingWork:
    """A backend request whose ``wait`` calls are recorded. The watchdog must never pass a timeout: on NCCL a
    timed wait that runs out aborts the communicator, which kills a healthy job whose ranks arrive late."""

    def __init__(self, work: Any, waits: list[tuple[Any, ...]]) -> None:
        self._work, self._waits = work, waits

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._waits.append((*args, *kwargs.values()))
        return self._work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def get_future(self) -> Any:
        return self._work.get_future()


def _late_rank(rank: int, k: int) -> tuple[list[str], int]:
    ck = Checks()
    waits: list[tuple[Any, ...]] = []
    # every backend call comms makes for the three ways a gloo request is waited for (module waiting): all_reduce
    # (its future), reduce-scatter and send/recv (no future: a waiting thread)
    patched = [
        (torch.distributed, "all_reduce"),
        (collectives, "REDUCE_SCATTER_SINGLE"),
        (torch.distributed, "isend"),
        (torch.distributed, "irecv"),
    ]
    real = {name: getattr(owner, name) for owner, name in patched}
    for owner, name in patched:
        setattr(owner, name, lambda *a, _fn=real[name], **kw: _RecordingWork(_fn(*a, **kw), waits))
    CTX.start_watchdog(LATE + 5.0, interval=0.2)
    try:
        if rank == 1:
            time.sleep(LATE)  # the scenario itself: a rank busy elsewhere (data loading, a checkpoint write)
        late = CTX.all_reduce(torch.full((4,), float(rank + 1)))
        after = CTX.all_reduce(torch.full((4,), float(rank + 1)))  # the group still works afterwards
        if rank == 0:
            time.sleep(1.0)  # 5 intervals: now rank 1 waits
        shard = CTX.reduce_scatter(torch.arange(4.0) + rank)
        if rank == 1:
            time.sleep(1.0)
        ring = comms.algorithms.ring_all_reduce(CTX, torch.arange(4.0) + rank)  # send and recv
    finally:
        for owner, name in patched:
            setattr(owner, name, real[name])
    expected = torch.full((4,), float(sum(r + 1 for r in range(k))))  # small integers: exact
    ck.close("the late all_reduce", late, expected)
    ck.close("the next all_reduce", after, expected)
    ck.close("reduce_scatter", shard, (2 * torch.arange(4.0) + 1)[2 * rank : 2 * rank + 2])
    ck.close("ring all_reduce", ring, 2 * torch.arange(4.0) + 1)
    ck.true("no abort", CTX.watchdog.error is None, CTX.watchdog.error)
    ck.true("waited on every request", len(waits) >= 5, waits)
    ck.true("never a timed wait", all(w == () for w in waits), f"wait() arguments: {waits}")
    CTX.stop_watchdog()
    return ck.result()


@pytest.mark.timeout(90)
def test_a_rank_arriving_late_passes_with_the_watchdog_on() -> None:
    assert_all_ranks_passed(run_distributed(_late_rank, 2, timeout=60), min_checks=7)


class _SwappedKeys(_TiedModule):
    """At step 1 rank 0 logs ``a`` then ``b`` with ``sync_dist``, rank 1 logs ``b`` then ``a``: scalars alike, so
    the two reductions pair up (rank 0's ``a`` with rank 1's ``b``), nothing hangs, and both keys get wrong values."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 1:
            for key in ("a", "b") if self.global_rank == 0 else ("b", "a"):
                self.log(key, loss.detach(), on_step=True, on_epoch=False, sync_dist=True)
        return loss


def _swapped_log_keys(rank: int, k: int) -> str:
    _quiet_rank()
    trainer = _trainer(
        k, BucketedDDPStrategy(timeout=PG_TIMEOUT), max_steps=3, callbacks=[HangWatchdog(TIMEOUT, interval=INTERVAL)]
    )
    try:
        trainer.fit(_SwappedKeys("sgd"))
    except CollectiveError as err:
        return str(err)
    return ""


@pytest.mark.timeout(120)
def test_sync_dist_keys_that_pair_up_across_ranks_are_named() -> None:
    messages = run_distributed(_swapped_log_keys, 2, timeout=90, env=ENV, pg_timeout=PG_TIMEOUT)
    for rank, message in enumerate(messages):
        assert message, f"rank {rank} finished its fit: the swapped keys went unnoticed"
        # both ranks name the same first difference: the one all_reduce at which the keys met
        assert re.search(
            r"ranks issued different collectives on world at #\d+ that paired up: "
            r"all_reduce \(4 B, float32\[\], avg, 'training_step\.a'\) on ranks \[0\]; "
            r"all_reduce \(4 B, float32\[\], avg, 'training_step\.b'\) on ranks \[1\]",
            message,
        ), f"rank {rank}: {message!r}"
    assert messages[0] == messages[1], messages


def _same_calls_then_a_transposed_tensor(rank: int, k: int) -> tuple[list[str], int, str]:
    ck = Checks()
    CTX.start_watchdog(TIMEOUT, interval=INTERVAL)
    # the same calls on every rank, though their local arguments differ: an uneven all-gather, objects of other
    # sizes, a sub-group that rank 1 is not in (each result against its exact expected value)
    parts = CTX.all_gather(torch.full((rank + 1, 2), float(rank)))
    ck.close("uneven all_gather", parts, [torch.full((r + 1, 2), float(r)) for r in range(k)])
    ck.true("broadcast_object", CTX.broadcast_object({"from": rank} if rank == 1 else None, src=1) == {"from": 1})
    ck.true("all_gather_object", CTX.all_gather_object("y" * rank) == ["y" * r for r in range(k)])
    pair = torch.distributed.new_group([0, 2])
    if rank != 1:
        ck.close("sub-group all_reduce", CTX.all_reduce(torch.ones(2), group=pair), torch.full((2,), 2.0))
    total = sum(torch.arange(6.0) + r for r in range(k))  # small integers from here on: every result is exact
    ck.close("reduce_scatter", CTX.reduce_scatter(torch.arange(6.0) + rank), total[2 * rank : 2 * rank + 2])
    ck.close(
        "scatter",
        CTX.scatter([torch.full((r + 1,), 7.0) for r in range(k)] if rank == 0 else None),
        torch.full((rank + 1,), 7.0),
    )  # world #8 (its header: #9 the size, #10 the bytes)
    gathered = CTX.gather(torch.full((rank + 1,), float(rank)), dst=2)  # #11, #12
    if rank == 2:
        ck.close("gather", gathered, [torch.full((r + 1,), float(r)) for r in range(k)])
    out = torch.empty(k, 2)
    ck.close(
        "all_gather_into",
        CTX.all_gather_into(out, torch.full((2,), float(rank))),  # #13
        torch.arange(float(k)).repeat_interleave(2).view(k, 2),
    )
    ck.close("broadcast", CTX.broadcast(torch.full((3,), float(rank)), src=2), torch.full((3,), 2.0))  # #14
    ck.close("tree all_reduce", comms.algorithms.tree_all_reduce(CTX, torch.arange(6.0) + rank), total)  # send/recv
    CTX.verify()  # world #15, #16: the check's own all_gather_object
    ck.true("the same calls verify", CTX.watchdog.error is None, CTX.watchdog.error)
    # rank 2 reduces a [3, 2] tensor where the others reduce [2, 3]: 24 B each, so gloo pairs them up (world #17)
    CTX.all_reduce(torch.ones((3, 2) if rank == 2 else (2, 3)))
    message = ""
    try:
        CTX.verify()
    except CollectiveMismatch as err:
        message = str(err)
    ck.raises(
        "the next collective raises it too",
        lambda: CTX.barrier(),
        "different collectives on world at #17",
        exc=CollectiveMismatch,
    )
    CTX.stop_watchdog()
    return (*ck.result(), message)


@pytest.mark.timeout(90)
def test_collectives_that_pair_up_with_other_shapes_are_named_on_every_rank() -> None:
    results = run_distributed(_same_calls_then_a_transposed_tensor, 3, timeout=60)
    assert_all_ranks_passed([r[:2] for r in results], min_checks=10, same_count=False)
    for rank, (_, _, message) in enumerate(results):
        assert message.startswith(
            "ranks issued different collectives on world at #17 that paired up: "
            "all_reduce (24 B, float32[3, 2], sum) on ranks [2]; "
            "all_reduce (24 B, float32[2, 3], sum) on ranks [0, 1] (nothing hung"
        ), f"rank {rank}: {message!r}"


def _lightning_ddp_watched(rank: int, k: int) -> tuple[list[str], int]:
    """Lightning's own ``ddp`` under the HangWatchdog: its collectives do not go through our layer, so the
    watchdog can only watch the ranks' heartbeats; the run must train exactly as without it."""
    from lightning.pytorch.strategies import DDPStrategy

    _quiet_rank()
    ck = Checks()
    ds = _token_data()
    init = _state(_TiedModule("sgd", ds))
    ref = _reference(_TiedModule("sgd", ds), ds, k, 3)["state"]
    watchdog = HangWatchdog(TIMEOUT, interval=INTERVAL, verify_every=1)
    running: list[bool] = []

    class _Running(pl.Callback):  # whether the heartbeats run while the ranks train
        def on_train_batch_end(self, *args: Any) -> None:
            running.append(watchdog._comm.watchdog is not None)

    module = _TiedModule("sgd", ds)
    _trainer(
        k, DDPStrategy(timeout=datetime.timedelta(seconds=PG_TIMEOUT)), max_steps=3, callbacks=[watchdog, _Running()]
    ).fit(module)
    # Lightning's DDP averages the same per-rank gradients as the reference: float32 rounding order only
    _check_against(ck, "[lightning ddp watched]", module, ref, init)
    ck.true("the heartbeats ran at every step", running == [True] * 3, running)
    return ck.result()


@pytest.mark.timeout(90)
def test_the_watchdog_lets_lightning_ddp_train() -> None:
    assert_all_ranks_passed(run_distributed(_lightning_ddp_watched, 2, timeout=60, env=ENV), min_checks=5)
