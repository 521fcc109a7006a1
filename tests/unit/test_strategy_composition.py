"""The periodic strategies hold the pieces they use and take only their own arguments.

LocalSGD and DiLoCo share :class:`~lightning_sync.strategies._periodic.PeriodicStrategy`, not
``BucketedDDPStrategy``: DiLoCo never averages gradients, so it holds no gradient bucketer and refuses every
bucketer argument; LocalSGD holds one for its warm-up only, and takes only the arguments that shape the
warm-up's all-reduce. An argument a strategy would ignore raises a ``ValueError`` naming it, the strategies
that take it, and what this one accepts. Construction only: no process group, no Trainer.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_sync.strategies import (
    AsyncParameterServerStrategy,
    BucketedDDPStrategy,
    DiLoCoStrategy,
    HogwildStrategy,
    LocalSGDStrategy,
)
from lightning_sync.strategies._base import ProcessGroupStrategy, check_own_arguments, own_arguments
from lightning_sync.strategies._periodic import PeriodicStrategy

__all__: list[str] = []

CONF = Path(__file__).resolve().parents[2] / "conf" / "strategy"
LIGHTNING = ["accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"]
LAUNCH = ["process_group_backend", "timeout", "start_method", "fault_tolerant"]
DILOCO_STREAMING = ["fragments", "overlap_steps", "outer_dtype", "overlap_alpha"]
DILOCO_ACCEPTS = ["sync_every", "outer_lr", "outer_momentum", "nesterov", *DILOCO_STREAMING, *LAUNCH, *LIGHTNING]
WARMUP_BUCKETS = ["bucket_cap_mb", "first_bucket_mb", "gradient_as_bucket_view", "find_unused_parameters"]
LOCAL_SGD_ACCEPTS = ["sync_every", "warmup_steps", "average_optimizer_state", *WARMUP_BUCKETS, *LAUNCH, *LIGHTNING]
# bucketed_ddp's arguments LocalSGD refuses: its warm-up is exact synchronous SGD with the backend's all-reduce,
# and buffers are averaged at every sync instead of broadcast at every step; rebalancing splits the global batch of
# a synchronous step, which a period of local steps does not have
LOCAL_SGD_REFUSES = {
    "compression",
    "powersgd_rank",
    "powersgd_warmup_steps",
    "comm_algorithm",
    "broadcast_buffers",
    "rebalance",
    "rebalance_every",
    "rebalance_deadline",
}


def _bucketed_default(arg: str) -> Any:
    return inspect.signature(BucketedDDPStrategy.__init__).parameters[arg].default


def test_the_periodic_strategies_share_a_base_not_bucketed_ddp() -> None:
    for cls in (LocalSGDStrategy, DiLoCoStrategy):
        assert issubclass(cls, PeriodicStrategy) and not issubclass(cls, BucketedDDPStrategy), cls.__mro__
    assert not issubclass(DiLoCoStrategy, LocalSGDStrategy)
    assert issubclass(HogwildStrategy, ProcessGroupStrategy) and not issubclass(HogwildStrategy, PeriodicStrategy)
    assert not issubclass(AsyncParameterServerStrategy, ProcessGroupStrategy)  # no process group at all


def test_diloco_holds_no_bucketer_and_local_sgd_none_before_its_warm_up_is_set_up() -> None:
    assert not hasattr(DiLoCoStrategy(), "bucketer")
    assert LocalSGDStrategy(warmup_steps=3).bucketer is None  # built at setup, only with a warm-up


def test_each_strategy_lists_exactly_what_it_accepts() -> None:
    assert own_arguments(DiLoCoStrategy) + LIGHTNING == DILOCO_ACCEPTS
    assert own_arguments(LocalSGDStrategy) + LIGHTNING == LOCAL_SGD_ACCEPTS
    assert set(own_arguments(BucketedDDPStrategy)) - set(own_arguments(LocalSGDStrategy)) == LOCAL_SGD_REFUSES


@pytest.mark.parametrize("arg", [a for a in own_arguments(BucketedDDPStrategy) if a not in DILOCO_ACCEPTS])
def test_diloco_refuses_every_bucketed_ddp_argument_even_at_its_default(arg: str) -> None:
    with pytest.raises(ValueError) as error:
        DiLoCoStrategy(**{arg: _bucketed_default(arg)})
    message = str(error.value)
    assert message.startswith(f"DiLoCoStrategy does not take ['{arg}'] ("), message
    assert "BucketedDDPStrategy" in message, message  # who takes it
    assert message.endswith(f"; it accepts {DILOCO_ACCEPTS}"), message


@pytest.mark.parametrize("arg", sorted(LOCAL_SGD_REFUSES))
def test_local_sgd_refuses_the_bucketed_ddp_arguments_its_warm_up_does_not_use(arg: str) -> None:
    with pytest.raises(ValueError) as error:
        LocalSGDStrategy(warmup_steps=2, **{arg: _bucketed_default(arg)})
    message = str(error.value)
    # who takes it: bucketed_ddp alone, or with ZeRO (rebalancing)
    both = arg in ("rebalance", "rebalance_every")
    takers = "BucketedDDPStrategy and ShardedStrategy take" if both else "BucketedDDPStrategy takes"
    assert message.startswith(f"LocalSGDStrategy does not take ['{arg}'] ({takers} '{arg}')"), message
    assert message.endswith(f"; it accepts {LOCAL_SGD_ACCEPTS}"), message


def test_local_sgd_keeps_the_bucket_layout_of_its_warm_up() -> None:
    strategy = LocalSGDStrategy(
        warmup_steps=2,
        bucket_cap_mb=0.5,
        first_bucket_mb=0.25,
        gradient_as_bucket_view=False,
        find_unused_parameters=True,
    )
    assert (strategy.bucket_cap_mb, strategy.first_bucket_mb) == (0.5, 0.25)
    assert (strategy.gradient_as_bucket_view, strategy.find_unused_parameters) == (False, True)


def test_several_refused_arguments_are_named_together_with_who_takes_each() -> None:
    with pytest.raises(ValueError) as error:
        check_own_arguments(DiLoCoStrategy, {"bogus": 1, "warmup_steps": 2, "bucket_cap_mb": 1.0, "accelerator": "cpu"})
    message = str(error.value)
    assert message.startswith("DiLoCoStrategy does not take ['bogus', 'bucket_cap_mb', 'warmup_steps'] ("), message
    assert "no lightning_sync strategy takes 'bogus'" in message, message
    assert "BucketedDDPStrategy, LocalSGDStrategy and ShardedStrategy take 'bucket_cap_mb'" in message, message
    assert "LocalSGDStrategy takes 'warmup_steps'" in message, message
    check_own_arguments(DiLoCoStrategy, {"accelerator": "cpu"})  # Lightning's components pass


@pytest.mark.parametrize(
    ("stem", "extra"),
    [("diloco", {"compression": "fp16"}), ("diloco", {"bucket_cap_mb": 25}), ("local_sgd", {"compression": "fp16"})],
)
def test_a_config_key_the_strategy_does_not_take_fails_to_build(stem: str, extra: dict[str, Any]) -> None:
    cfg = OmegaConf.load(CONF / f"{stem}.yaml")
    instantiate(cfg)  # the shipped config builds
    with pytest.raises(Exception, match=rf"does not take \['{next(iter(extra))}'\]"):
        instantiate(OmegaConf.merge(cfg, extra))
