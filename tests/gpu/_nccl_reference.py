"""What the NCCL tests share: a small regression model, its data, the single-process reference that
walks the same global batches as Lightning's DistributedSampler hands the ranks (perm[r::W]), and one fit on one
GPU that a resume test stops and resumes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

STEPS, BATCH, LR = 4, 8, 0.1


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(256, 16, generator=g), torch.randn(256, 1, generator=g))


def net(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def fit_on_gpu(
    strategy: Any, hidden: int, tmpdir: str, max_steps: int, callbacks: list[Any], ckpt: Path | None = None
) -> dict[str, torch.Tensor]:
    """One fit of a :class:`RegressionModule` (momentum 0.9, seed 0) on one GPU under ``strategy``, resumed from
    ``ckpt`` if given; the module's state, on the CPU."""
    torch.manual_seed(0)
    module = RegressionModule(hidden, momentum=0.9)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=tmpdir,
    )
    trainer.fit(module, DataLoader(data(), batch_size=BATCH, shuffle=True), ckpt_path=ckpt)
    assert all(p.device.type == "cuda" for p in module.parameters())
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


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
