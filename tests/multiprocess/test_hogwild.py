"""HogwildStrategy: 2 processes started by the strategy's own launcher (fork), sharing one model.

The harness runs one *driver* rank without a process group; the driver calls ``trainer.fit`` and the
strategy forks the two Hogwild processes, as it would from a user's script.

Exact checks: each process owns disjoint rows of a sparse embedding and its loss touches only those,
so its SGD update writes only its rows (no two processes ever write the same element). With integer
initial values and lr 0.5, every update is exact in float32, so "every process sees every other
process's updates" and "a checkpoint is one consistent model" are exact equalities against a
single-process reference, with tolerance 0.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sync import HogwildStrategy
from lightning_sync.testing import run_distributed

NPROC, ROWS, DIM, LR, STEPS = 2, 3, 4, 0.5, 6
_QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0}


def _initial() -> torch.Tensor:
    return torch.arange(NPROC * ROWS * DIM, dtype=torch.float32).view(NPROC * ROWS, DIM)


class _OwnRows(pl.LightningModule):
    """Process r's loss is the sum of rows [r*ROWS, (r+1)*ROWS): its sparse gradient is ones on exactly
    those rows. At the start of step k (after a barrier) every row must have had exactly k updates."""

    def __init__(self, tmpdir: str, slow_rank: int | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(NPROC * ROWS, DIM, sparse=True)
        with torch.no_grad():
            self.emb.weight.copy_(_initial())
        self.tmpdir, self.slow_rank = tmpdir, slow_rank
        self.failures: list[str] = []
        self.checked = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        strategy = self.trainer.strategy
        strategy.barrier()  # every process has finished its previous update
        k = self.trainer.global_step
        want = _initial() - LR * k
        got = self.emb.weight.detach()
        if not torch.equal(got, want):
            self.failures.append(f"step {k}: rows seen {got[:, 0].tolist()}, want {want[:, 0].tolist()}")
        self.checked += 1
        strategy.barrier()  # nobody updates before everyone has looked
        rows = torch.arange(ROWS) + self.global_rank * ROWS
        return self.emb(rows).sum()

    def on_after_backward(self) -> None:
        if self.global_rank == self.slow_rank:
            # Widen the window in which a checkpoint could catch a half-done step: rank 0 reaches the
            # step-3 checkpoint long before this rank's update lands, so without the strategy's
            # quiescing barrier the saved rows of this rank would be a step behind. (The check passes
            # because of that barrier, not because of this wait.)
            time.sleep(0.3)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(64, 1)), batch_size=1)

    def on_train_end(self) -> None:
        with open(os.path.join(self.tmpdir, f"rank{self.global_rank}.json"), "w") as f:
            json.dump({"failures": self.failures, "checked": self.checked, "shared": self.emb.weight.is_shared()}, f)


def _single_process_reference() -> torch.Tensor:
    """All rows updated by one process, STEPS times: what the shared model must hold."""
    weight = nn.Parameter(_initial().clone())
    opt = torch.optim.SGD([weight], lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        weight.sum().backward()
        opt.step()
    return weight.detach()


class _SaveAt3(pl.Callback):
    """``trainer.save_checkpoint`` right after step 3 (no collective of ModelCheckpoint's before it, so
    only the strategy's own barrier keeps a slower process's step-3 update out of or in the snapshot)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 3:
            trainer.save_checkpoint(self.path)


def _driver(rank: int, world: int, tmpdir: str) -> dict[str, Any]:
    module = _OwnRows(tmpdir, slow_rank=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=HogwildStrategy(num_processes=NPROC),
        max_steps=STEPS,
        callbacks=[_SaveAt3(os.path.join(tmpdir, "step=3.ckpt"))],
        default_root_dir=tmpdir,
        enable_checkpointing=False,
        **_QUIET,
    )
    trainer.fit(module)
    reports = []
    for r in range(NPROC):
        with open(os.path.join(tmpdir, f"rank{r}.json")) as f:
            reports.append(json.load(f))
    saved = torch.load(os.path.join(tmpdir, "step=3.ckpt"), map_location="cpu", weights_only=True)
    return {
        "reports": reports,
        "final": module.emb.weight.detach().clone(),
        "at3": saved["state_dict"]["emb.weight"],
        "shared": module.emb.weight.is_shared(),
    }


