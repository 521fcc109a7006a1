"""The cost model's calibration sweep: per payload size and op (:data:`OPS`) the mean *span* of ``repeats``
calls, from the last rank's entry to its exit, what a synchronous step pays. The mean, not the median: a step pays
the sum of its calls and the span is heavy tailed on a time-shared CPU (FSDP2's 24 calls per step on deep_mlp
spanned 43-50 ms where medians priced 33 ms). Each repeat passes over every size, the ops alternating.
"""

from __future__ import annotations

import statistics
import time

import torch

from lightning_sync import comms
from lightning_sync._checks import check_choice, check_int
from lightning_sync.bench.model import SweepPoint
from lightning_sync.bench.rows import spread
from lightning_sync.comms.algorithms import ALGORITHMS, all_reduce_with

__all__ = ["DEFAULT_SIZES", "OPS", "price", "sweep_all_reduce", "sweep_sizes"]

#: What can be swept: every all-reduce algorithm, the even all-gather and reduce-scatter of ``comms``, and the
#: backend's own (``torch_*``).
OPS = (*sorted(ALGORITHMS), "all_gather", "reduce_scatter", "torch_all_gather", "torch_reduce_scatter")


def _run(ctx: comms.CommContext, op: str, whole: torch.Tensor) -> None:
    """One ``op`` on a tensor of ``whole``'s size (all_gather: each rank's 1/K shard of it)."""
    k = comms.get_world_size()
    if op == "all_gather":
        ctx.all_gather_into(torch.empty_like(whole), whole[: whole.numel() // k])
    elif op == "reduce_scatter":
        ctx.reduce_scatter_into(torch.empty(whole.numel() // k), whole)
    elif op == "torch_all_gather":
        torch.distributed.all_gather_into_tensor(torch.empty_like(whole), whole[: whole.numel() // k])
    elif op == "torch_reduce_scatter":
        torch.distributed.reduce_scatter_tensor(torch.empty(whole.numel() // k), whole)
    else:
        all_reduce_with(ctx, op, whole)


def sweep_sizes(smallest: int = 1024, largest: int = 256 * 2**20, factor: int = 4) -> list[int]:
    """Payload sizes in bytes from ``smallest`` to ``largest`` (inclusive), each ``factor`` x the previous."""
    check_int("smallest", smallest, 4)
    check_int("factor", factor, 2)
    check_int("largest", largest, smallest)
    out, s = [], smallest
    while s <= largest:
        out.append(s)
        s *= factor
    return out


#: 1 KiB to 256 MiB by factors of 4 (10 sizes).
DEFAULT_SIZES = sweep_sizes()


def _repeats_for(nbytes: int, repeats: int) -> int:
    """Fewer repeats for the largest payloads (each takes ~1 s here), at least 3."""
    return repeats if nbytes <= 16 * 2**20 else max(3, repeats // 3)


def sweep_all_reduce(
    rank: int, world: int, sizes: list[int], algorithms: list[str], repeats: int = 7, threads: int = 1
) -> list[SweepPoint]:
    """One point per (size, op), the same on every rank; the ranks share one host (the span compares clocks)."""
    for a in algorithms:
        check_choice("algorithm", a, OPS)
    check_int("repeats", repeats, 1)
    for nbytes in sizes:
        check_int("size", nbytes, 4)
    torch.set_num_threads(threads)
    ctx = comms.CommContext(observer=comms.CommStats())  # accounted, as a strategy's calls are
    bufs = {n: torch.ones(n // 4 // world * world, dtype=torch.float32) for n in sizes}  # divisible into K shards
    points = [(n, a) for n in sizes for a in algorithms]
    times: dict[tuple[int, str], list[float]] = {p: [] for p in points}  # the span of each repeat
    own: dict[tuple[int, str], list[float]] = {p: [] for p in points}  # the slowest rank's own time
    for n, a in points:  # warm-up
        _run(ctx, a, bufs[n].clone())
    for rep in range(max((_repeats_for(n, repeats) for n in sizes), default=0)):
        for n in (n for n in sizes if rep < _repeats_for(n, repeats)):
            for a in algorithms if rep % 2 == 0 else algorithms[::-1]:
                t = bufs[n].clone()
                ctx.barrier()
                t0 = time.perf_counter()
                _run(ctx, a, t)
                t1 = time.perf_counter()
                last = torch.tensor([t0, t1, t1 - t0], dtype=torch.float64)  # CLOCK_MONOTONIC: one clock per host
                ctx.all_reduce(last, op="max")
                times[(n, a)].append(float(last[1] - last[0]))
                own[(n, a)].append(float(last[2]))
    return [SweepPoint(a, world, bufs[n].numel() * 4, **price(times[(n, a)], own[(n, a)])) for n, a in points]


def price(spans: list[float], own: list[float]) -> dict[str, float]:
    """One point's ``seconds`` (mean span), ``median_seconds``, ``rank_seconds`` (median slowest-rank time) and
    the spread of its spans (``min_seconds``, ``max_seconds``)."""
    mid, fastest, slowest = spread(spans)
    point = {"seconds": statistics.fmean(spans), "median_seconds": mid, "rank_seconds": statistics.median(own)}
    return {**point, "min_seconds": fastest, "max_seconds": slowest}
