"""``ConsistencyCheck`` on 2 real gloo ranks: when rank 1's model or strategy differs, *every* rank fails at
setup with the first differing item named, within the test's timeout instead of hanging in the first
collective; when they agree, training goes on and ends at the single-process reference."""

from __future__ import annotations

from typing import Any

import pytest
from _lightning_reference import ENV, _check_against, _quiet_rank, _reference, _state, _TiedModule, _trainer

from lightning_sync import BucketedDDPStrategy
from lightning_sync.diagnostics import ConsistencyCheck
from lightning_sync.diagnostics.consistency import fingerprint
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed


def _fails(ck: Checks, name: str, rank: int, module: Any, strategy: Any, *patterns: str) -> None:
    ck.raises(
        name,
        lambda: _trainer(2, strategy, max_steps=2, callbacks=[ConsistencyCheck()]).fit(module),
        r"^ranks disagree at setup on ",
        *patterns,
        exc=RuntimeError,
    )


def _worker(rank: int, world: int) -> tuple[list[str], int]:
    _quiet_rank()
    ck = Checks()
    # 1. agreeing ranks: every item compared, then training reaches the single-process reference
    module, init = _TiedModule("sgd"), _state(_TiedModule("sgd"))
    ref = _reference(_TiedModule("sgd"), module.ds, world, steps=3)["state"]
    check, strategy = ConsistencyCheck(), BucketedDDPStrategy()
    _trainer(world, strategy, max_steps=3, callbacks=[check]).fit(module)
    expected = len(fingerprint(_TiedModule("sgd"), strategy, world))
    ck.true("all items compared", check.items == expected and expected > 10, (check.items, expected))
    _check_against(ck, "[agreeing ranks]", module, ref, init)
    # 2. an extra layer on rank 1: the first differing item is named, with what each rank has there
    _fails(
        ck,
        "extra layer",
        rank,
        _TiedModule("sgd", sometimes=rank == 1),
        BucketedDDPStrategy(),
        r"item \d+ of the model: rank 0 has parameter net\.head\.bias \(shape \(40,\), .*; "
        r"rank 1 has parameter net\.sometimes\.weight \(shape \(16, 16\), ",
    )
    # 3. a layer frozen on rank 1 only
    frozen = _TiedModule("sgd")
    frozen.net.fc1.requires_grad_(rank != 1)
    _fails(
        ck,
        "frozen on one rank",
        rank,
        frozen,
        BucketedDDPStrategy(),
        r"parameter net\.fc1\.weight: rank 0 has shape \(48, 16\), dtype torch\.float32, trainable; "
        r"rank 1 has shape \(48, 16\), dtype torch\.float32, frozen",
    )
    # 4. the same model, another strategy setting on rank 1
    _fails(
        ck,
        "strategy setting",
        rank,
        _TiedModule("sgd"),
        BucketedDDPStrategy(bucket_cap_mb=1.0 + rank),
        r"strategy: rank 0 has BucketedDDPStrategy\(.*bucket_cap_mb=1\.0.*rank 1 has BucketedDDPStrategy\(.*"
        r"bucket_cap_mb=2\.0",
    )
    return ck.result()


@pytest.mark.timeout(240)
def test_every_rank_fails_at_setup_naming_the_first_difference() -> None:
    assert_all_ranks_passed(run_distributed(_worker, 2, timeout=180, env=ENV), min_checks=10)
