"""``DeferredCharGPT`` (layers in ``configure_model``, metrics in ``__init__``) built deferred and trained on 2 gloo
ranks, under ZeRO-3 and under the FSDP2 baseline, each against one process training the same initial weights on
the same global batches."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _lightning_reference import ENV, EQ_TOL, _check_against, _quiet_rank, _rank_batches, _state, _trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_sync import ShardedStrategy
from lightning_sync.bench.fsdp2 import FullyShardStrategy
from lightning_sync.models.char_gpt import DeferredCharGPT, _Block, encode, load_corpus
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

__all__: list[str] = []

STEPS, BLOCK, BATCH = 3, 8, 4
# SGD (momentum 0.9), not AdamW: a float32 rounding difference of a gradient value whose two ranks' halves
# cancel stays that small under SGD, where AdamW's normalised first step can turn it into a whole lr
TINY = {"block_size": BLOCK, "n_layer": 2, "n_head": 2, "n_embd": 16, "lr": 0.1, "optimizer": "sgd"}


def _windows() -> TensorDataset:
    tokens = encode(load_corpus(64 * (BLOCK + 1)))
    chunks = tokens.view(64, BLOCK + 1)
    return TensorDataset(chunks[:, :-1].contiguous(), chunks[:, 1:].contiguous())


class _Probed(DeferredCharGPT):
    """Records whether ``configure_model`` built the layers on the meta device (the strategies call the class's
    hook: the FSDP2 baseline installs its own on the instance and runs this one inside it)."""

    built_on_meta: bool | None = None

    def configure_model(self) -> None:
        fresh = not hasattr(self, "blocks")
        super().configure_model()
        if fresh:
            self.built_on_meta = all(p.is_meta for p in self.parameters())


class _Start(pl.Callback):
    """At the first batch: whether the layers were built on the meta device, and the full initial weights."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}
        self.zero_peak: int | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.tensor import DTensor

        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            self.zero_peak = engine.init_peak_bytes  # set only where the engine materialized meta tensors
            self.state = trainer.strategy.full_state_dict()  # type: ignore[attr-defined]
        else:
            self.state = {
                k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                for k, v in pl_module.state_dict().items()
            }


def _fit(ck: Checks, name: str, strategy: Any, rank: int, world: int) -> None:
    from torch.distributed.tensor import DTensor

    pl.seed_everything(0, verbose=False)
    ds, model, start = _windows(), _Probed(**TINY), _Start()
    ck.true(f"[{name}] no layers before fit", not hasattr(model, "blocks"))
    trainer = _trainer(world, strategy, max_steps=STEPS, limit_val_batches=0, callbacks=[start])
    trainer.fit(model, train_dataloaders=DataLoader(ds, batch_size=BATCH, shuffle=True))
    ck.true(f"[{name}] configure_model built on the meta device", model.built_on_meta is True, model.built_on_meta)
    if isinstance(strategy, ShardedStrategy):
        ck.true(f"[{name}] the engine materialized it", (start.zero_peak or 0) > 0, start.zero_peak)
        final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        local = model.blocks[0].qkv.weight
        ck.true(f"[{name}] sharded: half the rows here", local.to_local().shape[0] == 3 * 16 // 2, local.shape)
        final = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}
        # Lightning's to_empty would have emptied the metrics' states and the defaults reset() restores
        ck.true(f"[{name}] metric defaults kept", float(model.val_loss._defaults["weight"]) == 0.0)
    if rank == 0:
        ref_model = DeferredCharGPT(**TINY)
        ref_model.configure_model()
        ref_model.load_state_dict(start.state)
        ref = _reference(ref_model, ds, world)
        # the same tolerance as every Lightning-level check (EQ_TOL: float32 order of the gradient average)
        ref_model.load_state_dict(final)
        _check_against(ck, f"[{name}]", ref_model, ref, start.state, EQ_TOL)


def _reference(model: DeferredCharGPT, ds: TensorDataset, world: int) -> dict[str, torch.Tensor]:
    """``STEPS`` steps in this one process on the global batches Lightning hands the ``world`` ranks (the first
    epoch's), each rank's mean loss averaged, as the strategies average the gradients."""
    optimizer = model.configure_optimizers()
    x, y = ds.tensors
    batches = _rank_batches(len(ds), world, 0, BATCH)
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        for r in range(world):
            idx = batches[r][step]
            (model.training_step((x[idx], y[idx]), step) / world).backward()
        optimizer.step()
    return _state(model)


def _worker(rank: int, world: int) -> dict[str, Any]:
    _quiet_rank()
    ck = Checks()
    _fit(ck, "zero3", ShardedStrategy(stage=3, wrap_policy=[_Block]), rank, world)
    _fit(ck, "fsdp2", FullyShardStrategy(shard_classes=[_Block]), rank, world)
    return ck.result()


@pytest.mark.timeout(240)
def test_deferred_char_gpt_builds_on_meta_and_trains_like_one_process() -> None:
    results = run_distributed(_worker, 2, timeout=200, env=ENV)
    assert_all_ranks_passed(results, min_checks=6, same_count=False)
