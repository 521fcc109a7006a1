"""``IntervalCheckpoint`` in one process: an epoch and a step interval together, one ``last.ckpt``, no step
saved twice; bad values are named. The CLI's documented override is tests/test_cli.py's newest-checkpoint run."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sync.launch.checkpoint import IntervalCheckpoint


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        x = torch.randn(20, 2, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)  # 5 steps an epoch


def _fit(tmp_path: Path, callback: ModelCheckpoint, steps: int) -> list[str]:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(_Tiny())
    return sorted(p.name for p in Path(callback.dirpath).iterdir())


def test_epoch_and_step_intervals_together(tmp_path: Path) -> None:
    callback = IntervalCheckpoint(
        dirpath=tmp_path / "both", every_n_epochs=1, every_n_train_steps=3, save_top_k=-1, save_last=True
    )
    # steps 3, 6, 9 and the epoch ends at 5 and 10 (step 10 ends an epoch and the run: saved once)
    assert _fit(tmp_path, callback, 10) == sorted(
        [
            "epoch=0-step=3.ckpt",
            "epoch=0-step=5.ckpt",
            "epoch=1-step=6.ckpt",
            "epoch=1-step=9.ckpt",
            "epoch=1-step=10.ckpt",
            "last.ckpt",
        ]
    )
    assert torch.load(tmp_path / "both" / "last.ckpt", weights_only=True)["global_step"] == 10


def test_one_interval_is_lightnings_model_checkpoint(tmp_path: Path) -> None:
    ours = IntervalCheckpoint(dirpath=tmp_path / "ours", every_n_train_steps=4, save_top_k=-1)
    theirs = ModelCheckpoint(dirpath=tmp_path / "theirs", every_n_train_steps=4, save_top_k=-1)
    assert _fit(tmp_path, ours, 10) == _fit(tmp_path, theirs, 10) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]


@pytest.mark.parametrize("value", [-1, "2", 1.5, True])
def test_a_bad_epoch_interval_beside_a_step_interval_is_named(tmp_path: Path, value: object) -> None:
    with pytest.raises(ValueError, match=f"every_n_epochs must be an int >= 1 or None, got {value!r}"):
        IntervalCheckpoint(dirpath=tmp_path, every_n_epochs=value, every_n_train_steps=3)  # type: ignore[arg-type]
