"""GatheredCallbacks in one process: which hooks of which callbacks run inside the strategy's context, that
the wrappers come off again, and the refusal of BaseFinetuning. The context here only records that it was
entered; the gathering itself is ``test_zero_summon_unit.py``, the fits ``test_sharded_callbacks.py``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    Callback,
    EarlyStopping,
    EMAWeightAveraging,
    ModelPruning,
    StochasticWeightAveraging,
)

from lightning_sync import ShardedStrategy
from lightning_sync.strategies._gathered_callbacks import GatheredCallbacks

__all__: list[str] = []


class _Reads(Callback):
    """A user callback that reads parameters at train end (and does nothing else)."""

    def __init__(self) -> None:
        self.inside: list[bool] = []

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.inside.append(bool(entered) and entered[-1] == "open")


entered: list[str] = []


@contextmanager
def _context() -> Iterator[None]:
    entered.append("open")
    try:
        yield
    finally:
        entered.append("closed")


def test_lightnings_parameter_callbacks_are_gathered_in_the_hooks_that_touch_parameters() -> None:
    gathered = GatheredCallbacks(_context)
    ema, swa = EMAWeightAveraging(), StochasticWeightAveraging(swa_lrs=0.1)
    prune, stop = ModelPruning("l1_unstructured", amount=0.5), EarlyStopping("val_loss")
    assert "on_train_batch_end" in gathered.hooks_of(ema) and "on_validation_epoch_start" in gathered.hooks_of(ema)
    assert set(gathered.hooks_of(swa)) == {"on_train_epoch_start", "on_train_end"}
    assert "on_save_checkpoint" in gathered.hooks_of(prune) and "on_train_epoch_end" in gathered.hooks_of(prune)
    assert gathered.hooks_of(stop) == ()  # reads no parameter: left alone
    assert gathered.hooks_of(_Reads()) == ()  # not opted in


def test_an_opted_in_callback_has_every_hook_it_overrides_gathered_and_only_while_installed() -> None:
    gathered = GatheredCallbacks(_context, extra=[_Reads])
    cb = _Reads()
    assert gathered.hooks_of(cb) == ("on_train_end",)
    entered.clear()
    gathered.install([cb], "ShardedStrategy", fitting=True)
    cb.on_train_end(None, None)
    assert cb.inside == [True] and entered == ["open", "closed"]
    gathered.remove()
    assert "on_train_end" not in vars(cb)  # the class's own hook again
    cb.on_train_end(None, None)
    assert cb.inside == [True, False] and entered == ["open", "closed"]


def test_installing_again_does_not_wrap_twice_and_keeps_a_users_own_attribute() -> None:
    gathered = GatheredCallbacks(_context, extra=[_Reads])
    cb = _Reads()
    own = cb.on_train_end
    cb.on_train_end = own  # an instance attribute the user set
    gathered.install([cb], "ShardedStrategy", fitting=True)
    gathered.install([cb], "ShardedStrategy", fitting=True)
    entered.clear()
    cb.on_train_end(None, None)
    assert entered == ["open", "closed"]  # one context, not two
    gathered.remove()
    assert vars(cb)["on_train_end"] is own


def test_base_finetuning_is_refused_naming_the_callback_and_the_alternative() -> None:
    gathered = GatheredCallbacks(_context)
    with pytest.raises(ValueError, match=r"ShardedStrategy cannot run the callback BackboneFinetuning") as info:
        gathered.install([BackboneFinetuning(unfreeze_backbone_at_epoch=1)], "ShardedStrategy", fitting=True)
    assert "in a fit of its own" in str(info.value)
    assert "strategy='ddp'" in str(info.value)
    gathered.install([BackboneFinetuning(unfreeze_backbone_at_epoch=1)], "ShardedStrategy", fitting=False)


def test_the_strategy_takes_callback_classes_and_their_paths() -> None:
    for value in ([_Reads], [f"{__name__}._Reads"], None, []):
        strategy = ShardedStrategy(gathered_callbacks=value)
        assert strategy._callbacks.hooks_of(_Reads()) == (("on_train_end",) if value else ())
