"""All-gather and reduce-scatter of FlatShard buffers over real gloo ranks, against a plain-torch reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_sync import comms
from lightning_sync.comms import collectives as C
from lightning_sync.sync import FlatShard
from lightning_sync.testing import Checks, assert_all_ranks_passed, exact_input, run_distributed

# The communication context of this process's checks (a strategy owns one the same way).
CTX = comms.CommContext(observer=comms.CommStats())

SHAPES = [(3, 5), (7,), (2, 2, 2), (1,)]  # 31 elements, not divisible by 2 or 3


def _worker(rank: int, world: int) -> tuple[list[str], int]:
    ck, comm = Checks(), CTX
    fs = FlatShard(SHAPES, world, rank)
    params = {r: [exact_input(r, s, torch.float32, seed=i + 1) for i, s in enumerate(SHAPES)] for r in range(world)}
    flats = {r: fs.flatten(params[r]) for r in range(world)}
    # all-gather of every rank's shard of its own flat: the full buffer is made of the K shards
    full = comm.all_gather_into(fs.new_buffer(torch.float32), fs.shard(flats[rank]))
    want = torch.cat([FlatShard(SHAPES, world, r).shard(flats[r]) for r in range(world)])
    ck.close("all_gather of shards", full, want)  # exact: data movement
    # async variant returns a Work whose result is the same buffer
    gathered = comm.all_gather_into(fs.new_buffer(torch.float32), fs.shard(flats[rank]), async_op=True)
    ck.close("all_gather async", gathered.wait(), want)
    # reduce-scatter: rank r gets the sum (or average) of every rank's flat over its shard
    total = sum(flats.values())
    shard = torch.empty(fs.shard_numel)
    ck.close("reduce_scatter sum", comm.reduce_scatter_into(shard, flats[rank], op="sum"), total[fs.start : fs.end])
    # avg: one fp32 rounding of an exact sum divided by K
    ck.close(
        "reduce_scatter avg",
        comm.reduce_scatter_into(torch.empty(fs.shard_numel), flats[rank], op="avg"),
        total[fs.start : fs.end] / world,
        rtol=1e-6,
        atol=1e-7,
    )
    ck.true("padding stays zero", bool(full[fs.total :].eq(0).all()) if fs.padding else True)
    # both gloo paths, same results for every op: the pairwise exchange (chunks of at least the context's
    # gloo_exchange_min_chunk_bytes; 0 by default) and gloo's own ops (a threshold no chunk reaches)
    default = CTX.settings
    for path, threshold in (("exchange", 0), ("gloo", 2**40)):
        CTX.settings = dataclasses.replace(default, gloo_exchange_min_chunk_bytes=threshold)
        ck.close(f"all_gather {path}", comm.all_gather_into(fs.new_buffer(torch.float32), fs.shard(flats[rank])), want)
        for op, want_op in (
            ("sum", total),
            ("avg", total / world),
            ("max", torch.stack(list(flats.values())).amax(0)),
            ("min", torch.stack(list(flats.values())).amin(0)),
        ):
            out, given = torch.empty(fs.shard_numel), flats[rank].clone()
            work = comm.reduce_scatter_into(out, given, op=op, async_op=True)
            # avg: one fp32 rounding of the sum, one of the division (exact_input's values sum exactly)
            ck.close(f"reduce_scatter_into {path} {op}", work.wait(), want_op[fs.start : fs.end], rtol=1e-6, atol=1e-7)
            ck.close(f"reduce_scatter_into {path} {op}: input unchanged", given, flats[rank])  # exact: only read
        bf16 = {r: f.to(torch.bfloat16) for r, f in flats.items()}
        out = torch.empty(fs.shard_numel, dtype=torch.bfloat16)
        comm.reduce_scatter_into(out, bf16[rank].clone(), op="sum")
        # bf16: the sum of K bf16 values rounded to bf16 once per addition -> 2 ulps (2**-7 relative)
        ck.close(
            f"reduce_scatter_into {path} bf16",
            out.float(),
            sum(b.float() for b in bf16.values())[fs.start : fs.end],
            rtol=2**-6,
            atol=1e-2,
        )
    # coalesced: several units' flats in one call each way, on both paths, equal to one call per flat (data
    # movement and the same per-element reductions: exact), counted as one call with the bytes of all
    units = [FlatShard(s, world, rank) for s in (SHAPES, [(4, 4)], [(5,), (2, 3)])]
    unit_flats = {
        r: [u.flatten([exact_input(r, t, torch.float32, seed=9 + j) for t in u.shapes]) for j, u in enumerate(units)]
        for r in range(world)
    }
    for path, threshold in (("exchange", 0), ("gloo", 2**40)):
        CTX.settings = dataclasses.replace(default, gloo_exchange_min_chunk_bytes=threshold)
        before = CTX.observer.snapshot()
        outs = [u.new_buffer(torch.float32) for u in units]
        work = comm.all_gather_into_coalesced(
            outs, [u.shard(f) for u, f in zip(units, unit_flats[rank])], async_op=True
        )
        got = work.wait()
        ck.true(f"all_gather coalesced {path} returns the outputs", all(g is o for g, o in zip(got, outs)), got)
        for j, u in enumerate(units):
            ref = torch.cat([FlatShard(u.shapes, world, r).shard(unit_flats[r][j]) for r in range(world)])
            ck.close(f"all_gather coalesced {path} unit {j}", outs[j], ref)
        reduced = [torch.empty(u.shard_numel) for u in units]
        comm.reduce_scatter_into_coalesced(reduced, unit_flats[rank], op="avg")
        for j, u in enumerate(units):
            one = comm.reduce_scatter_into(torch.empty(u.shard_numel), unit_flats[rank][j], op="avg")
            ck.close(f"reduce_scatter coalesced {path} unit {j}", reduced[j], one, rtol=0, atol=0)
        after = CTX.observer.snapshot()
        for op, calls, size in (
            ("all_gather", 1, sum(u.shard_numel * 4 for u in units)),
            ("reduce_scatter", 1 + len(units), 2 * sum(u.padded * 4 for u in units)),
        ):
            delta = (after[op].calls - before[op].calls, after[op].bytes - before[op].bytes)
            ck.true(f"coalesced {path} {op}: calls and bytes", delta == (calls, size), delta)
    CTX.settings = default
    # the path by chunk size: the exchange from a chunk of exactly the threshold, gloo's op one element below,
    # told apart by the point-to-point sends each issues; the sums against a reference (small integers: exact)
    threshold = 4096
    CTX.settings = dataclasses.replace(default, gloo_exchange_min_chunk_bytes=threshold)
    sends: list[int] = []
    real_isend = C.dist.isend
    C.dist.isend = lambda *a, **kw: sends.append(1) or real_isend(*a, **kw)  # this rank's process only
    try:
        for n, want_sends in ((threshold // 4, world - 1), (threshold // 4 - 1, 0)):
            sends.clear()
            out = torch.empty(n)
            comm.reduce_scatter_into(out, torch.arange(n * world, dtype=torch.float32).remainder(97) + rank, op="sum")
            want_big = sum(torch.arange(n * world, dtype=torch.float32).remainder(97) + r for r in range(world))
            ck.close(f"reduce_scatter_into chunk {4 * n} B", out, want_big[rank * n : (rank + 1) * n])
            ck.true(f"reduce_scatter_into chunk {4 * n} B: {want_sends} sends", len(sends) == want_sends, len(sends))
    finally:
        C.dist.isend = real_isend
        CTX.settings = default
    return ck.failures, ck.count


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 3])
def test_flat_shard_collectives_match_reference(world: int) -> None:
    assert_all_ranks_passed(run_distributed(_worker, world, timeout=120), min_checks=10)