@pytest.mark.timeout(180)
def test_every_process_sees_every_update_and_checkpoints_are_consistent(tmp_path: Any) -> None:
    out = run_distributed(_driver, 1, str(tmp_path), timeout=150, process_group=False)[0]
    for r, report in enumerate(out["reports"]):
        assert report["shared"], f"process {r}: the embedding is not in shared memory"
        assert report["checked"] == STEPS, f"process {r} checked {report['checked']} steps"
        assert not report["failures"], f"process {r}: {report['failures']}"
    # tolerance 0: disjoint rows, integer values and lr 0.5 make every update exact
    torch.testing.assert_close(out["final"], _single_process_reference(), rtol=0, atol=0)
    assert out["shared"], "the main process's module should share the trained memory"
    torch.testing.assert_close(out["at3"], _initial() - LR * 3, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"num_processes": 0}, "num_processes"),
        ({"num_processes": 2.0}, "num_processes"),
        ({"num_processes": (os.cpu_count() or 1) + 1}, "oversubscribe=True"),
        ({"oversubscribe": "yes"}, "oversubscribe"),
        ({"start_method": "popen"}, "start_method"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_arguments_are_named(kw: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        HogwildStrategy(**kw)


def test_oversubscription_is_allowed_when_asked() -> None:
    n = (os.cpu_count() or 1) + 1
    assert HogwildStrategy(num_processes=n, oversubscribe=True).num_processes == n


# The sparse example: a bag-of-words topic classifier (EmbeddingBag with sparse gradients + a linear head,
# plain SGD). One process reaches val_acc 0.74-0.76 after 3 epochs and stays there (seeds 0-9); majority
# class 0.27. Hogwild's processes, each on half the data, get there later (0.70 after 3 epochs, 0.75
# after 8 in the CLI), so both runs get 6 epochs: the same number of updates, both on the plateau.
TARGET_ACC, EPOCHS = 0.65, 6


def _topics_driver(rank: int, world: int, tmpdir: str) -> dict[str, float]:
    from lightning_sync.models.topics import BagOfWordsClassifier, TopicDataModule

    torch.set_num_threads(1)

    def fit(strategy: Any, devices: int) -> float:
        pl.seed_everything(0, verbose=False)
        data = TopicDataModule()
        data.setup("fit")
        model = BagOfWordsClassifier(vocab_size=data.vocab_size, num_classes=data.num_classes)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=devices,
            strategy=strategy,
            max_epochs=EPOCHS,
            enable_checkpointing=False,
            default_root_dir=tmpdir,
            **_QUIET,
        )
        trainer.fit(model, datamodule=data)
        return float(trainer.callback_metrics["val_acc"])

    # the same number of updates: EPOCHS epochs in one process, or EPOCHS epochs of half the data in each of 2
    return {"single": fit("auto", 1), "hogwild": fit(HogwildStrategy(num_processes=NPROC), NPROC)}


@pytest.mark.timeout(240)
def test_the_sparse_example_reaches_its_target_accuracy(tmp_path: Any) -> None:
    acc = run_distributed(_topics_driver, 1, str(tmp_path), timeout=200, process_group=False)[0]
    assert acc["single"] >= TARGET_ACC, acc  # the reference itself must work
    assert acc["hogwild"] >= TARGET_ACC, acc
    # Lock-free updates from 2 processes lose little against the one-process run of as many updates:
    # seed-to-seed spread alone is about 0.03 (0.736-0.763), so 0.05 allows that and no real regression.
    assert acc["hogwild"] >= acc["single"] - 0.05, acc
