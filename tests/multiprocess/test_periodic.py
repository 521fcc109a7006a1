"""LocalSGD averaging and DiLoCo's outer step (the algorithms, without Lightning) on 2 real gloo ranks,
against single-process references computed by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_sync import comms
from lightning_sync.sync.periodic import DiLoCoOuter, PeriodicAverager
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

# The communication context of this process's checks (a strategy owns one the same way).
CTX = comms.CommContext(observer=comms.CommStats())

STEPS, BATCH, LR = 6, 4, 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _batches(world: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """batches[step][rank]: each rank's own data."""
    g = torch.Generator().manual_seed(1)
    return [
        [(torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 3, generator=g)) for _ in range(world)]
        for _ in range(STEPS)
    ]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _ddp_reference(world: int) -> list[torch.Tensor]:
    """Plain SGD on the average of the ranks' mean losses: what DDP computes."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in _batches(world):
        opt.zero_grad()
        (sum(_loss(model, b) for b in step) / world).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _local_sgd(rank: int, world: int, sync_every: int) -> tuple[list[list[torch.Tensor]], list[bool]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9 if sync_every > 1 else 0.0)
    avg = PeriodicAverager(
        model.parameters(),
        CTX,
        sync_every,
        optimizer=opt,
        average_optimizer_state=sync_every > 1,
    )
    snapshots, synced = [], []
    for step in _batches(world):
        opt.zero_grad()
        _loss(model, step[rank]).backward()
        opt.step()
        synced.append(avg.step())
        snapshots.append([p.detach().clone() for p in model.parameters()])
    return snapshots, synced


def _worker(rank: int, world: int) -> tuple[list[str], int]:
    torch.set_num_threads(1)
    ck, comm = Checks(), CTX
    # LocalSGD with H=1 and plain SGD is DDP: averaging the parameters after a step from equal
    # parameters equals stepping with the averaged gradient (exact up to fp32 rounding of the average)
    snapshots, synced = _local_sgd(rank, world, 1)
    for got, want in zip(snapshots[-1], _ddp_reference(world)):
        ck.close("local_sgd H=1 equals DDP", got, want, rtol=0, atol=1e-6)
    ck.true("H=1 syncs every step", all(synced), synced)
    # H=3 with momentum (state averaged too): the replicas differ between syncs, equal right after
    snapshots, synced = _local_sgd(rank, world, 3)
    everyone = comm.all_gather_object(snapshots)
    ck.true("H=3 syncs at steps 3 and 6", synced == [False, False, True, False, False, True], synced)
    for step, is_sync in enumerate(synced):
        diff = max((a - b).abs().max().item() for a, b in zip(everyone[0][step], everyone[1][step]))
        if is_sync:
            ck.true(f"replicas identical after the sync at step {step + 1}", diff == 0.0, diff)
        else:
            ck.true(f"replicas differ before a sync (step {step + 1})", diff > 1e-4, diff)
    # DiLoCo: one outer step by hand. Each rank moves its copy of w0 by its own delta d_r; the outer
    # Nesterov SGD (fresh momentum buffer b = g) sets w = w0 - lr * (g + mu * g), g = mean_r(w0 - w_r)
    torch.manual_seed(3)
    w0 = torch.randn(4, 3)
    local = nn.Parameter(w0.clone())
    outer = DiLoCoOuter([local], comm, sync_every=2, outer_lr=0.7, outer_momentum=0.9, nesterov=True)
    deltas = [torch.full((4, 3), 0.1 * (r + 1)) + 0.01 * torch.arange(12.0).view(4, 3) for r in range(world)]
    with torch.no_grad():
        local.add_(deltas[rank])
    ck.true("no outer step after 1 of 2 inner steps", not outer.step())
    ck.true("outer step after 2 of 2", outer.step())
    g = sum(-d for d in deltas) / world
    want = w0 - 0.7 * (g + 0.9 * g)
    # fp32: one average of 2 values and two multiply-adds -> a few ulps of values ~1
    ck.close("diloco outer step equals the formula", local.detach(), want, rtol=0, atol=1e-6)
    ck.close("global params hold the result", outer.global_params[0].detach(), want, rtol=0, atol=1e-6)
    return ck.failures, ck.count


@pytest.mark.timeout(150)
def test_local_sgd_and_diloco_match_hand_references() -> None:
    assert_all_ranks_passed(run_distributed(_worker, 2, timeout=120), min_checks=12)
