"""SlowRank (straggler injection) on 2 real gloo ranks under bucketed_ddp."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from _lightning_reference import ENV, _quiet_rank, _TiedModule, _trainer

from lightning_sync import BucketedDDPStrategy
from lightning_sync.diagnostics import SlowRank
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed


class _Clock(SlowRank):
    """SlowRank that also records the wall time of each whole batch on this rank."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.walls: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        self._t0 = time.perf_counter()
        super().on_train_batch_start(trainer, *args)

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.walls.append(time.perf_counter() - self._t0)


def _worker(rank: int, world: int) -> tuple[list[str], int]:
    _quiet_rank()
    ck = Checks()
    slow = _Clock(1, 3.0)
    _trainer(world, BucketedDDPStrategy(), max_steps=5, callbacks=[slow]).fit(_TiedModule("sgd"))
    if rank == 1:
        ck.true("the slow rank measured every batch", len(slow.measured) == 5, slow.measured)
        for i, (m, d) in enumerate(zip(slow.measured, slow.delays)):
            ck.close(
                f"delay {i} is (factor - 1) x measured", torch.tensor(d), torch.tensor(2.0 * m), rtol=1e-12, atol=0.0
            )
        # time.sleep(d) sleeps at least d, so each whole batch took at least its delay
        for i, (w, d) in enumerate(zip(slow.walls, slow.delays)):
            ck.true(f"batch {i} took at least its delay", w >= d, (w, d))
        ck.true("every delay rests on a measured compute time", all(m > 0 for m in slow.measured), slow.measured)
    else:
        ck.true("other ranks are not delayed", slow.measured == [] and slow.delays == [], slow.delays)
        ck.true("other ranks ran every batch", len(slow.walls) == 5, slow.walls)
    return ck.failures, ck.count


@pytest.mark.timeout(150)
def test_slow_rank_delays_only_its_rank_by_the_factor() -> None:
    assert_all_ranks_passed(run_distributed(_worker, 2, timeout=120, env=ENV), min_checks=2, same_count=False)


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"rank": -1, "factor": 2}, "rank"),
        ({"rank": 0, "factor": 0.5}, "factor"),
        ({"rank": 0, "factor": float("inf")}, "factor"),
        ({"rank": True, "factor": 2}, "rank"),
    ],
)
def test_bad_arguments_are_named(kw: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        SlowRank(**kw)
