"""Hierarchical all-reduce on 4 gloo ranks laid out as 2 nodes x 2 (ranks 0-1 and 2-3), against the flat
all-reduce; CommStats splits intra-node from inter-node bytes; BucketedDDP trains with it like the
single-process reference. (The same on real Slurm, 2 nodes x 2 tasks: tests/slurm/test_sbatch.py.)"""

from __future__ import annotations

import pytest
import torch
from _lightning_reference import ENV, EQ_TOL, _check_against, _quiet_rank, _reference, _state, _TiedModule, _trainer

from lightning_sync import BucketedDDPStrategy, comms
from lightning_sync.comms.algorithms import hierarchical_all_reduce
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

# The communication context of this process's checks (a strategy owns one the same way).
CTX = comms.CommContext(observer=comms.CommStats())


def _check_bound_view(ck: Checks, rank: int) -> None:
    """``CTX.bound(algorithm="hierarchical")``: its node groups are built when the view is made (collectively,
    outside any backward) and are the context's own; its all-reduce equals the flat one exactly (the integer-valued
    data of the first checks) and records its bytes in the context's observer, split as the function's are."""
    ck.true("[bound] no node groups before the view", not CTX._node_groups, list(CTX._node_groups))
    view = CTX.bound(algorithm="hierarchical", ranks_per_node=2)
    ck.true("[bound] the view built the context's node groups", list(CTX._node_groups) == [2], list(CTX._node_groups))
    for op in ("sum", "avg", "max", "min"):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            if op == "avg" and dtype == torch.int64:
                continue
            base = (torch.arange(37) * (rank + 1) % 11).to(dtype)
            flat, mine = base.clone(), base.clone()
            CTX.all_reduce(flat, op=op)
            out = view.all_reduce(mine, op=op)
            ck.close(f"[bound {op} {dtype}] view equals flat", mine.float(), flat.float(), rtol=0.0, atol=0.0)
            ck.true(f"[bound {op} {dtype}] in place", out is mine, type(out))
    CTX.observer.reset()
    payload = torch.ones(1000)
    work = view.all_reduce(payload, op="sum", async_op=True)  # written out: complete when it returns
    ck.true("[bound] async is complete", work.is_completed() and work.wait() is payload, work)
    stats = CTX.observer.snapshot()
    got = {op: stats[op].bytes for op in stats if op.startswith(("intra_node/", "inter_node/"))}
    want = {"intra_node/reduce": 4000, "intra_node/broadcast": 4000}
    if rank in (0, 2):  # the node leaders
        want["inter_node/all_reduce"] = 4000
    ck.true(f"[bound bytes] rank {rank}: in the context's observer, intra and inter apart", got == want, got)
    ck.close("[bound bytes] the sum", payload, torch.full((1000,), 4.0), rtol=0.0, atol=0.0)
    ck.true("[bound release] the context releases the view's layout", CTX.release_node_groups() == 1)


def _worker(rank: int, world: int) -> tuple[list[str], int]:
    _quiet_rank()
    ck = Checks()
    # integer-valued data: every summation order gives the same float, so equality is exact
    for op in ("sum", "avg", "max", "min"):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            if op == "avg" and dtype == torch.int64:
                continue
            base = (torch.arange(37) * (rank + 1) % 11).to(dtype)
            flat, mine = base.clone(), base.clone()
            CTX.all_reduce(flat, op=op)
            hierarchical_all_reduce(CTX, mine, op=op, ranks_per_node=2)
            ck.close(f"[{op} {dtype}] hierarchical equals flat", mine.float(), flat.float(), rtol=0.0, atol=0.0)
    CTX.observer.reset()
    payload = torch.ones(1000)
    hierarchical_all_reduce(CTX, payload, op="sum", ranks_per_node=2)
    stats = CTX.observer.snapshot()
    got = {op: stats[op].bytes for op in stats if op.startswith(("intra_node/", "inter_node/"))}
    leader = rank in (0, 2)
    want = {
        "intra_node/reduce": 4000,
        "intra_node/broadcast": 4000,
        **({"inter_node/all_reduce": 4000} if leader else {}),
    }
    ck.true(f"[bytes] rank {rank}: intra-node and inter-node traffic apart", got == want, got)
    ck.close("[bytes] the sum", payload, torch.full((1000,), 4.0), rtol=0.0, atol=0.0)
    ck.true("[release] this context's one layout", CTX.release_node_groups() == 1)
    _check_bound_view(ck, rank)
    # BucketedDDP selects it: 4 ranks of one Lightning node (devices=4) against the single-process
    # reference; within EQ_TOL for the summation order of a reduce then broadcast
    module = _TiedModule("sgd")
    init = _state(module)
    ref = _reference(_TiedModule("sgd"), module.ds, world, steps=4)["state"]
    strategy = BucketedDDPStrategy(comm_algorithm="hierarchical", bucket_cap_mb=0.004, first_bucket_mb=0.004)
    _trainer(world, strategy, max_steps=4).fit(module)
    _check_against(ck, "[bucketed_ddp hierarchical]", module, ref, init, tol=EQ_TOL)
    # its teardown destroyed the sub-groups it built: none is cached, none left in torch's registry
    pgs = torch.distributed.distributed_c10d._world.pg_map
    ck.true("[teardown] no cached node groups", not strategy.comm._node_groups, list(strategy.comm._node_groups))
    ck.true("[teardown] only the default group is left", list(pgs) == [torch.distributed.group.WORLD], len(pgs))
    # a later hierarchical all-reduce builds a fresh layout (2 nodes of 2 again) and is still exact
    again, flat = torch.arange(5.0) * (rank + 1), torch.arange(5.0) * (rank + 1)
    hierarchical_all_reduce(CTX, again, op="sum", ranks_per_node=2)
    CTX.all_reduce(flat, op="sum")
    ck.close("[rebuilt] hierarchical equals flat", again, flat, rtol=0.0, atol=0.0)
    ck.true("[release] counts the one rebuilt layout", CTX.release_node_groups() == 1)
    return ck.failures, ck.count


@pytest.mark.timeout(200)
def test_hierarchical_equals_flat_and_splits_its_bytes() -> None:
    bound_checks = 28  # _check_bound_view's
    assert_all_ranks_passed(run_distributed(_worker, 4, timeout=160, env=ENV), min_checks=21 + bound_checks)


@pytest.mark.parametrize("bad", ["butterfly", None, 2])
def test_unknown_algorithm_is_named(bad: object) -> None:
    with pytest.raises(ValueError, match="comm_algorithm"):
        BucketedDDPStrategy(comm_algorithm=bad)
