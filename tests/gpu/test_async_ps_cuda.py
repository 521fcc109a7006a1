"""AsyncParameterServerStrategy on CUDA (skipped where CUDA is absent), over RPC with no process group.

One rank per visible GPU; with ``max_staleness=0`` every rank's weights must equal the single-process
reference on the same device. Payloads are staged through host memory and the server steps its copy on
rank 0's GPU, so this covers the device moves on both sides.
"""

from __future__ import annotations

import pytest
import torch
from _nccl_reference import RegressionModule, fit, reference

from lightning_sync import AsyncParameterServerStrategy
from lightning_sync.testing import DistributedRankError, run_distributed

pytestmark = pytest.mark.gpu
HIDDEN = 32


def _train(rank: int, world: int) -> list[torch.Tensor]:
    module = RegressionModule(HIDDEN, momentum=0.9)
    trained_on = fit(module, AsyncParameterServerStrategy(max_staleness=0), world)
    assert trained_on == {"cuda"}, f"the parameters must be on the GPU at every step, got {trained_on}"
    return [p.detach().cpu() for p in module.parameters()]


@pytest.mark.timeout(400)
def test_async_ps_on_cuda_with_no_staleness_matches_single_process() -> None:
    world = torch.cuda.device_count()
    results = run_distributed(_train, world, timeout=300, process_group=False)
    want = reference(world, torch.device("cuda", 0), HIDDEN, momentum=0.9)
    # fp32 on GPU: the server sums the K gradients in arrival order, the reference in rank order -> 1e-5
    for rank_params in results:
        for got, ref in zip(rank_params, want):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def _hogwild_on_gpu(rank: int, world: int, num_processes: int | None) -> None:
    from lightning_sync import HogwildStrategy

    fit(RegressionModule(HIDDEN, momentum=0.0), HogwildStrategy(num_processes=num_processes), 1)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("num_processes", "message"),
    [
        # the processes from the Trainer's devices: the strategy's own check, when it sets up
        (None, r"HogwildStrategy runs on CPU \(shared host memory\), got CUDAAccelerator"),
        # CPU processes named on the strategy: Lightning's connector refuses the pair first, naming the class
        (1, r"CPU parallel_devices set through HogwildStrategy class, but accelerator set to gpu"),
    ],
)
def test_hogwild_refuses_a_gpu_accelerator_by_name(num_processes: int | None, message: str) -> None:
    with pytest.raises(DistributedRankError, match=message):
        run_distributed(_hogwild_on_gpu, 1, num_processes, timeout=150, process_group=False)
