"""HogwildStrategy's resume statement, checked where a Hogwild run is deterministic: 2 processes that never
write the same element.

Process r's loss touches only its own rows of a sparse embedding, weighted by its sample, so its SGD (with
momentum: each process's optimizer state is its own, on its own rows) writes only those rows, whatever the
interleaving. With integer initial values, integer weights and lr = momentum = 0.5 every value is a short
dyadic fraction, exact in float32, so the uninterrupted run equals a single-process reference with
tolerance 0. A step-interval ``ModelCheckpoint`` stops the run; a fresh Trainer resumes it with
``ckpt_path``. The resumed run must start from the saved shared model with each process's own momentum,
train each process on the samples its uninterrupted run took next, draw the same random numbers, and end
with bitwise the uninterrupted run's model.

The harness runs one driver rank without a process group; the strategy forks the Hogwild processes.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_sync import HogwildStrategy
from lightning_sync.testing import run_distributed

NPROC, ROWS, DIM, LR, MOMENTUM = 2, 3, 4, 0.5, 0.5
N, STEPS, CKPT_STEP = 32, 8, 3
SEED = 7  # PL_GLOBAL_SEED: Lightning's DistributedSampler shuffles with it
_QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0}


def _initial() -> torch.Tensor:
    return torch.arange(NPROC * ROWS * DIM, dtype=torch.float32).view(NPROC * ROWS, DIM)


def _weight(sample: int) -> float:
    """The loss weight of a sample: 1 to 4, so the gradient (and the model) depends on the data order."""
    return float(sample % 4 + 1)


class _OwnRows(pl.LightningModule):
    """Process r's loss is ``w(sample) * sum(rows [r*ROWS, (r+1)*ROWS))``. Each process writes a report:
    the samples it trained on, its RNG draws, its momentum when training starts and ends, the model then."""

    def __init__(self, tmpdir: str, tag: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(NPROC * ROWS, DIM, sparse=True)
        with torch.no_grad():
            self.emb.weight.copy_(_initial())
        self.tmpdir, self.tag = tmpdir, tag
        self.seen: list[int] = []
        self.draws: list[tuple[float, float, float]] = []
        self.momentum_at_start: list[float] | None = None
        self.model_at_start: list[float] | None = None

    def _momentum(self) -> list[float] | None:
        state = self.trainer.optimizers[0].state.get(self.emb.weight, {})
        buf = state.get("momentum_buffer")
        return None if buf is None else buf.to_dense().reshape(-1).tolist()

    def on_train_start(self) -> None:
        self.momentum_at_start = self._momentum()
        self.model_at_start = self.emb.weight.detach().reshape(-1).tolist()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (sample,) = batch
        self.seen.append(int(sample))
        self.draws.append((random.random(), float(np.random.random()), float(torch.rand(()))))
        rows = torch.arange(ROWS) + self.global_rank * ROWS
        return _weight(int(sample)) * self.emb(rows).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.arange(N)), batch_size=1, shuffle=True)

    def on_train_end(self) -> None:
        self.trainer.strategy.barrier()  # every process's last update has landed in the shared model
        report = {
            "seen": self.seen,
            "draws": self.draws,
            "momentum_at_start": self.momentum_at_start,
            "model_at_start": self.model_at_start,
            "momentum_at_end": self._momentum(),
            "model_at_end": self.emb.weight.detach().reshape(-1).tolist(),
        }
        with open(os.path.join(self.tmpdir, f"{self.tag}-rank{self.global_rank}.json"), "w") as f:
            json.dump(report, f)


def _fit(tmpdir: str, tag: str, max_steps: int, callbacks: list[Any], ckpt: Path | None = None) -> list[dict]:
    # every fit starts from the same RNG states (the processes inherit them); a resume replaces them
    random.seed(100)
    np.random.seed(200)
    torch.manual_seed(300)
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=HogwildStrategy(num_processes=NPROC),
        max_steps=max_steps,
        callbacks=callbacks,
        default_root_dir=tmpdir,
        enable_checkpointing=bool(callbacks),
        **_QUIET,
    )
    trainer.fit(_OwnRows(tmpdir, tag), ckpt_path=ckpt)
    reports = []
    for r in range(NPROC):
        with open(os.path.join(tmpdir, f"{tag}-rank{r}.json")) as f:
            reports.append(json.load(f))
    return reports


def _driver(rank: int, world: int, tmpdir: str, phase: str) -> list[dict]:
    """One fit per driver: the Hogwild processes of a fit rendezvous through the harness's store, which a
    second process group in the same driver would find holding the first one's addresses."""
    ckpt = Path(tmpdir) / "checkpoints" / f"epoch=0-step={CKPT_STEP}.ckpt"
    if phase == "whole":
        return _fit(tmpdir, phase, STEPS, [])
    if phase == "first":
        return _fit(
            tmpdir,
            phase,
            CKPT_STEP,
            [ModelCheckpoint(dirpath=ckpt.parent, every_n_train_steps=CKPT_STEP, save_top_k=-1)],
        )
    return _fit(tmpdir, phase, STEPS, [], ckpt=ckpt)


