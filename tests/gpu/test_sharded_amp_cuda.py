"""ShardedStrategy with Lightning's ``precision="16-mixed"`` on CUDA and NCCL (skipped where CUDA is absent).

One rank per visible GPU trains the regression model under fp16 autocast with Lightning's default
``GradScaler("cuda")``, which the strategy replaces by a ``ShardedGradScaler`` (its found-inf flag all-reduced
over NCCL, on the GPU; with ``offload=True`` the master gradients it checks are on the host). Every rank's
weights and final scale must equal a one-process reference with the same scaler semantics: each rank's batch
backpropagated separately with the scaled loss, the gradients averaged, then ``unscale_``, ``step``, ``update``.
The one-rank overflow is tested on gloo (tests/multiprocess/test_sharded_amp.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from _nccl_reference import BATCH, LR, STEPS, RegressionModule, data, net
from lightning.pytorch import Trainer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_sync import ShardedStrategy
from lightning_sync.sync.zero import ShardedGradScaler
from lightning_sync.testing import run_distributed

pytestmark = pytest.mark.gpu
HIDDEN = 33


def _train(rank: int, world: int, stage: int, offload: bool) -> tuple[list[torch.Tensor], float, str]:
    module = RegressionModule(HIDDEN, momentum=0.9)
    trainer = Trainer(
        accelerator="gpu",
        devices=world,
        strategy=ShardedStrategy(stage=stage, wrap_policy=["Linear"], bucket_cap_mb=0.001, offload=offload),
        precision="16-mixed",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(data(), batch_size=BATCH, shuffle=True))
    scaler = trainer.precision_plugin.scaler
    return [p.detach().cpu() for p in module.parameters()], scaler.get_scale(), type(scaler).__name__


def _reference(world: int) -> tuple[list[torch.Tensor], float]:
    device = torch.device("cuda", 0)
    model = net(HIDDEN).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    samplers = [DistributedSampler(data(), num_replicas=world, rank=r, shuffle=True, seed=seed) for r in range(world)]
    loaders = [iter(DataLoader(data(), batch_size=BATCH, sampler=s)) for s in samplers]
    for _ in range(STEPS):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for it in loaders:
            x, y = next(it)
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
                loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
            scaler.scale(loss).backward()
            for t, p in zip(total, model.parameters()):
                t += p.grad
        for t, p in zip(total, model.parameters()):
            p.grad = t / world
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    return [p.detach().cpu() for p in model.parameters()], scaler.get_scale()


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("stage", "offload"), [(2, False), (3, True)], ids=["zero2", "zero3-offload"])
def test_fp16_mixed_on_cuda_matches_one_process(stage: int, offload: bool) -> None:
    world = torch.cuda.device_count()
    results = run_distributed(_train, world, stage, offload, backend="nccl", timeout=300)
    want, want_scale = _reference(world)
    # fp16 autocast: each rank runs the reference's kernels on the same values, but cuBLAS may choose another
    # algorithm in another process, moving an fp16 product by an ulp (~1e-3 relative); over 4 SGD steps (lr 0.1)
    # on gradients of magnitude <= ~1 that stays below 1e-4 in the weights. A step taken on a rank that should
    # have skipped it, or a wrong unscale (a factor of 2**16), moves them by far more than 1e-3.
    for params, scale, kind in results:
        assert kind == ShardedGradScaler.__name__, kind
        assert scale == want_scale, (scale, want_scale)
        for got, ref in zip(params, want, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
    moved = max((p - q).abs().max().item() for p, q in zip(want, [p.detach() for p in net(HIDDEN).parameters()]))
    assert moved > 1e-2, f"the reference must have trained (moved {moved})"
