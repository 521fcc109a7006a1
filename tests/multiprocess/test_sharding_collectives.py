"""FlatShard's all-gather and reduce-scatter over real gloo ranks, against a plain-torch reference."""

from __future__ import annotations

import pytest
import torch

from lightning_sync.sync import FlatShard, ProcessGroupCommunicator
from lightning_sync.testing import Checks, assert_all_ranks_passed, exact_input, run_distributed

SHAPES = [(3, 5), (7,), (2, 2, 2), (1,)]  # 31 elements, not divisible by 2 or 3


def _worker(rank: int, world: int) -> tuple[list[str], int]:
    ck, comm = Checks(), ProcessGroupCommunicator()
    fs = FlatShard(SHAPES, world, rank)
    params = {r: [exact_input(r, s, torch.float32, seed=i + 1) for i, s in enumerate(SHAPES)] for r in range(world)}
    flats = {r: fs.flatten(params[r]) for r in range(world)}
    # all-gather of every rank's shard of its own flat: the full buffer is made of the K shards
    full = fs.all_gather(fs.shard(flats[rank]), comm)
    want = torch.cat([FlatShard(SHAPES, world, r).shard(flats[r]) for r in range(world)])
    ck.close("all_gather of shards", full, want)  # exact: data movement
    # async variant returns a Work whose result is the same buffer
    ck.close("all_gather async", fs.all_gather(fs.shard(flats[rank]), comm, async_op=True).wait(), want)
    # reduce-scatter: rank r gets the sum (or average) of every rank's flat over its shard
    total = sum(flats.values())
    ck.close("reduce_scatter sum", fs.reduce_scatter(flats[rank], comm, op="sum"), total[fs.start : fs.end])
    # avg: one fp32 rounding of an exact sum divided by K
    ck.close("reduce_scatter avg", fs.reduce_scatter(flats[rank], comm, op="avg"),
             total[fs.start : fs.end] / world, rtol=1e-6, atol=1e-7)
    ck.true("padding stays zero", bool(full[fs.total :].eq(0).all()) if fs.padding else True)
    # scratch=True (gloo: one reduce per owner, the input used as scratch): same results, every op
    for op, want_op in (("sum", total), ("avg", total / world),
                        ("max", torch.stack(list(flats.values())).amax(0)),
                        ("min", torch.stack(list(flats.values())).amin(0))):
        out = torch.empty(fs.shard_numel)
        work = comm.reduce_scatter_into(out, flats[rank].clone(), op=op, async_op=True, scratch=True)
        ck.close(f"reduce_scatter_into scratch {op}", work.wait(), want_op[fs.start : fs.end], rtol=1e-6, atol=1e-7)
    bf16 = {r: f.to(torch.bfloat16) for r, f in flats.items()}
    out = torch.empty(fs.shard_numel, dtype=torch.bfloat16)
    comm.reduce_scatter_into(out, bf16[rank].clone(), op="sum", scratch=True)
    # bf16: the sum of K bf16 values rounded to bf16 once per addition -> 2 ulps (2**-7 relative)
    ck.close("reduce_scatter_into scratch bf16", out.float(), sum(b.float() for b in bf16.values())[fs.start : fs.end],
             rtol=2 ** -6, atol=1e-2)
    return ck.failures, ck.count


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 3])
def test_flat_shard_collectives_match_reference(world: int) -> None:
    assert_all_ranks_passed(run_distributed(_worker, world, timeout=120), min_checks=10)
