"""Every collective in lightning_sync.comms on 2 and 3 real gloo ranks, against plain-torch references.

Spawning a rank costs seconds, so one spawned run per world size performs every check (a few
hundred) and returns the list of mismatches; the parent asserts that the list is empty.
Comparisons inside a rank never raise (a rank that raised mid-run would leave its peers blocked in
the next collective), so every rank runs every check and reports all of them.

Inputs are a deterministic function of (rank, seed) (:func:`lightning_sync.testing.exact_input`),
so each rank computes the reference for the whole group locally with plain torch.
"""

from __future__ import annotations

import itertools
import pickle
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from lightning_sync import comms
from lightning_sync.bench.formulas import ring_allreduce_bytes, ring_shard_bytes
from lightning_sync.comms import algorithms as A
from lightning_sync.testing import Checks, assert_all_ranks_passed, exact_input, reduce_reference, run_distributed

__all__: list[str] = []

# The communication context of this process's checks (a strategy owns one the same way).
CTX = comms.CommContext(observer=comms.CommStats())

OPS = ("sum", "avg", "max", "min")
DTYPES = (torch.float32, torch.bfloat16, torch.int64)
RUN_TIMEOUT_S = 150  # hard limit for one spawned run (start-up ~3 s/rank, the checks a few seconds)


# --------------------------------------------------------------------------- tolerances


def _tol(op: str, dtype: torch.dtype) -> dict[str, float]:
    """Tolerance for a reduction result.

    * sum/max/min: exact. max/min select an input; sums of our inputs are exact in fp32 and bf16
      (see :func:`~lightning_sync.testing.exact_input`) and int64 arithmetic is exact.
    * avg, fp32: the exact sum divided by K costs one rounding, <= 2^-24 relative; rtol 1e-6 leaves
      room for a backend that scales before summing (a few more roundings).
    * avg, bf16: bf16 has an 8-bit significand, so one rounding is <= 2^-8 relative. rtol 2^-7 allows
      two roundings; atol 2^-6 covers averages near 0, where a divide-then-sum order can leave a
      residue of a few roundings of terms up to 8/K in size (ulp(4) = 2^-5 in bf16, half of it 2^-6).
    """
    if op != "avg":
        return {"rtol": 0.0, "atol": 0.0}
    if dtype == torch.bfloat16:
        return {"rtol": 2**-7, "atol": 2**-6}
    return {"rtol": 1e-6, "atol": 1e-7}


EXACT = {"rtol": 0.0, "atol": 0.0}  # data movement (broadcast/gather/scatter/all_gather) copies bits


# --------------------------------------------------------------------------- reductions


def _check_all_reduce(ck: Checks, rank: int, k: int, seeds: Iterator[int]) -> None:
    for dtype, op, async_op in itertools.product(DTYPES, OPS, (False, True)):
        seed = next(seeds)
        name = f"all_reduce[{op}, {dtype}, async={async_op}]"
        t = exact_input(rank, (5, 3), dtype, seed)
        if op == "avg" and not dtype.is_floating_point:
            ck.raises(
                name,
                lambda t=t, op=op, async_op=async_op: CTX.all_reduce(t, op=op, async_op=async_op),
                r"int64",
                r"'max'",
                r"'min'",
                r"'sum'",
            )
            ck.true(name + " left input alone", torch.equal(t, exact_input(rank, (5, 3), dtype, seed)))
            continue
        ref = reduce_reference([exact_input(r, (5, 3), dtype, seed) for r in range(k)], op)
        if async_op:
            work = CTX.all_reduce(t, op=op, async_op=True)
            ck.true(name + " returns Work", isinstance(work, comms.Work) and work.op == "all_reduce", repr(work))
            out = work.wait()
            ck.true(name + " wait twice", work.wait() is out and work.is_completed(), repr(work))
        else:
            out = CTX.all_reduce(t, op=op)
        ck.true(name + " in place", out is t, type(out))
        ck.close(name, t, ref, **_tol(op, dtype))


