"""The collectives layer on CUDA tensors with NCCL (skipped where CUDA is absent).

Run with one rank per visible GPU; the expected values are computed from each rank's
deterministic input, so they are the single-process reference.
"""

from __future__ import annotations

import pytest
import torch

from lightning_sync import comms
from lightning_sync.comms import algorithms
from lightning_sync.testing import run_distributed

# The communication context of this process's checks (a strategy owns one the same way).
CTX = comms.CommContext(observer=comms.CommStats())

pytestmark = pytest.mark.gpu


def _nccl_checks(rank: int, world: int) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    ref_sum = sum(torch.arange(10, device=dev, dtype=torch.float32) + r for r in range(world))
    t = torch.arange(10, device=dev, dtype=torch.float32) + rank
    # exact: sums of small integers are exact in fp32
    torch.testing.assert_close(CTX.all_reduce(t.clone()), ref_sum, rtol=0, atol=0)
    torch.testing.assert_close(CTX.all_reduce(t.clone(), op="avg"), ref_sum / world, rtol=1e-6, atol=1e-6)
    parts = CTX.all_gather(torch.full((rank + 1, 3), float(rank), device=dev))
    assert [tuple(p.shape) for p in parts] == [(r + 1, 3) for r in range(world)]
    assert all(p.is_cuda and bool((p == r).all()) for r, p in enumerate(parts))
    shard = CTX.reduce_scatter(torch.arange(7, device=dev, dtype=torch.float32) + rank)
    chunk = -(-7 // world)
    torch.testing.assert_close(
        shard, (sum(torch.arange(7.0) + r for r in range(world)))[rank * chunk : (rank + 1) * chunk].to(dev)
    )
    assert CTX.broadcast({"from": 0} if rank == 0 else None) == {"from": 0}
    assert CTX.all_gather_object(rank) == list(range(world))
    w = CTX.all_reduce(torch.ones(4, device=dev), async_op=True)
    torch.testing.assert_close(w.wait(), torch.full((4,), float(world), device=dev))
    if world > 1:
        x = torch.arange(10, device=dev, dtype=torch.float32) + rank
        torch.testing.assert_close(algorithms.ring_all_reduce(CTX, x.clone()), ref_sum, rtol=0, atol=0)
        torch.testing.assert_close(algorithms.tree_all_reduce(CTX, x.clone()), ref_sum, rtol=0, atol=0)
    CTX.barrier()


@pytest.mark.timeout(300)
def test_collectives_on_nccl() -> None:
    world = torch.cuda.device_count()
    run_distributed(_nccl_checks, world, backend="nccl", timeout=240)
