"""Preemption stop and exact resume on one GPU (skipped where CUDA is absent): the CUDA generator's state.

Dropout on the GPU draws from the CUDA generator, not torch's CPU one. A lightning_sync strategy saves it in
every checkpoint, the preemption checkpoint of ``RequeueOnSignal`` included, and the resume restores it
(:mod:`lightning_sync.resume`), so a run stopped by SIGUSR1 and resumed ends with the uninterrupted run's
weights. Every fit seeds the CUDA generator the same way first, so a resume that left
that seed in place would draw the first steps' dropout masks again (the guard below shows that changes the
weights). The 2-rank CPU version of this test is ``tests/multiprocess/test_requeue.py``.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sync import BucketedDDPStrategy
from lightning_sync.launch.requeue import RequeueOnSignal, latest_checkpoint
from lightning_sync.resume import RANK_STATES
from lightning_sync.testing import run_distributed

pytestmark = pytest.mark.gpu
STEPS, STOP_STEP = 12, 5


class _DropoutRegression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        x = torch.randn(96, 16, generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


class _SignalAtStep(pl.Callback):
    """Raises SIGUSR1 in this process once ``global_step`` reaches ``step`` (listed before the stopper, so
    the stopper sees the flag at that same step)."""

    def __init__(self, step: int) -> None:
        self.step, self.sent = step, False

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and not self.sent:
            self.sent = True
            signal.raise_signal(signal.SIGUSR1)


def _fit(callbacks: list[pl.Callback], ckpt: Path | None = None, cuda_seed: int = 7) -> tuple[pl.Trainer, dict]:
    module = _DropoutRegression()
    torch.cuda.manual_seed(cuda_seed)  # after the module: its torch.manual_seed seeds every device's generator
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=BucketedDDPStrategy(),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, ckpt_path=ckpt)
    return trainer, {k: v.detach().cpu() for k, v in module.state_dict().items()}


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _stop_and_resume(rank: int, world: int, tmpdir: str) -> dict[str, Any]:
    """Runs in one NCCL rank of the harness (the strategy needs its process group, which must not outlive it)."""
    _, whole = _fit([])
    _, other_seed = _fit([], cuda_seed=8)
    stopper = RequeueOnSignal(Path(tmpdir) / "requeue", "USR1", requeue=False)
    trainer, _ = _fit([_SignalAtStep(STOP_STEP), stopper])
    stopped = {"preempted": stopper.preempted, "step": trainer.global_step}
    ckpt = latest_checkpoint(Path(tmpdir) / "requeue")
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)[RANK_STATES] if ckpt is not None else None
    trainer, resumed = _fit([RequeueOnSignal(Path(tmpdir) / "requeue", "USR1", requeue=False)], ckpt=ckpt)
    return {
        "whole": whole,
        "other_seed": other_seed,
        "stopped": stopped,
        "saved": saved,
        "resumed_step": trainer.global_step,
        "resumed": resumed,
    }


@pytest.mark.timeout(300)
def test_resume_restores_the_cuda_generator_so_gpu_dropout_continues(tmp_path: Path) -> None:
    out = run_distributed(_stop_and_resume, 1, str(tmp_path), backend="nccl", timeout=240)[0]
    whole, resumed = out["whole"], out["resumed"]
    # the guard: other dropout masks change the weights far beyond the tolerance below, so a resume that
    # did not restore the CUDA state (and redrew masks from the seed) would fail this test
    assert _max_diff(out["other_seed"], whole) > 1e-3
    assert out["stopped"] == {"preempted": True, "step": STOP_STEP}
    saved = out["saved"]
    assert saved is not None and len(saved) == 1 and saved[0]["rng"]["cuda"] is not None  # the CUDA generator
    assert out["resumed_step"] == STEPS
    # same batches, masks and ops in the same order on one GPU: equal up to cuBLAS's choice of kernel
    # between processes' runs (a few ulps of fp32); a different mask moves the weights by more than 1e-3
    assert _max_diff(resumed, whole) <= 1e-6, _max_diff(resumed, whole)
