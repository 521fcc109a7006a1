"""BucketedDDPStrategy with PowerSGD resumed on CUDA (skipped where CUDA is absent).

A checkpoint carries each rank's PowerSGD state (the warm-start Q and the error feedback) as CPU tensors.
Resumed on a GPU they must meet the CUDA gradients on the GPU (they used to stay on the CPU, and the first
compressed step mixed devices). A run stopped by a step-interval ``ModelCheckpoint`` inside an epoch and
resumed with ``ckpt_path`` must end with the uninterrupted run's weights; a resume from the same checkpoint
without its compressor state shows that the state is what makes the difference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _nccl_reference import fit_on_gpu
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sync import BucketedDDPStrategy
from lightning_sync.resume import RANK_STATES
from lightning_sync.testing import run_distributed

pytestmark = pytest.mark.gpu
HIDDEN = 32  # fc1's 32 x 16 weight is compressed at rank 2 (512 values >= 2 * 2 * 48)
STEPS, CKPT_STEP = 8, 4  # 256 samples in batches of 8: one epoch is 32 steps, so the stop is inside it


class _CompressorDevices(pl.Callback):
    """The devices of the compressor's Q and error tensors at the end of training."""

    def __init__(self) -> None:
        self.devices: set[str] = set()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        psgd = trainer.strategy._compressor  # type: ignore[attr-defined]
        self.devices = {str(t.device) for store in (psgd._q, psgd._error) for t in store.values()}


def _fit(tmpdir: str, max_steps: int, callbacks: list[Any], ckpt: Path | None = None) -> dict[str, torch.Tensor]:
    strategy = BucketedDDPStrategy(
        compression="powersgd", powersgd_warmup_steps=1, bucket_cap_mb=0.001, first_bucket_mb=0.001
    )
    return fit_on_gpu(strategy, HIDDEN, tmpdir, max_steps, callbacks, ckpt)


def _stop_and_resume(rank: int, world: int, tmpdir: str) -> dict[str, Any]:
    whole = _fit(tmpdir, STEPS, [])
    dirpath = Path(tmpdir) / "checkpoints"
    _fit(tmpdir, CKPT_STEP, [ModelCheckpoint(dirpath=dirpath, every_n_train_steps=CKPT_STEP, save_top_k=-1)])
    ckpt = dirpath / f"epoch=0-step={CKPT_STEP}.ckpt"
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    saved = checkpoint[RANK_STATES][0]["bucketer"]["compressor"]
    probe = _CompressorDevices()
    resumed = _fit(tmpdir, STEPS, [probe], ckpt=ckpt)
    for entry in checkpoint[RANK_STATES]:  # the guard: the same checkpoint without the compressor state
        entry["bucketer"].pop("compressor")
    stripped = Path(tmpdir) / "without-compressor.ckpt"
    torch.save(checkpoint, stripped)
    fresh = _fit(tmpdir, STEPS, [], ckpt=stripped)
    return {
        "whole": whole,
        "resumed": resumed,
        "fresh": fresh,
        "devices": probe.devices,
        "saved": {key: sorted(saved[key]) for key in ("q", "error")},
    }


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.timeout(300)
def test_powersgd_state_resumes_on_the_gpu_and_the_run_continues_exactly(tmp_path: Path) -> None:
    out = run_distributed(_stop_and_resume, 1, str(tmp_path), backend="nccl", timeout=240)[0]
    assert out["saved"]["q"] and out["saved"]["error"], out["saved"]  # compression ran before the stop
    assert out["devices"] == {"cuda:0"}, out["devices"]  # moved to the gradients' device on resume
    # the guard: a resume without the Q and error of the checkpoint moves the weights far beyond the
    # tolerance below (a rank-2 approximation of a 32 x 16 gradient leaves most of it in the error feedback)
    assert _max_diff(out["fresh"], out["whole"]) > 1e-4, _max_diff(out["fresh"], out["whole"])
    # same batches, same Q, error and ops in the same order on one GPU: equal up to cuBLAS's choice of
    # kernel between runs (a few ulps of fp32)
    assert _max_diff(out["resumed"], out["whole"]) <= 1e-6, _max_diff(out["resumed"], out["whole"])
