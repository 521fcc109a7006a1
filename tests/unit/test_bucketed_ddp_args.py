"""BucketedDDPStrategy argument checks and registration (one process; nothing is launched)."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest

import lightning_sync  # noqa: F401 - importing the package registers the strategy names
from lightning_sync import BucketedDDPStrategy

__all__: list[str] = []


@pytest.mark.parametrize("arg", ["bucket_cap_mb", "first_bucket_mb"])
@pytest.mark.parametrize("value", [0, 0.0, -1, -0.5, math.inf, math.nan, "25", True, None])
def test_bucket_sizes_must_be_finite_positive_numbers(arg: str, value: Any) -> None:
    with pytest.raises(ValueError) as info:
        BucketedDDPStrategy(**{arg: value})
    assert arg in str(info.value) and repr(value) in str(info.value)


@pytest.mark.parametrize("value", ["gzip", "FP16", "power_sgd", "", 16])
def test_unknown_compression_names_the_value_and_the_allowed_ones(value: Any) -> None:
    with pytest.raises(ValueError) as info:
        BucketedDDPStrategy(compression=value)
    msg = str(info.value)
    assert repr(value) in msg
    for allowed in ("fp16", "bf16", "powersgd"):
        assert repr(allowed) in msg


@pytest.mark.parametrize("compression", ["powersgd", None])  # checked even where PowerSGD is not used
@pytest.mark.parametrize("rank", [0, -1, 1.5, "2", True])
def test_powersgd_rank_below_one_or_not_an_int(rank: Any, compression: str | None) -> None:
    with pytest.raises(ValueError) as info:
        BucketedDDPStrategy(compression=compression, powersgd_rank=rank)
    assert "rank" in str(info.value) and repr(rank) in str(info.value)


def test_powersgd_warmup_must_be_a_non_negative_int() -> None:
    with pytest.raises(ValueError, match=r"powersgd_warmup_steps.*-1"):
        BucketedDDPStrategy(compression="powersgd", powersgd_warmup_steps=-1)


def test_unknown_keyword_arguments_are_named() -> None:
    with pytest.raises(ValueError) as info:
        BucketedDDPStrategy(bucket_cap=5, find_unused_params=True)  # typos of real arguments
    assert "'bucket_cap'" in str(info.value) and "'find_unused_params'" in str(info.value)


@pytest.mark.parametrize(
    ("kw", "shown"),
    [
        ({"process_group_backend": "mpi"}, "'mpi'"),
        ({"start_method": "thread"}, "'thread'"),
        ({"timeout": 0}, "0"),
        ({"timeout": -5.0}, "-5.0"),
    ],
)
def test_other_arguments_name_the_bad_value(kw: dict[str, Any], shown: str) -> None:
    with pytest.raises(ValueError) as info:
        BucketedDDPStrategy(**kw)
    assert shown in str(info.value)


def test_valid_arguments_are_kept() -> None:
    s = BucketedDDPStrategy(
        bucket_cap_mb=5,
        first_bucket_mb=0.5,
        gradient_as_bucket_view=False,
        find_unused_parameters=True,
        compression="powersgd",
        powersgd_rank=1,
    )
    assert (s.bucket_cap_mb, s.first_bucket_mb, s.gradient_as_bucket_view, s.find_unused_parameters, s.compression) == (
        5,
        0.5,
        False,
        True,
        "powersgd",
    )
    assert s.is_distributed is True  # so Lightning adds the DistributedSampler and turns sync_dist on


@pytest.mark.parametrize(("name", "start_method"), [("bucketed_ddp", "popen"), ("bucketed_ddp_spawn", "spawn")])
def test_trainer_resolves_the_registered_names(name: str, start_method: str) -> None:
    trainer = pl.Trainer(
        strategy=name,
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    assert type(trainer.strategy) is BucketedDDPStrategy
    assert trainer.strategy._start_method == start_method
    assert trainer.strategy.num_processes == 2
