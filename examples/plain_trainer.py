"""Put a strategy on your own LightningModule: no Hydra, just ``Trainer(strategy=...)``.

    python examples/plain_trainer.py                      # 2 CPU processes, "bucketed_ddp"
    python examples/plain_trainer.py --strategy ddp --devices 2 --max-steps 100   # Lightning's own DDP

Any name registered with Lightning's StrategyRegistry works for ``--strategy``; importing
``lightning_sync`` registers the package's own strategies. The model below is deliberately yours,
not one of ``lightning_sync.models``: a small regression net on the bundled diabetes dataset.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from sklearn.datasets import load_diabetes
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sync  # noqa: F401 - registers lightning_sync's strategy names


class MyRegressor(pl.LightningModule):
    """Any LightningModule works; nothing here knows about lightning_sync."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_mse", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def diabetes_loader(batch_size: int) -> DataLoader:
    x, y = load_diabetes(return_X_y=True)  # ships with scikit-learn, no download
    x = torch.tensor(x, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0)
    y = (y - y.mean()) / y.std()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="bucketed_ddp", help="a registered strategy name")
    parser.add_argument("--devices", type=int, default=2, help="processes on this machine")
    parser.add_argument("--max-steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    args = parser.parse_args()

    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
    )
    model = MyRegressor()
    trainer.fit(model, diabetes_loader(args.batch_size))
    if trainer.is_global_zero and trainer.global_step:  # a *_spawn strategy trains in child processes
        print(
            f"final train_mse={float(trainer.callback_metrics['train_mse']):.4f} "
            f"after {trainer.global_step} steps on {trainer.world_size} ranks ({args.strategy})"
        )


if __name__ == "__main__":
    main()