def _reference() -> list[float]:
    """Each process's rows, stepped by SGD with momentum on its samples (Lightning's DistributedSampler)."""
    weight = nn.Parameter(_initial().clone())
    orders = [
        list(
            DistributedSampler(
                range(N),
                num_replicas=NPROC,
                rank=r,
                shuffle=True,  # type: ignore[arg-type]
                seed=SEED,
            )
        )
        for r in range(NPROC)
    ]
    momentum = torch.zeros_like(weight)
    with torch.no_grad():
        for step in range(STEPS):
            for r, order in enumerate(orders):
                rows = slice(r * ROWS, (r + 1) * ROWS)
                grad = torch.full((ROWS, DIM), _weight(order[step]))
                momentum[rows] = grad if step == 0 else MOMENTUM * momentum[rows] + grad
                weight[rows] -= LR * momentum[rows]
    return weight.detach().reshape(-1).tolist()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hogwild_resume_continues_each_process_exactly_when_updates_never_collide(tmp_path: Path) -> None:
    whole, first, resumed = (
        run_distributed(
            _driver, 1, str(tmp_path), phase, timeout=80, process_group=False, env={"PL_GLOBAL_SEED": str(SEED)}
        )[0]
        for phase in ("whole", "first", "resumed")
    )
    saved = (
        torch.load(tmp_path / "checkpoints" / f"epoch=0-step={CKPT_STEP}.ckpt", map_location="cpu", weights_only=True)[
            "state_dict"
        ]["emb.weight"]
        .reshape(-1)
        .tolist()
    )
    # tolerance 0 throughout: disjoint rows, dyadic values exact in fp32, the same ops in each process
    assert whole[0]["model_at_end"] == whole[1]["model_at_end"], "the processes share one model"
    assert whole[0]["model_at_end"] == _reference(), "the uninterrupted run is the single-process reference"
    assert saved == first[0]["model_at_end"], "the checkpoint holds the shared model at the stop"
    for r in range(NPROC):  # where the resume starts, in each process
        assert resumed[r]["model_at_start"] == saved, f"process {r} resumes from the saved model"
        assert first[r]["momentum_at_end"] is not None
        assert resumed[r]["momentum_at_start"] == first[r]["momentum_at_end"], (
            f"process {r} resumes with its own momentum, not another process's"
        )
    for r in range(NPROC):  # what it trains on and draws
        assert len(first[r]["seen"]) == CKPT_STEP
        assert first[r]["seen"] + resumed[r]["seen"] == whole[r]["seen"], f"process {r}'s samples"
        assert resumed[r]["draws"] == whole[r]["draws"][CKPT_STEP:], f"process {r}'s RNG draws continue"
    assert resumed[0]["model_at_end"] == whole[0]["model_at_end"], "resumed == uninterrupted, bit for bit"