# rows each rank gets from reduce_scatter of n rows on K ranks: ceil(n/K) each, the tail trimmed
_SHARD_ROWS = {(2, 7): [4, 3], (3, 7): [3, 3, 1], (2, 2): [1, 1], (3, 2): [1, 1, 0], (2, 6): [3, 3], (3, 6): [2, 2, 2]}


def _check_reduce_scatter(ck: Checks, rank: int, k: int, seeds: Iterator[int]) -> None:
    for n, dtype, op in itertools.product((7, 2, 6), DTYPES, OPS):
        seed = next(seeds)
        name = f"reduce_scatter[n={n}, {op}, {dtype}]"
        t = exact_input(rank, (n, 3), dtype, seed)
        if op == "avg" and not dtype.is_floating_point:
            ck.raises(name, lambda t=t, op=op: CTX.reduce_scatter(t, op=op), r"int64", r"'sum'")
            continue
        full = reduce_reference([exact_input(r, (n, 3), dtype, seed) for r in range(k)], op)
        c = -(-n // k)
        lo, hi = rank * c, min(n, (rank + 1) * c)
        ck.true(name + " shard rows", max(0, hi - lo) == _SHARD_ROWS[(k, n)][rank], (lo, hi))
        out = CTX.reduce_scatter(t, op=op)
        ck.close(name, out, full[lo : max(lo, hi)], **_tol(op, dtype))
        ck.true(name + " input untouched", torch.equal(t, exact_input(rank, (n, 3), dtype, seed)))
    # 1-D input and the async form
    seed = next(seeds)
    t = exact_input(rank, (7,), torch.float32, seed)
    work = CTX.reduce_scatter(t, op="avg", async_op=True)
    ck.true("reduce_scatter async returns Work", isinstance(work, comms.Work), type(work))
    c = -(-7 // k)
    full = reduce_reference([exact_input(r, (7,), torch.float32, seed) for r in range(k)], "avg")
    ck.close(
        "reduce_scatter async 1-D avg",
        work.wait(),
        full[rank * c : min(7, (rank + 1) * c)],
        **_tol("avg", torch.float32),
    )


def _check_flat_fast_paths(ck: Checks, rank: int, k: int, seeds: Iterator[int]) -> None:
    for dtype, async_op in itertools.product((torch.float32, torch.int64), (False, True)):
        seed = next(seeds)
        name = f"all_gather_into[{dtype}, async={async_op}]"
        out = torch.full((k, 6), -99, dtype=dtype)
        res = CTX.all_gather_into(out, exact_input(rank, (2, 3), dtype, seed), async_op=async_op)
        res = res.wait() if async_op else res
        ck.true(name + " fills output", res is out, type(res))
        ref = torch.stack([exact_input(r, (2, 3), dtype, seed).reshape(-1) for r in range(k)])
        ck.close(name, out, ref, **EXACT)
    for dtype, op, async_op in itertools.product((torch.float32, torch.bfloat16, torch.int64), OPS, (False, True)):
        if op == "avg" and not dtype.is_floating_point:
            continue
        seed = next(seeds)
        name = f"reduce_scatter_into[{op}, {dtype}, async={async_op}]"
        out = torch.zeros(4, dtype=dtype)
        res = CTX.reduce_scatter_into(out, exact_input(rank, (4 * k,), dtype, seed), op=op, async_op=async_op)
        res = res.wait() if async_op else res
        ck.true(name + " fills output", res is out, type(res))
        full = reduce_reference([exact_input(r, (4 * k,), dtype, seed) for r in range(k)], op)
        ck.close(name, out, full[4 * rank : 4 * (rank + 1)], **_tol(op, dtype))


# --------------------------------------------------------------------------- data movement


def _obj(rank: int) -> dict[str, Any]:
    """A picklable object whose pickled size differs by rank."""
    return {"rank": rank, "items": list(range(rank * 7)), "name": "r" * (rank + 1), "nested": (rank, [None, 1.5])}


def _check_broadcast(ck: Checks, rank: int, k: int, seeds: Iterator[int]) -> None:
    for src, dtype, async_op in itertools.product((0, k - 1), (torch.float32, torch.int64), (False, True)):
        seed = next(seeds)
        name = f"broadcast tensor[src={src}, {dtype}, async={async_op}]"
        t = exact_input(rank, (4, 2), dtype, seed)
        res = CTX.broadcast(t, src=src, async_op=async_op)
        if async_op:
            ck.true(name + " returns Work", isinstance(res, comms.Work), type(res))
            res = res.wait()
        ck.true(name + " in place", res is t, type(res))
        ck.close(name, t, exact_input(src, (4, 2), dtype, seed), **EXACT)
    for src, async_op in itertools.product((0, k - 1), (False, True)):
        name = f"broadcast object[src={src}, async={async_op}]"
        res = CTX.broadcast(_obj(src) if rank == src else None, src=src, async_op=async_op)
        res = res.wait() if async_op else res
        ck.true(name, res == _obj(src), res)


def _scatter_chunk(r: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    # shapes differ in size *and* rank: (3,), (2, 2), (0,), (1, 1, 2)
    shape = [(3,), (2, 2), (0,), (1, 1, 2)][r % 4]
    return exact_input(r, shape, dtype, seed)


def _check_scatter(ck: Checks, rank: int, k: int, seeds: Iterator[int]) -> None:
    for src, dtype, async_op in itertools.product((0, k - 1), (torch.float32, torch.int64), (False, True)):
        seed = next(seeds)
        name = f"scatter tensors[src={src}, {dtype}, async={async_op}]"
        chunks = [_scatter_chunk(r, dtype, seed) for r in range(k)] if rank == src else None
        res = CTX.scatter(chunks, src=src, async_op=async_op)
        if async_op:
            ck.true(name + " returns Work", isinstance(res, comms.Work), type(res))
            res = res.wait()
        ck.close(name, res, _scatter_chunk(rank, dtype, seed), **EXACT)
    for src, async_op in itertools.product((0, k - 1), (False, True)):
        name = f"scatter objects[src={src}, async={async_op}]"
        chunks = [_obj(r) for r in range(k)] if rank == src else None
        res = CTX.scatter(chunks, src=src, async_op=async_op)
        res = res.wait() if async_op else res
        ck.true(name, res == _obj(rank), res)
    # a non-src rank's argument is ignored, even if it is not None
    ignored = ["junk"] * (k + 5)
    res = CTX.scatter([_obj(r) for r in range(k)] if rank == 0 else ignored, src=0)
    ck.true("scatter ignores non-src chunks", res == _obj(rank), res)


def _check_gather(ck: Checks, rank: int, k: int, seeds: Iterator[int]) -> None:
    def shape(r: int) -> tuple[int, ...]:
        return (r, 3)  # uneven first dim; rank 0 sends 0 rows

    for dst, dtype, async_op in itertools.product((0, k - 1), (torch.float32, torch.bfloat16), (False, True)):
        seed = next(seeds)
        name = f"gather[dst={dst}, {dtype}, async={async_op}]"
        refs = [exact_input(r, shape(r), dtype, seed) for r in range(k)]
        res = CTX.gather(exact_input(rank, shape(rank), dtype, seed), dst=dst, async_op=async_op)
        if async_op:
            ck.true(name + " returns Work", isinstance(res, comms.Work), type(res))
            res = res.wait()
        if rank == dst:
            ck.close(name, res, refs, **EXACT)
        else:
            ck.true(name + " non-dst gets None", res is None, res)
    for dst in (0, k - 1):  # gather_list given on dst: filled in place and returned
        seed = next(seeds)
        name = f"gather with gather_list[dst={dst}]"
        refs = [exact_input(r, shape(r), torch.float32, seed) for r in range(k)]
        gl = [torch.full(shape(r), float("nan")) for r in range(k)] if rank == dst else None
        res = CTX.gather(exact_input(rank, shape(rank), torch.float32, seed), gather_list=gl, dst=dst)
        if rank == dst:  # the very list passed in, filled
            ck.close(name, res if res is gl else f"not the given gather_list: {res}", refs, **EXACT)
        else:
            ck.true(name + " non-dst gets None", res is None, res)
    # 0-dim tensors come back 0-dim
    res = CTX.gather(torch.tensor(rank * 1.5), dst=k - 1)
    if rank == k - 1:
        ck.close("gather 0-dim", res, [torch.tensor(r * 1.5) for r in range(k)], **EXACT)
    else:
        ck.true("gather 0-dim non-dst", res is None, res)
    for dst, async_op in itertools.product((0, k - 1), (False, True)):
        name = f"gather_object[dst={dst}, async={async_op}]"
        res = CTX.gather_object(_obj(rank), dst=dst, async_op=async_op)
        res = res.wait() if async_op else res
        expected = [_obj(r) for r in range(k)] if rank == dst else None
        ck.true(name, res == expected, res)


def _check_all_gather(ck: Checks, rank: int, k: int, seeds: Iterator[int]) -> None:
    cases: list[tuple[str, Callable[[int], tuple[int, ...]], torch.dtype]] = [
        ("uneven, rank 0 empty, 2 trailing dims", lambda r: (r, 2, 3), torch.float32),
        ("uneven 1-D int64", lambda r: (2 * r + 1,), torch.int64),
        ("uneven bf16", lambda r: (r + 1, 4), torch.bfloat16),
        ("even", lambda r: (3, 2), torch.float32),
        ("0-dim fp32", lambda r: (), torch.float32),
        ("0-dim int64", lambda r: (), torch.int64),
        ("all empty", lambda r: (0, 5), torch.float32),
    ]
    for (label, shape, dtype), async_op in itertools.product(cases, (False, True)):
        seed = next(seeds)
        name = f"all_gather[{label}, async={async_op}]"
        refs = [exact_input(r, shape(r), dtype, seed) for r in range(k)]
        res = CTX.all_gather(exact_input(rank, shape(rank), dtype, seed), async_op=async_op)
        if async_op:
            ck.true(name + " returns Work", isinstance(res, comms.Work) and res.op == "all_gather", res)
            res = res.wait()
        ck.close(name, res, refs, **EXACT)
    for async_op in (False, True):
        res = CTX.all_gather_object(_obj(rank), async_op=async_op)
        res = res.wait() if async_op else res
        ck.true(f"all_gather_object async={async_op}", res == [_obj(r) for r in range(k)], res)


def _check_barrier_and_work(ck: Checks, rank: int, k: int) -> None:
    ck.true("barrier returns None", CTX.barrier() is None)
    work = CTX.barrier(async_op=True)
    ck.true("barrier async returns Work", isinstance(work, comms.Work) and work.op == "barrier", work)
    ck.true("barrier async wait", work.wait() is None and work.is_completed(), work)
    # several async ops in flight at once, waited in reverse order; sequence numbers increase
    t1, t2 = torch.full((3,), float(rank)), torch.full((2,), rank + 1, dtype=torch.int64)
    w1 = CTX.all_reduce(t1, async_op=True)
    w2 = CTX.all_reduce(t2, op="max", async_op=True)
    w3 = CTX.all_gather(torch.tensor([rank]), async_op=True)
    ck.true("seq increases", w1.seq < w2.seq < w3.seq, (w1, w2, w3))
    gathered = w3.wait()
    ck.close("in flight: all_gather", gathered, [torch.tensor([r]) for r in range(k)], **EXACT)
    ck.close("in flight: max", w2.wait(), torch.full((2,), k, dtype=torch.int64), **EXACT)
    # sum of 0..K-1 is a small integer: exact in fp32
    ck.close("in flight: sum", w1.wait(), torch.full((3,), float(k * (k - 1) // 2)), **EXACT)


# --------------------------------------------------------------------------- exact byte accounting


def _check_stats(ck: Checks, rank: int, k: int) -> None:
    def expect(label: str, op: str, nbytes: int, calls: int) -> None:
        got = CTX.observer[op]
        ck.true(
            f"stats {label}: {op}",
            (got.bytes, got.calls) == (nbytes, calls),
            f"(bytes, calls) = {(got.bytes, got.calls)}, expected {(nbytes, calls)}",
        )

    c7 = -(-7 // k)  # rows per reduce_scatter shard of 7 rows
    CTX.observer.reset()
    ck.true("stats empty after reset", CTX.observer.snapshot() == {}, CTX.observer.snapshot())
    CTX.all_reduce(torch.zeros(1000))  # 1000 fp32 = 4000 B
    CTX.all_reduce(torch.zeros(10, dtype=torch.bfloat16), op="max", async_op=True).wait()  # 20 B
    CTX.broadcast(torch.zeros(10, dtype=torch.int64), src=k - 1)  # 80 B
    CTX.all_gather(torch.zeros(rank + 1, 4))  # padded to K rows: K*4*4 B; + one metadata row
    CTX.gather(torch.zeros(rank + 1, 4, dtype=torch.float64), dst=0)  # padded: K*4*8 B; + metadata
    CTX.reduce_scatter(torch.zeros(7, 3))  # padded full input: K*c7 rows * 3 * 4 B
    CTX.reduce_scatter_into(torch.zeros(4), torch.zeros(4 * k))  # the full input: 16K B
    CTX.all_gather_into(torch.zeros(k, 5), torch.zeros(5))  # this rank's input: 20 B
    CTX.barrier()
    CTX.barrier(async_op=True).wait()
    expect("sequence", "all_reduce", 4000 + 20, 2)
    expect("sequence", "broadcast", 80, 1)
    expect("sequence", "all_gather", 16 * k + 20, 2)
    expect("sequence", "gather", 32 * k, 1)
    expect("sequence", "reduce_scatter", k * c7 * 12 + 16 * k, 2)
    expect("sequence", "barrier", 0, 2)
    # one shape row per uneven call: [dtype, ndim, 8 dims] = 10 int64 = 80 B; the fast paths send none
    expect("sequence", "metadata", 160, 2)
    total = 4020 + 80 + 16 * k + 20 + 32 * k + k * c7 * 12 + 16 * k + 160
    ck.true("stats total_bytes", CTX.observer.total_bytes == total, CTX.observer.total_bytes)
    ck.true(
        "stats ops",
        set(CTX.observer.snapshot())
        == {"all_reduce", "broadcast", "all_gather", "gather", "reduce_scatter", "barrier", "metadata"},
        sorted(CTX.observer.snapshot()),
    )

    # 0-dim all_gather sends 1 element; scatter records the padded chunk it receives (max numel = K)
    CTX.observer.reset()
    CTX.all_gather(torch.tensor(1.0))
    CTX.scatter([torch.zeros(r + 1) for r in range(k)] if rank == 0 else None, src=0)
    expect("0-dim", "all_gather", 4, 1)
    expect("scatter", "scatter", 4 * k, 1)
    # metadata: the all_gather's shape row, and scatter's header broadcast as its length, then its bytes
    ck.true("stats scatter metadata separate", CTX.observer["metadata"].calls == 3, CTX.observer["metadata"])

    # objects: the pickled payload (padded to the longest for all_gather), on every rank
    CTX.observer.reset()
    CTX.broadcast(_obj(k - 1) if rank == 0 else None, src=0)
    expect("object", "broadcast", len(pickle.dumps(_obj(k - 1), protocol=pickle.HIGHEST_PROTOCOL)), 1)
    CTX.observer.reset()
    CTX.all_gather_object(_obj(rank))
    longest = max(len(pickle.dumps(_obj(r), protocol=pickle.HIGHEST_PROTOCOL)) for r in range(k))
    expect("object", "all_gather", longest, 1)
    expect("object", "metadata", 80, 1)

    # ring algorithms: the wire bytes are the send/recv entries; the algorithm entry has 0 bytes
    for dtype, n in ((torch.float32, 12 * k), (torch.bfloat16, 6 * k), (torch.int64, 3 * k)):
        size = n * torch.tensor([], dtype=dtype).element_size()
        wire = 2 * (k - 1) * n // k * torch.tensor([], dtype=dtype).element_size()
        ck.true(f"ring bytes formula {dtype}", wire == ring_allreduce_bytes(size, k), (wire, size))
        CTX.observer.reset()
        seed = 1000 + n
        t = exact_input(rank, (n,), dtype, seed)
        A.ring_all_reduce(CTX, t)
        ref = reduce_reference([exact_input(r, (n,), dtype, seed) for r in range(k)], "sum")
        ck.close(f"ring_all_reduce result {dtype}", t, ref, **EXACT)
        expect(f"ring_all_reduce {dtype}", "send", wire, 2 * (k - 1))
        expect(f"ring_all_reduce {dtype}", "recv", wire, 2 * (k - 1))
        expect(f"ring_all_reduce {dtype}", "ring_all_reduce", 0, 1)
        ck.true(
            "ring_all_reduce uses only send/recv",
            set(CTX.observer.snapshot()) == {"send", "recv", "ring_all_reduce"},
            sorted(CTX.observer.snapshot()),
        )

        CTX.observer.reset()
        A.ring_reduce_scatter(CTX, exact_input(rank, (n,), dtype, seed))
        half = int(ring_shard_bytes(size, k))
        ck.true("ring shard formula", half == (k - 1) * size // k, half)
        expect(f"ring_reduce_scatter {dtype}", "send", half, k - 1)
        expect(f"ring_reduce_scatter {dtype}", "recv", half, k - 1)
        expect(f"ring_reduce_scatter {dtype}", "ring_reduce_scatter", 0, 1)

        CTX.observer.reset()
        A.ring_all_gather(CTX, exact_input(rank, (n // k,), dtype, seed))  # K shards make S bytes
        expect(f"ring_all_gather {dtype}", "send", half, k - 1)
        expect(f"ring_all_gather {dtype}", "recv", half, k - 1)
        expect(f"ring_all_gather {dtype}", "ring_all_gather", 0, 1)
    CTX.observer.reset()


def _busy(seconds: float) -> None:
    """Compute for at least ``seconds`` (the caller's own work while a call is in flight)."""
    a, t0 = torch.randn(64, 64), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ a


def _check_covered(ck: Checks, rank: int, k: int) -> None:
    """CommStats.covered_seconds: the caller's own time with an async call in flight. The bounds come from
    the order of clock reads around the calls, so they hold however slow the machine is."""
    stats = CTX.observer
    CTX.observer.reset()
    CTX.all_reduce(torch.ones(1000))  # synchronous: nothing stays in flight
    _busy(0.02)
    CTX.barrier()
    ck.true("covered: synchronous calls cover nothing", stats.covered_seconds() == 0.0, stats.covered_seconds())
    before = time.perf_counter()
    work = CTX.all_reduce(torch.ones(1000), async_op=True)
    issued = time.perf_counter()
    _busy(0.05)
    waiting = time.perf_counter()
    work.wait()
    after = time.perf_counter()
    covered = stats.covered_seconds()
    # the count runs from the end of the launch (before `issued`) to the start of the wait (after `waiting`)
    ck.true(
        "covered: at least the work done with the call in flight",
        covered >= waiting - issued,
        (covered, waiting - issued),
    )
    ck.true("covered: at most the call's whole life", covered <= after - before, (covered, after - before))
    _busy(0.02)  # nothing in flight any more
    ck.true(
        "covered: stops once the call is waited for",
        stats.covered_seconds() == covered,
        (stats.covered_seconds(), covered),
    )
    # a chained object call (a Work around a Work) completes its inner call once
    work = CTX.all_gather_object(rank, async_op=True)
    ck.true("covered: chained object call", work.wait() == list(range(k)), work)
    covered = stats.covered_seconds()
    _busy(0.02)
    ck.true(
        "covered: nothing left in flight after a chained call",
        stats.covered_seconds() == covered,
        (stats.covered_seconds(), covered),
    )

    # a launch that fails leaves nothing in flight, and neither does a wait that fails (no peer is involved:
    # both fail in this process before anything is sent)
    class Broken:
        def wait(self) -> None:
            raise RuntimeError("broken handle")

    def boom(blocking: bool) -> list[Any]:
        raise RuntimeError("launch failed")

    for label, launch in (("launch", boom), ("wait", lambda blocking: [Broken()])):
        try:
            CTX._issue("test_op", 0, launch, lambda: None, async_op=True).wait()
            ck.true(f"covered: failing {label} raises", False)
        except RuntimeError:
            pass
        covered = stats.covered_seconds()
        _busy(0.02)
        ck.true(
            f"covered: nothing in flight after a failing {label}",
            stats.covered_seconds() == covered,
            (stats.covered_seconds(), covered),
        )
    CTX.observer.reset()


# --------------------------------------------------------------------------- errors (on every rank)


def _check_errors(ck: Checks, rank: int, k: int) -> None:
    allowed = re.escape(str(list(range(k))))
    t = torch.ones(2)
    for count in (k + 1, k - 1):
        chunks = [torch.ones(1)] * count if rank == 0 else None
        # every rank raises, non-src ranks included, with both the count and the world size
        ck.raises(
            f"scatter with {count} chunks",
            lambda chunks=chunks: CTX.scatter(chunks, src=0),
            rf"\b{count} chunks\b",
            rf"world size is {k}\b",
        )
    objs = ["x"] * (k + 2) if rank == k - 1 else None
    ck.raises("scatter objects, wrong count", lambda: CTX.scatter(objs, src=k - 1), rf"\b{k + 2}\b", rf"\b{k}\b")
    ck.raises("scatter None on src", lambda: CTX.scatter(None, src=0), r"None", rf"\b{k}\b")
    mixed = [torch.ones(1), torch.ones(1, dtype=torch.int64)] + [torch.ones(1)] * (k - 2) if rank == 0 else None
    ck.raises("scatter mixed dtypes", lambda: CTX.scatter(mixed, src=0), r"dtype")

    ck.raises("broadcast src=K", lambda: CTX.broadcast(t, src=k), rf"src={k}\b", allowed)
    ck.raises("broadcast object src=-1", lambda: CTX.broadcast("x", src=-1), r"src=-1\b", allowed)
    ck.raises("scatter src=K", lambda: CTX.scatter(None, src=k), rf"src={k}\b", allowed)
    ck.raises("gather dst=K", lambda: CTX.gather(t, dst=k), rf"dst={k}\b", allowed)
    ck.raises("gather_object dst=-1", lambda: CTX.gather_object(1, dst=-1), r"dst=-1\b", allowed)
    ck.raises("send dst=K+3", lambda: CTX.send(t, dst=k + 3), rf"dst={k + 3}\b", allowed)

    ops = re.escape("['avg', 'max', 'min', 'sum']")
    ck.raises("all_reduce op=prod", lambda: CTX.all_reduce(t, op="prod"), r"'prod'", ops)
    ck.raises("all_reduce op=SUM", lambda: CTX.all_reduce(t, op="SUM", async_op=True), r"'SUM'", ops)
    ck.raises("reduce_scatter op=mean", lambda: CTX.reduce_scatter(t, op="mean"), r"'mean'", ops)
    ck.raises(
        "reduce_scatter_into op=product",
        lambda: CTX.reduce_scatter_into(torch.zeros(1), torch.zeros(k), op="product"),
        r"'product'",
        ops,
    )
    ck.raises(
        "all_gather_into wrong output",
        lambda: CTX.all_gather_into(torch.zeros(k * 3 + 1), torch.ones(3)),
        rf"\b{k * 3 + 1}\b",
        rf"\b{k * 3}\b",
    )
    ck.raises(
        "reduce_scatter_into wrong input",
        lambda: CTX.reduce_scatter_into(torch.zeros(2), torch.ones(5)),
        r"\b5\b",
        rf"\b{2 * k}\b",
    )

    # ranks disagreeing on trailing dims / ndim / dtype: ValueError on every rank, nobody hangs
    last = rank == k - 1
    ck.raises(
        "all_gather trailing dims",
        lambda: CTX.all_gather(torch.zeros(2, 4 if last else 3)),
        r"trailing",
        re.escape("(2, 3)"),
        re.escape("(2, 4)"),
    )
    ck.raises("all_gather ndim", lambda: CTX.all_gather(torch.zeros((2, 3, 1) if last else (2, 3))), r"trailing")
    mixed_dtype = torch.int64 if last else torch.float32
    ck.raises("all_gather dtype", lambda: CTX.all_gather(torch.zeros(2, dtype=mixed_dtype)), r"dtype")
    ck.raises("gather trailing dims", lambda: CTX.gather(torch.zeros(1, 2 if last else 5), dst=0), r"trailing")

    # a bad gather_list exists only on dst: dst raises after the collective, the others are not stranded
    bad_list = [torch.empty(2)] * (k + 1)
    if rank == 0:
        ck.raises(
            "gather_list wrong length",
            lambda: CTX.gather(t, gather_list=bad_list, dst=0),
            rf"\b{k + 1} tensors\b",
            rf"\b{k} ranks\b",
        )
        ck.raises(
            "gather_list wrong shape",
            lambda: CTX.gather(t, gather_list=[torch.empty(3)] * k, dst=0),
            r"\(3,\)",
            r"\(2,\)",
        )
    else:
        ck.true("gather from non-dst", CTX.gather(t, dst=0) is None)
        ck.true("gather from non-dst", CTX.gather(t, dst=0) is None)

    # after all the errors, the ranks are still in step: a real collective gives the right answer
    # (sum of ones over K ranks: a small integer, exact in fp32)
    ck.close("collective after errors", CTX.all_reduce(torch.ones(3)), torch.full((3,), float(k)), **EXACT)


# --------------------------------------------------------------------------- spawned workers


def _worker(rank: int, k: int) -> tuple[list[str], int]:
    ck, seeds = Checks(), itertools.count(1)
    ck.true("world size", comms.get_world_size() == k and comms.get_rank() == rank, (comms.get_rank(), k))
    ck.true("group ranks", comms.group_ranks() == list(range(k)), comms.group_ranks())
    _check_all_reduce(ck, rank, k, seeds)
    _check_reduce_scatter(ck, rank, k, seeds)
    _check_flat_fast_paths(ck, rank, k, seeds)
    _check_broadcast(ck, rank, k, seeds)
    _check_scatter(ck, rank, k, seeds)
    _check_gather(ck, rank, k, seeds)
    _check_all_gather(ck, rank, k, seeds)
    _check_barrier_and_work(ck, rank, k)
    _check_stats(ck, rank, k)
    _check_covered(ck, rank, k)
    _check_errors(ck, rank, k)
    return ck.failures, ck.count


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_against_reference(world_size: int) -> None:
    """Every collective (sync and async), exact CommStats byte counts, and the errors, in one spawned run."""
    results = run_distributed(_worker, world_size, timeout=RUN_TIMEOUT_S)
    assert_all_ranks_passed(results, min_checks=300)
