"""What the NCCL tests share: a small regression model, its data, and the single-process reference that
walks the same global batches as Lightning's DistributedSampler hands the ranks (perm[r::W])."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

STEPS, BATCH, LR = 4, 8, 0.1


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(256, 16, generator=g), torch.randn(256, 1, generator=g))


def net(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def built_on(device: torch.device, hidden: int) -> nn.Module:
    """:func:`net` built directly on ``device`` (every default-device tensor, and every draw, there)."""
    with torch.device(device):
        return net(hidden)


class RegressionModule(pl.LightningModule):
    def __init__(self, hidden: int, momentum: float) -> None:
        super().__init__()
        self.net, self.momentum = net(hidden), momentum

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=self.momentum)


class _TrainedOn(pl.Callback):
    """The device types of the module's parameters at every training step: where it trained. (After fit,
    Lightning's ``Strategy.teardown`` moves the module to the CPU, for its own strategies as for ours.)"""

    def __init__(self) -> None:
        self.devices: set[str] = set()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: object) -> None:
        self.devices |= {p.device.type for p in module.parameters()}


def fit(module: pl.LightningModule, strategy: object, world: int, accelerator: str = "gpu") -> set[str]:
    """Train ``module`` for ``STEPS`` steps; returns the device types its parameters had during training."""
    probe = _TrainedOn()
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=world,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
    )
    trainer.fit(module, DataLoader(data(), batch_size=BATCH, shuffle=True))
    return probe.devices


def reference(
    world: int, device: torch.device, hidden: int, momentum: float, built_on_device: bool = False
) -> list[torch.Tensor]:
    """One process, the average of the per-rank mean losses (what the gradient average computes). The model is
    built on the CPU and moved, or with ``built_on_device`` built on ``device`` (its initial weights then come
    from the device's generator, as a deferred initialization's on that device do)."""
    model = built_on(device, hidden) if built_on_device else net(hidden).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    loaders = [
        iter(
            DataLoader(
                data(),
                batch_size=BATCH,
                sampler=DistributedSampler(data(), num_replicas=world, rank=r, shuffle=True, seed=seed),
            )
        )
        for r in range(world)
    ]
    for _ in range(STEPS):
        opt.zero_grad()
        loss = sum(nn.functional.mse_loss(model(x.to(device)), y.to(device)) for x, y in (next(it) for it in loaders))
        (loss / world).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]
