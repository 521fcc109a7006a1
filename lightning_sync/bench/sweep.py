"""The all-reduce size sweep behind the cost model: one timed all-reduce per size and algorithm.

:func:`sweep_all_reduce` runs inside every rank (``run_distributed``). For each payload size (bytes of
float32) and each algorithm of :data:`lightning_sync.comms.algorithms.ALGORITHMS` that it is asked for
(``backend``: gloo's or NCCL's own all-reduce; ``ring`` and ``tree``: ours, built from send/recv;
``all_gather`` and ``reduce_scatter``: ``comms.all_gather_into`` and ``reduce_scatter_into`` of a
whole of that size, what the sharded strategies call; ``torch_all_gather`` and ``torch_reduce_scatter``:
the backend's own ``all_gather_into_tensor`` and ``reduce_scatter_tensor``, what torch's FSDP2 calls), it
times ``repeats`` all-reduces, each started by a barrier so every rank begins together, and reports
the mean of the collective's *span*: from the moment its last rank entered it to the moment its last
rank left it (``max(end) - max(start)`` on the host's monotonic clock, which every rank of the one-host
group reads). That is what a synchronous step pays for it: the step's compute term already ends with
its slowest rank (the cost model's compute row takes the slowest rank per step), and the ranks that
arrived earlier wait, asleep, until it comes.

The price of a call is the *mean* span, not the median: a step pays the sum of its calls, and on a
time-shared CPU the span is heavy tailed: on the 2-core machine (2026-11-24, 17 calls after a barrier,
twice) gloo's all-gather of 1 MiB at K=2 had a median span of 0.64-0.83 ms and a mean of 1.58-1.82 ms,
as a call now and then waits a scheduler slice for a peer's thread. A strategy that issues tens of small
calls per step (FSDP2, ZeRO-3: one all-gather per unit) pays about the mean of each: FSDP2's 24 calls on
deep_mlp at K=2 spanned 43-50 ms per step from their last rank's arrival, where the medians of the sweep
priced 33 ms. The median is kept as ``median_seconds`` (raw data from before 2026-11-24 has only the
median, as ``seconds``). The slowest rank's own time, ``max(end - start)``, kept
as ``rank_seconds``, also holds the wait for a late starter; with more ranks than cores a rank woken
from the barrier can wait a whole time slice for a core, which would be priced twice. Each repeat is one
pass over every size, the algorithms alternating within it (A B C, C B A, ...): a burst of load on this
shared machine then hits one repeat of several sizes, a little on each mean, rather than every repeat
of one size, which would bend the fit.

:func:`lightning_sync.bench.model.fit_alpha_beta` turns the points into latency and bandwidth.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from lightning_sync import comms
from lightning_sync._checks import check_choice, check_int
from lightning_sync.comms.algorithms import ALGORITHMS, all_reduce_with

#: What can be swept: every all-reduce algorithm, the even all-gather and reduce-scatter of ``comms``, and
#: the backend's own (``torch_*``).
OPS = (*sorted(ALGORITHMS), "all_gather", "reduce_scatter", "torch_all_gather", "torch_reduce_scatter")


def _run(op: str, whole: torch.Tensor) -> None:
    """One ``op`` on a tensor of ``whole``'s size (all_gather: each rank's 1/K shard of it)."""
    k = comms.get_world_size()
    if op == "all_gather":
        comms.all_gather_into(torch.empty_like(whole), whole[: whole.numel() // k])
    elif op == "reduce_scatter":
        comms.reduce_scatter_into(torch.empty(whole.numel() // k), whole, scratch=True)
    elif op == "torch_all_gather":
        torch.distributed.all_gather_into_tensor(torch.empty_like(whole), whole[: whole.numel() // k])
    elif op == "torch_reduce_scatter":
        torch.distributed.reduce_scatter_tensor(torch.empty(whole.numel() // k), whole)
    else:
        all_reduce_with(op, whole)


__all__ = ["DEFAULT_SIZES", "OPS", "price", "sweep_all_reduce", "sweep_sizes"]


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
) -> list[dict[str, Any]]:
    """Time all-reduces of every size with every algorithm; returns one point per (algorithm, size).

    Each point: ``{"algorithm", "world", "bytes", "seconds", "median_seconds", "rank_seconds"}``: ``seconds``
    is the mean over the repeats of the collective's span (its last rank's start to its last rank's end, see
    the module docstring), ``median_seconds`` their median, ``rank_seconds`` the median of the slowest rank's
    own wall time (every repeat is started by a barrier; :func:`price`). The ranks must share one host
    (``run_distributed``): the span compares their clocks. One untimed all-reduce per (algorithm, size) warms
    the buffers and the connections first.
    """
    for a in algorithms:
        check_choice("algorithm", a, OPS)
    check_int("repeats", repeats, 1)
    torch.set_num_threads(threads)
    for nbytes in sizes:
        check_int("size", nbytes, 4)
    bufs = {n: torch.ones(n // 4 // world * world, dtype=torch.float32) for n in sizes}  # divisible into K shards
    times: dict[tuple[int, str], list[float]] = {(n, a): [] for n in sizes for a in algorithms}
    own: dict[tuple[int, str], list[float]] = {(n, a): [] for n in sizes for a in algorithms}
    for n in sizes:
        for a in algorithms:  # warm-up
            _run(a, bufs[n].clone())
    for rep in range(max((_repeats_for(n, repeats) for n in sizes), default=0)):
        for n in sizes:
            if rep >= _repeats_for(n, repeats):
                continue
            for a in algorithms if rep % 2 == 0 else list(reversed(algorithms)):
                t = bufs[n].clone()
                comms.barrier()
                t0 = time.perf_counter()
                _run(a, t)
                t1 = time.perf_counter()
                last = torch.tensor([t0, t1, t1 - t0], dtype=torch.float64)  # CLOCK_MONOTONIC: one clock per host
                comms.all_reduce(last, op="max")
                times[(n, a)].append(float(last[1] - last[0]))
                own[(n, a)].append(float(last[2]))
    return [
        {"algorithm": a, "world": world, "bytes": bufs[n].numel() * 4, **price(times[(n, a)], own[(n, a)])}
        for n in sizes
        for a in algorithms
    ]


def price(spans: list[float], own: list[float]) -> dict[str, float]:
    """One point's times from its repeats' spans and slowest-rank times: ``seconds``, the mean span (a step
    pays the sum of its calls, see the module docstring); ``median_seconds``; ``rank_seconds``, the median
    slowest-rank time."""
    return {
        "seconds": statistics.fmean(spans),
        "median_seconds": statistics.median(spans),
        "rank_seconds": statistics.median(own),
    }
