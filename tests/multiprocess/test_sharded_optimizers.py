"""Several optimizers under ZeRO 1/2/3 on 2 gloo ranks: a GAN trained with Lightning's manual optimization.

The LightningModule has a generator and a discriminator (``Linear`` layers: stage-3 wrap units) and a root
parameter (a temperature in the LightningModule itself: the stage-3 root unit). Its ``training_step`` runs two
forward/backward/step phases, each between ``toggle_optimizer`` and ``untoggle_optimizer``: Adam steps the
generator, SGD with momentum (two param groups: the discriminator's layers, and the temperature with another
learning rate) steps the discriminator. So a step function runs four forwards and two backwards, and at stage 3
the root unit, freed by the first backward, is used again by the second phase.

One spawned group runs every fit and checks several things per fit:

* **zero1 / zero2 / zero3**: 6 batches (12 optimizer steps); the final weights equal a one-process reference that
  runs the same phases with the same toggling on the ranks' global batches, and are bit-identical across ranks.
* **full checkpoint** (zero2, ``state_dict_type="full"``) at batch 3: ``optimizer_states`` holds one plain
  ``state_dict()`` per optimizer, numbered as the unsharded optimizer numbers its parameters (Lightning ``ddp``'s
  form), and equal to the reference's after 3 batches; zero3 resumes from it and ends where the reference ends.
* **sharded checkpoint** (zero3's default) at batch 3: zero1 resumes from the directory (resharded to stage 1)
  and ends where the reference ends.
* **a parameter in two optimizers** is refused with a ``ValueError`` naming it.

Tolerance: each rank's phases run the reference's ops on the same values; the gradients are averaged by a
reduce-scatter (float32 sum, then divide) against loss/K summed by autograd here: ~1e-7 relative per gradient,
carried by 6 Adam steps (lr 0.01; normalised updates) and 6 SGD+momentum steps (lr 0.05) on weights of magnitude
<= ~1 to ~1e-6. 1e-5 is far below what a wrong gradient does (a gradient kept from the other phase, a step of the
wrong optimizer, a stale root parameter: 1e-3 or more; every fit checks the weights moved by more than 1e-2).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _lightning_reference import (
    ENV,
    EQ_TOL,
    MIN_MOVE,
    _assert_section,
    _quiet_rank,
    _rank_batches,
    _same_on_every_rank,
    _Sections,
    _state,
    _trainer,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_sync import ShardedStrategy
from lightning_sync.testing import Checks, run_distributed

__all__: list[str] = []

BATCH, N = 4, 48  # 6 batches per rank and epoch at 2 ranks
BATCHES, SAVE_AT = 6, 3
STEPS = 2 * BATCHES  # manual optimization counts every optimizer step: two per batch


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(N, 6, generator=g) * 0.5 + 1.0, torch.randn(N, 4, generator=g))


class _Gan(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        with torch.random.fork_rng():
            torch.manual_seed(7)  # the same initial weights in every rank and in the reference
            self.generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
            self.discriminator = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        self.temperature = nn.Parameter(torch.ones(()))  # the root unit's at stage 3

    def g_loss(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return F.softplus(-self.discriminator(self.generator(z)) * self.temperature).mean()

    def d_loss(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        fake = self.generator(z).detach()
        real = F.softplus(-self.discriminator(x) * self.temperature).mean()
        return real + F.softplus(self.discriminator(fake) * self.temperature).mean()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        for opt, loss_fn in ((opt_g, self.g_loss), (opt_d, self.d_loss)):
            self.toggle_optimizer(opt)
            self.manual_backward(loss_fn(*batch))
            opt.step()
            opt.zero_grad()
            self.untoggle_optimizer(opt)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=0.01, betas=(0.5, 0.9))
        opt_d = torch.optim.SGD(
            [{"params": self.discriminator.parameters()}, {"params": [self.temperature], "lr": 0.01}],
            lr=0.05,
            momentum=0.9,
        )
        return [opt_g, opt_d]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=BATCH, shuffle=True)  # Lightning swaps in a DistributedSampler


def _reference(world: int) -> dict[str, Any]:
    """One process: per batch, each phase backpropagates every rank's loss / K with the other optimizer's
    parameters frozen (what ``toggle_optimizer`` does), then steps. The state after ``SAVE_AT`` and at the end."""
    module = _Gan()
    opts = module.configure_optimizers()
    x, z = _data().tensors
    batches = _rank_batches(N, world, epoch=0, batch=BATCH)
    out: dict[str, Any] = {"init": _state(module)}
    for b in range(BATCHES):
        for opt, loss_fn in zip(opts, (module.g_loss, module.d_loss)):
            mine = {id(p) for g in opt.param_groups for p in g["params"]}
            for p in module.parameters():
                p.requires_grad_(id(p) in mine)
            for r in range(world):
                idx = batches[r][b]
                (loss_fn(x[idx], z[idx]) / world).backward()
            opt.step()
            opt.zero_grad()
        for p in module.parameters():
            p.requires_grad_(True)
        if b + 1 == SAVE_AT:
            out["saved"] = [copy.deepcopy(opt.state_dict()) for opt in opts]  # the state is stepped in place
    out["state"] = _state(module)
    return out


def _check(ck: Checks, tag: str, module: nn.Module, ref: dict[str, Any], trainer: pl.Trainer) -> None:
    ck.true(f"{tag} optimizer steps", trainer.global_step == STEPS, trainer.global_step)
    state = _state(module)
    for name, value in state.items():
        ck.close(f"{tag} {name}", value, ref["state"][name], **EQ_TOL)
    moved = max((ref["state"][k] - ref["init"][k]).abs().max().item() for k in state)
    ck.true(f"{tag} the reference trained", moved > MIN_MOVE, moved)
    _same_on_every_rank(ck, tag, state)


def _sharded(stage: int, **kw: Any) -> ShardedStrategy:
    return ShardedStrategy(stage=stage, wrap_policy=["Linear"], bucket_cap_mb=0.001, **kw)


def _fit(world: int, strategy: ShardedStrategy, ckpt_path: str | None = None, **kw: Any) -> tuple[_Gan, pl.Trainer]:
    module = _Gan()
    trainer = _trainer(world, strategy, max_steps=STEPS, **kw)
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, trainer


def _stages(ck: Checks, world: int, ref: dict[str, Any]) -> None:
    module, trainer = _fit(world, _sharded(1))
    _check(ck, "[zero1]", module, ref, trainer)


def _saver(dirpath: str) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=2 * SAVE_AT, save_top_k=-1)


def _full_checkpoint(ck: Checks, world: int, ref: dict[str, Any], tmpdir: str) -> None:
    dirpath = os.path.join(tmpdir, "full")
    module, trainer = _fit(
        world, _sharded(2, state_dict_type="full"), callbacks=[_saver(dirpath)], enable_checkpointing=True
    )
    _check(ck, "[zero2]", module, ref, trainer)
    path = os.path.join(dirpath, f"step={2 * SAVE_AT}.ckpt")
    if trainer.global_rank == 0:
        states = torch.load(path, weights_only=True)["optimizer_states"]
        ck.true("[full file] one state per optimizer", len(states) == 2, len(states))
        for i, (got, want) in enumerate(zip(states, ref["saved"])):
            ck.true(
                f"[full file] optimizer {i} numbered as the unsharded one",
                [g["params"] for g in got["param_groups"]] == [g["params"] for g in want["param_groups"]],
                (got["param_groups"], want["param_groups"]),
            )
            ck.true(f"[full file] optimizer {i} state keys", got["state"].keys() == want["state"].keys())
            for index, entry in want["state"].items():
                for key, value in entry.items():
                    ck.close(
                        f"[full file] optimizer {i} param {index} {key}", got["state"][index][key], value, **EQ_TOL
                    )
    module, trainer = _fit(world, _sharded(3), ckpt_path=path)
    _check(ck, "[zero3 resumed from zero2's full file]", module, ref, trainer)


def _sharded_checkpoint(ck: Checks, world: int, ref: dict[str, Any], tmpdir: str) -> None:
    dirpath = os.path.join(tmpdir, "sharded")
    module, trainer = _fit(world, _sharded(3), callbacks=[_saver(dirpath)], enable_checkpointing=True)
    _check(ck, "[zero3]", module, ref, trainer)
    path = os.path.join(dirpath, f"step={2 * SAVE_AT}.ckpt")
    ck.true("[sharded] a directory", os.path.isdir(path), path)
    module, trainer = _fit(world, _sharded(1), ckpt_path=path)
    _check(ck, "[zero1 resumed from zero3's sharded directory]", module, ref, trainer)


class _Shared(_Gan):
    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.generator.parameters(), lr=0.1), torch.optim.SGD(self.parameters(), lr=0.1)]


def _refusal(ck: Checks, world: int) -> None:
    ck.raises(
        "[two optimizers] a parameter in both is refused, named",
        lambda: _trainer(world, _sharded(2), max_steps=2).fit(_Shared()),
        r"parameter 'generator\.0\.weight' is in optimizer 0 group 0 and in optimizer 1 group 0",
        exc=ValueError,
    )


def _worker(rank: int, world: int, tmpdir: str) -> dict[str, Any]:
    _quiet_rank()
    ref = _reference(world)
    s = _Sections()
    s.run("stages", _stages, world, ref)
    s.run("full", _full_checkpoint, world, ref, tmpdir)
    s.run("sharded", _sharded_checkpoint, world, ref, tmpdir)
    s.run("refusal", _refusal, world)
    return s.result()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_worker, 2, str(tmp_path_factory.mktemp("optimizers")), timeout=240, env=ENV)


@pytest.mark.timeout(300)
def test_gan_with_two_optimizers_matches_one_process_at_every_stage(two_ranks: list[dict[str, Any]]) -> None:
    _assert_section(two_ranks, "stages", min_checks=10)


@pytest.mark.timeout(300)
def test_full_checkpoint_holds_one_plain_state_per_optimizer_and_resumes_at_another_stage(
    two_ranks: list[dict[str, Any]],
) -> None:
    _assert_section(two_ranks, "full", min_checks=20, same_count=False)  # rank 0 reads the file too


@pytest.mark.timeout(300)
def test_sharded_checkpoint_of_two_optimizers_resumes_at_another_stage(two_ranks: list[dict[str, Any]]) -> None:
    _assert_section(two_ranks, "sharded", min_checks=20)


@pytest.mark.timeout(300)
def test_a_parameter_in_two_optimizers_is_refused(two_ranks: list[dict[str, Any]]) -> None:
    _assert_section(two_ranks, "refusal", min_checks=1)
