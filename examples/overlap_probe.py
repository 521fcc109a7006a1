"""Does communication overlap with backward on this machine? Measure it with the GradBucketer directly.

    python examples/overlap_probe.py                 # deep_mlp, 2 gloo ranks, caps 25 and 1 MiB

Per bucket cap, on rank 0 (medians of 20 steps after 5 warm-up steps):
- ``compute_ms``: forward + backward with no communication;
- ``comm_alone_ms``: the same gradient buckets all-reduced back to back with no compute;
- ``step_ms``: forward + backward with the bucketed, overlapped all-reduce;
- ``backward_ms``: when backward ended inside that step, and ``exposed_ms`` what was left after it.
Perfect overlap gives ``step_ms ~ max(compute, comm)``; no overlap gives ``compute + comm``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_sync import comms
from lightning_sync.models.synthetic import DeepMLP
from lightning_sync.sync import GradBucketer
from lightning_sync.testing import run_distributed

STEPS, WARMUP = 20, 5


def _median_ms(samples: list[float]) -> float:
    return round(1e3 * statistics.median(samples[WARMUP:]), 2)


def probe(rank: int, world: int, cap_mb: float) -> dict[str, float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DeepMLP()
    x, y = torch.randn(64, 1024), torch.randint(0, 10, (64,))

    def forward_backward() -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()

    ctx = comms.CommContext()  # this probe's communication: nothing to measure but wall time
    compute = []
    for _ in range(STEPS + WARMUP):
        model.zero_grad()
        ctx.barrier()
        t0 = time.perf_counter()
        forward_backward()
        compute.append(time.perf_counter() - t0)
    bucketer = GradBucketer(model.named_parameters(), ctx, bucket_cap_mb=cap_mb, first_bucket_mb=min(1.0, cap_mb))
    step, backward, exposed = [], [], []
    for _ in range(STEPS + WARMUP):
        model.zero_grad()
        bucketer.prepare_for_backward()
        ctx.barrier()
        t0 = time.perf_counter()
        forward_backward()
        step.append(time.perf_counter() - t0)
        backward.append(bucketer.trace.backward_end - t0)
        exposed.append(bucketer.trace.exposed_seconds)
    alone = []
    for _ in range(STEPS + WARMUP):
        ctx.barrier()
        t0 = time.perf_counter()
        for work in [ctx.all_reduce(b.buffer, op="avg", async_op=True) for b in bucketer.buckets]:
            work.wait()
        alone.append(time.perf_counter() - t0)
    bucketer.close()
    return {
        "buckets": len(bucketer.buckets),
        "compute_ms": _median_ms(compute),
        "comm_alone_ms": _median_ms(alone),
        "step_ms": _median_ms(step),
        "backward_ms": _median_ms(backward),
        "exposed_ms": _median_ms(exposed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="measure compute/communication overlap")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--caps", type=float, nargs="+", default=[25.0, 1.0], help="bucket_cap_mb values")
    args = parser.parse_args()
    for cap in args.caps:
        print(
            f"cap={cap} MiB:",
            run_distributed(probe, args.world_size, cap, timeout=600, env={"OMP_NUM_THREADS": "1"})[0],
        )


if __name__ == "__main__":
    main()
