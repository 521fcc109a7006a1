"""``fingerprint`` and ``first_difference`` in one process (the 2-rank failure at setup:
``tests/multiprocess/test_consistency_check.py``)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_sync import BucketedDDPStrategy
from lightning_sync.diagnostics.consistency import fingerprint, first_difference


def _net(width: int = 3, dtype: torch.dtype = torch.float32) -> nn.Module:
    return nn.Sequential(nn.Linear(4, width), nn.BatchNorm1d(width)).to(dtype)


def test_equal_ranks_have_no_difference_and_every_item_is_listed() -> None:
    prints = [fingerprint(_net(), BucketedDDPStrategy(), 3) for _ in range(3)]
    assert first_difference(prints) is None
    names = [item for item, _ in prints[0]]
    assert names[:2] == ["world size", "strategy"]
    assert names[2:] == [
        "parameter 0.weight",
        "parameter 0.bias",
        "parameter 1.weight",
        "parameter 1.bias",
        "buffer 1.running_mean",
        "buffer 1.running_var",
        "buffer 1.num_batches_tracked",
    ]


def test_the_first_difference_is_named_with_every_rank_s_value() -> None:
    same = fingerprint(_net(), None, 3)
    wider = fingerprint(_net(5), None, 3)
    assert first_difference([same, same, wider]) == (
        "parameter 0.weight: rank 0 has shape (3, 4), dtype torch.float32, trainable; rank 1 has shape (3, 4), "
        "dtype torch.float32, trainable; rank 2 has shape (5, 4), dtype torch.float32, trainable"
    )
    half = fingerprint(_net(dtype=torch.float16), None, 3)
    assert "dtype torch.float16" in first_difference([same, half, same])  # type: ignore[operator]
    world = fingerprint(_net(), None, 2)
    assert first_difference([same, world]) == "world size: rank 0 has 3; rank 1 has 2"


def test_a_missing_item_says_nothing_is_there() -> None:
    full = fingerprint(_net(), None)
    short = fingerprint(nn.Sequential(nn.Linear(4, 3)), None)
    assert first_difference([full, short]) == (
        "parameter 1.weight: rank 0 has shape (3,), dtype torch.float32, trainable; rank 1 has nothing"
    )
