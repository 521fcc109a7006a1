"""A model built in ``configure_model`` under zero3 never exists whole on a rank: per-rank peak memory, deferred
against eager construction.

    python examples/zero3_deferred_init.py                  # 2 ranks, 12 x Linear(2048, 2048) (201 MB fp32), AdamW
    python examples/zero3_deferred_init.py --layers 24 --world 4

The network is built in ``LightningModule.configure_model()``: under ``ShardedStrategy(stage=3)`` that puts it on the
meta device, and the engine gives each rank storage for its shards only, initializing every layer with its own
``reset_parameters()`` from rank 0's random state (a module whose parameters are its own, not its layers', defines
``reset_parameters`` itself). The eager row builds the same network in ``__init__``, on every rank, as before.

For each, every rank reports the rise of its resident-set peak (VmHWM) above what it held before the module was
constructed, at the first training batch (setup: the build and the sharding) and after the last step (training:
AdamW's moments exist from the first step), in MiB and as a multiple of the model's fp32 weights P. The bound
stage 3 aims at is its state, 4 P / K (weights, gradients and two AdamW moments, sharded), plus a few units. Rank
0's figures are printed (the others hold the same within padding).
"""

from __future__ import annotations

import argparse
import logging
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sync import ShardedStrategy
from lightning_sync.testing import run_distributed

_MIB = 2**20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(f"{field}:")).split()[1]) * 1024


class Stack(pl.LightningModule):
    """``layers`` x Linear(dim, dim) with tanh, AdamW; built in ``configure_model`` unless ``eager``."""

    def __init__(self, dim: int, layers: int, eager: bool) -> None:
        super().__init__()
        self.dim, self.layers = dim, layers
        self.net: nn.Sequential | None = self._build() if eager else None

    def _build(self) -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*(m for _ in range(self.layers) for m in (nn.Linear(self.dim, self.dim), nn.Tanh())))

    def configure_model(self) -> None:
        if self.net is None:
            self.net = self._build()  # on the meta device under zero3; nothing is drawn or allocated here

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(64, self.dim)), batch_size=4)


class Peaks(pl.Callback):
    """VmHWM at the first training batch (setup done) and after the last step, above ``base``."""

    def __init__(self, base: int) -> None:
        self.base, self.setup, self.train = base, 0, 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 0:
            self.setup = _status("VmHWM") - self.base

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.train = _status("VmHWM") - self.base


def _measure(rank: int, world: int, dim: int, layers: int, eager: bool, steps: int) -> dict[str, int]:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the resident-set peak starts again from here
    peaks = Peaks(_status("VmRSS"))
    module = Stack(dim, layers, eager)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ShardedStrategy(stage=3, wrap_policy=["torch.nn.Linear"]),
        max_steps=steps,
        callbacks=[peaks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    return {"setup": peaks.setup, "train": peaks.train}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    model = args.layers * (args.dim * args.dim + args.dim) * 4
    print(f"{args.layers} x Linear({args.dim}, {args.dim}): P = {model / _MIB:.0f} MiB fp32; K = {args.world}\n")
    print("| construction | setup peak MiB | x P | training peak MiB | x P |")
    print("| --- | --- | --- | --- | --- |")
    for name, eager in (("eager (`__init__`)", True), ("deferred (`configure_model`)", False)):
        out = run_distributed(_measure, args.world, args.dim, args.layers, eager, args.steps, timeout=600)[0]
        print(
            f"| {name} | {out['setup'] / _MIB:.0f} | {out['setup'] / model:.2f} | "
            f"{out['train'] / _MIB:.0f} | {out['train'] / model:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
