"""BucketedDDPStrategy's buffer policy with BatchNorm, against a single-process reference.

Policy (torch DDP's ``broadcast_buffers=True``): parameters and buffers are broadcast from rank 0 at
setup; at the start of every training step rank 0's buffers are broadcast, then each rank's forward
updates them with its own batch. So, after the last step, rank r holds "rank 0's statistics before
that step, updated with rank r's last batch", and the weights follow the average of the per-rank
losses (each rank's BatchNorm normalizes its own batch).
"""

from __future__ import annotations

import copy
import os

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_sync import BucketedDDPStrategy
from lightning_sync.testing import run_distributed

STEPS, BATCH, LR, SEED = 5, 8, 0.1, 3


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(96, 6, generator=g), torch.randn(96, 1, generator=g))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 1))


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def _train(rank: int, world: int, broadcast_buffers: bool) -> dict[str, torch.Tensor]:
    module = _Module()
    with torch.no_grad():  # make every rank start different: setup must replace this with rank 0's state
        module.net[0].weight.add_(0.1 * rank)
        module.net[1].running_mean.fill_(0.5 + rank)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        max_steps=STEPS,
        logger=False,
        strategy=BucketedDDPStrategy(broadcast_buffers=broadcast_buffers),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(_data(), batch_size=BATCH, shuffle=True))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _reference(world: int, broadcast_buffers: bool) -> list[dict[str, torch.Tensor]]:
    """Every rank's final state dict, computed in one process."""
    net = _net()
    with torch.no_grad():
        net[1].running_mean.fill_(0.5)  # rank 0's initial statistics, broadcast at setup
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    loaders = [
        iter(
            DataLoader(
                _data(),
                batch_size=BATCH,
                sampler=DistributedSampler(_data(), num_replicas=world, rank=r, shuffle=True, seed=SEED),
            )
        )
        for r in range(world)
    ]
    bn = net[1]
    names = ("running_mean", "running_var", "num_batches_tracked")
    per_rank = [{n: getattr(bn, n).clone() for n in names} for _ in range(world)]
    for _ in range(STEPS):
        opt.zero_grad()
        losses = []
        rank0_at_step_start = per_rank[0]  # what the broadcast at the start of the step sends
        for r, it in enumerate(loaders):
            start = rank0_at_step_start if broadcast_buffers else per_rank[r]
            for n in names:  # fresh tensors: the previous rank's forward saved the old ones for backward
                setattr(bn, n, start[n].clone())
            x, y = next(it)
            losses.append(nn.functional.mse_loss(net(x), y))
            per_rank[r] = {n: getattr(bn, n).clone() for n in names}
        (sum(losses) / world).backward()  # the gradient all-reduce averages the per-rank losses
        opt.step()
    out = []
    for r in range(world):
        state = copy.deepcopy(net.state_dict())
        state.update({f"1.{n}": per_rank[r][n] for n in names})
        out.append(state)
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_buffers_follow_the_documented_policy(broadcast_buffers: bool) -> None:
    results = run_distributed(_train, 2, broadcast_buffers, timeout=200, env={"PL_GLOBAL_SEED": str(SEED)})
    assert os.environ.get("PL_GLOBAL_SEED") is None  # the seed was set in the ranks only
    reference = _reference(2, broadcast_buffers)
    for rank, (got, want) in enumerate(zip(results, reference)):
        for key, value in want.items():
            # fp32, a handful of steps: only summation order differs from the reference -> 1e-5
            torch.testing.assert_close(
                got[f"net.{key}"], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key, r=rank: f"rank {r}, {k}: {m}"
            )
    if broadcast_buffers:  # the ranks' statistics differ only by their own last batch
        assert not torch.equal(results[0]["net.1.running_mean"], results[1]["net.1.running_mean"])
