"""The hang watchdog on NCCL: a rank arriving late is not a hang (skipped without two CUDA devices).

On NCCL a timed ``Work.wait(timeout)`` that runs out aborts the communicator, so a watchdog that waited in
slices would kill every job whose ranks arrive more than one slice apart. Here rank 1 arrives 3 s late,
many watchdog intervals, and both all-reduces must still give the exact sum on both ranks.
"""

from __future__ import annotations

import time

import pytest
import torch

from lightning_sync import comms
from lightning_sync.testing import run_distributed

# The communication context of this process's checks (a strategy owns one the same way).
CTX = comms.CommContext(observer=comms.CommStats())

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two NCCL ranks need two CUDA devices"),
]

LATE = 3.0  # how late rank 1 arrives: 15 watchdog intervals, below the watchdog's timeout
INTERVAL = 0.2


def _late_rank(rank: int, world: int) -> list[torch.Tensor]:
    dev = torch.device("cuda", torch.cuda.current_device())
    CTX.start_watchdog(LATE + 5.0, interval=INTERVAL)
    if rank == 1:
        time.sleep(LATE)  # the scenario itself: a rank busy elsewhere (data loading, a checkpoint write)
    late = CTX.all_reduce(torch.full((4,), float(rank + 1), device=dev))
    after = CTX.all_reduce(torch.full((4,), float(rank + 1), device=dev))  # the communicator still works
    error = CTX.watchdog.error
    CTX.stop_watchdog()
    assert error is None, f"rank {rank}: the watchdog aborted: {error}"
    return [late.cpu(), after.cpu()]


@pytest.mark.timeout(300)
def test_a_rank_arriving_late_passes_with_the_watchdog_on_nccl() -> None:
    results = run_distributed(_late_rank, 2, backend="nccl", timeout=240, pg_timeout=60)
    expected = torch.full((4,), 3.0)  # 1 + 2: small integers, exact in fp32
    for rank, tensors in enumerate(results):
        for t in tensors:
            torch.testing.assert_close(t, expected, rtol=0, atol=0, msg=lambda m, r=rank: f"rank {r}: {m}")
