"""What Lightning's own tests expect of a DDP strategy, written as a Lightning user would, on 2 gloo ranks.

* **Samplers are ``DistributedSampler``\\ s.** User code and libraries test
  ``isinstance(loader.batch_sampler.sampler, DistributedSampler)`` before calling ``set_epoch`` or reading
  ``num_replicas``, ``rank``, ``epoch``, ``shuffle``, ``seed``, ``drop_last``, ``num_samples`` and
  ``total_size``. A lightning_sync strategy replaces Lightning's samplers (with the resumable global order for
  training, and unrepeated shards for evaluation): the replacements must pass that check with the attributes
  Lightning's own samplers have, and yield what they yield. The reference is built in this process: torch's
  ``DistributedSampler`` for training, Lightning's ``UnrepeatedDistributedSampler`` for evaluation (sample
  indices, so equality is exact). Adapted from Lightning's ``test_replace_distributed_sampler`` (a custom
  batch sampler, or none, in ``trainer.test``), plus the training and validation loaders of a fit.
* **A checkpoint calls ``torch.save`` once, on the rank that writes.** Adapted from Lightning's
  ``test_model_checkpoint_no_extraneous_invocations``: ``torch.save`` is wrapped in a counting mock from
  ``on_train_start`` to ``on_train_end``; rank 0 calls it once per checkpoint, the other rank never. The
  per-rank states a checkpoint carries (every rank's RNG states) must still be stored exactly: the states
  each rank had when the checkpoint was written are compared, bit for bit, with what the files hold.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from _lightning_reference import _QUIET, ENV, SEED, _quiet_rank
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.nn import functional as F
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler, TensorDataset

from lightning_sync import BucketedDDPStrategy, ShardedStrategy
from lightning_sync.resume import RANK_STATES, host_rng_state
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

WORLD, BATCH, EPOCHS = 2, 4, 4
N_TRAIN = 31  # not a multiple of the world size: Lightning's training sampler pads to 32
N_VAL = 32  # shards of 16: the same number of batches on both ranks, so the unrepeated sampler is used
N_TEST = 64  # as in Lightning's test: RandomDataset(32, 64)
STRATEGIES = {
    "bucketed_ddp": lambda: BucketedDDPStrategy(),
    "zero2": lambda: ShardedStrategy(stage=2),
}


def _indexed(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.arange(n))


class _CustomDataLoader(DataLoader):
    """Lightning's test loader: an ``__init__`` argument it does not keep (Lightning captures it to re-create
    the loader with its sampler)."""

    def __init__(self, num_features: int, dataset: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)


class _CustomBatchSampler(BatchSampler):
    pass


def _sampler_attributes(sampler: Any) -> dict[str, Any]:
    names = ("num_replicas", "rank", "epoch", "shuffle", "seed", "drop_last", "num_samples", "total_size")
    return {name: getattr(sampler, name, "<missing>") for name in names}


class _Module(pl.LightningModule):
    """A linear model whose batches carry their sample indices; it checks every loader's sampler as a user
    would, and records the indices each step received."""

    def __init__(self, ck: Checks) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.ck = ck
        self.seen: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ data
    def train_dataloader(self) -> DataLoader:
        return DataLoader(_indexed(N_TRAIN, 1), batch_size=BATCH, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_indexed(N_VAL, 2), batch_size=BATCH)

    def test_dataloader(self) -> list[DataLoader]:
        # Lightning's two modes: a custom batch sampler (batch size 1 on it), or none (batch size 2)
        dataset = _indexed(N_TEST, 3)
        custom = _CustomBatchSampler(SequentialSampler(dataset), batch_size=1, drop_last=True)
        return [
            _CustomDataLoader(32, dataset, batch_sampler=custom),
            _CustomDataLoader(32, dataset, batch_size=2, drop_last=True),
        ]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    # ------------------------------------------------------------------ steps
    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        x, idx = batch
        self.seen.setdefault(stage, []).extend(idx.tolist())
        return F.mse_loss(self.layer(x).squeeze(1), x.sum(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._loss(batch, f"train{self.current_epoch}")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch, f"val{self.current_epoch}"), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._loss(batch, f"test{dataloader_idx}")

    # ------------------------------------------------------------------ what a user checks
    def _check_sampler(self, tag: str, sampler: Any, reference: DistributedSampler) -> None:
        ck = self.ck
        ck.true(f"{tag}: isinstance(sampler, DistributedSampler)", isinstance(sampler, DistributedSampler), sampler)
        ck.true(
            f"{tag}: num_replicas and rank are the world's",
            (getattr(sampler, "num_replicas", None), getattr(sampler, "rank", None))
            == (self.trainer.world_size, self.trainer.global_rank),
            _sampler_attributes(sampler),
        )
        ck.true(
            f"{tag}: every attribute of a DistributedSampler equals the reference's",
            _sampler_attributes(sampler) == _sampler_attributes(reference),
            (_sampler_attributes(sampler), _sampler_attributes(reference)),
        )
        ck.true(f"{tag}: len equals the reference's", len(sampler) == len(reference), (len(sampler), len(reference)))
        ck.true(f"{tag}: the indices are the reference's", list(sampler) == list(reference))

    def on_train_epoch_start(self) -> None:
        # what Lightning gives a training loader: torch's sampler, shuffled, seeded with PL_GLOBAL_SEED
        reference = DistributedSampler(
            range(N_TRAIN), num_replicas=WORLD, rank=self.global_rank, shuffle=True, seed=SEED
        )  # type: ignore[arg-type]
        reference.set_epoch(self.current_epoch)
        sampler = self.trainer.train_dataloader.batch_sampler.sampler
        self._check_sampler(f"train epoch {self.current_epoch}", sampler, reference)

    def on_validation_epoch_start(self) -> None:
        # Lightning's own unrepeated evaluation sampler: the strided shard, no sample repeated
        reference = UnrepeatedDistributedSampler(
            range(N_VAL), num_replicas=WORLD, rank=self.global_rank, shuffle=False, seed=SEED
        )  # type: ignore[arg-type]
        reference.set_epoch(self.current_epoch)
        sampler = self.trainer.val_dataloaders.batch_sampler.sampler
        self._check_sampler(f"val epoch {self.current_epoch}", sampler, reference)

    def on_test_start(self) -> None:
        # Lightning's test_replace_distributed_sampler, both modes, as assertions in on_test_start
        for mode, loader in enumerate(self.trainer.test_dataloaders, start=1):
            tag = f"test mode {mode}"
            batch_sampler = loader.batch_sampler
            self.ck.true(f"{tag}: the loader is the user's class", isinstance(loader, _CustomDataLoader), loader)
            if mode == 1:
                self.ck.true(
                    f"{tag}: the custom batch sampler stays, the batch size is on it",
                    isinstance(batch_sampler, _CustomBatchSampler) and loader.batch_size is None,
                    (batch_sampler, loader.batch_size),
                )
            else:
                self.ck.true(
                    f"{tag}: a plain batch sampler, the batch size on the loader",
                    type(batch_sampler) is BatchSampler and loader.batch_size == 2,
                    (batch_sampler, loader.batch_size),
                )
            self.ck.true(
                f"{tag}: batch size and drop_last kept",
                batch_sampler.batch_size == mode and batch_sampler.drop_last,
                (batch_sampler.batch_size, batch_sampler.drop_last),
            )
            reference = UnrepeatedDistributedSampler(
                range(N_TEST), num_replicas=WORLD, rank=self.global_rank, shuffle=False, seed=SEED
            )  # type: ignore[arg-type]
            reference.set_epoch(self.current_epoch)  # Lightning sets every loader's epoch, after fit the last + 1
            self._check_sampler(tag, batch_sampler.sampler, reference)


class _CountingCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpointTestInvocations``: ``torch.save`` counted from the start of training to its
    end, and the callback's ``state_dict`` (built on every rank for every checkpoint) too. Also records each
    rank's RNG states when a checkpoint is built, to compare with what the file holds."""

    def __init__(self, ck: Checks, expected_count: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ck, self.expected_count = ck, expected_count
        self.state_dict_count = 0
        self.rng: list[dict[str, torch.Tensor]] = []
        self._patch: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._patch = mock.patch("torch.save", wraps=torch.save)
        self.save_mock = self._patch.start()

    def state_dict(self) -> dict[str, Any]:
        self.state_dict_count += 1
        return super().state_dict()

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        # the per-rank states are taken right after the callbacks' hooks, with no random draw in between
        self.rng.append({"torch": torch.get_rng_state(), "host": host_rng_state()})
        super().on_save_checkpoint(trainer, pl_module, checkpoint)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        calls = self.save_mock.call_count
        self._patch.stop()
        self.ck.true("a best model path and score", bool(self.best_model_path) and self.best_model_score is not None)
        self.ck.true(
            "every rank builds every checkpoint",
            self.state_dict_count == self.expected_count,
            (self.state_dict_count, self.expected_count),
        )
        expected = self.expected_count if trainer.is_global_zero else 0
        self.ck.true(
            f"torch.save is called {expected} times on rank {trainer.global_rank}",
            calls == expected,
            [str(c.args[1]) if len(c.args) > 1 else c for c in self.save_mock.call_args_list],
        )


def _worker(rank: int, world: int, tmpdir: str, strategy: str) -> tuple[list[str], int, list[Any]]:
    _quiet_rank()
    ck = Checks()
    module = _Module(ck)
    # zero2 writes one full file by default, as Lightning's ddp does (a sharded directory is every rank's, by design)
    saver = _CountingCheckpoint(ck, EPOCHS, dirpath=Path(tmpdir) / "checkpoints", monitor="val_loss", save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=STRATEGIES[strategy](),
        max_epochs=EPOCHS,
        **{**_QUIET, "enable_checkpointing": True, "callbacks": [saver]},
    )
    trainer.fit(module)
    trainer.test(module)
    # what the steps received is what the samplers yielded: batches of the reference's indices, in order
    for epoch in range(EPOCHS):
        reference = DistributedSampler(range(N_TRAIN), num_replicas=world, rank=rank, shuffle=True, seed=SEED)  # type: ignore[arg-type]
        reference.set_epoch(epoch)
        ck.true(
            f"train epoch {epoch}: trained on the reference's indices", module.seen[f"train{epoch}"] == list(reference)
        )
        ck.true(
            f"val epoch {epoch}: validated the strided shard",
            module.seen[f"val{epoch}"] == list(range(rank, N_VAL, world)),
        )
    for mode in (0, 1):
        ck.true(
            f"test loader {mode}: the strided shard", module.seen[f"test{mode}"] == list(range(rank, N_TEST, world))
        )
    return ck.result() + (saver.rng,)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_samplers_are_distributed_samplers_and_a_checkpoint_saves_once(tmp_path: Path, strategy: str) -> None:
    results = run_distributed(_worker, WORLD, str(tmp_path), strategy, timeout=240, env=ENV)
    assert_all_ranks_passed(results, min_checks=5 * (2 * EPOCHS + 2))
    # every checkpoint holds every rank's RNG states as they were when it was written, exactly
    files = sorted((tmp_path / "checkpoints").iterdir())  # epoch=0-..., epoch=1-...: in the order written
    assert len(files) == EPOCHS, files
    for i, path in enumerate(files):
        states = torch.load(path, map_location="cpu", weights_only=True)[RANK_STATES]
        assert len(states) == WORLD
        for rank, (_, _, recorded) in enumerate(results):
            for key in ("torch", "host"):
                assert torch.equal(states[rank]["rng"][key], recorded[i][key]), (path.name, rank, key)
            assert states[rank]["rng"]["cuda"] is None
