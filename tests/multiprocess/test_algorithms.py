"""Ring and tree algorithms (lightning_sync.comms.algorithms) on 2, 3 and 4 gloo ranks.

Each result is compared twice: with the backend's own ``comms.all_reduce`` (reduce_scatter,
all_gather_into) on the same inputs, and with a plain-torch reference that every rank computes
locally from the deterministic inputs of all ranks. One spawned run per world size performs every
check and returns the mismatches; the parent asserts there are none. Comparisons inside a rank
never raise, so a wrong result on one rank cannot leave the others blocked in the next collective.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_sync import comms
from lightning_sync.comms import algorithms as A
from lightning_sync.testing import Checks, assert_all_ranks_passed, exact_input, reduce_reference, run_distributed

__all__: list[str] = []

# The communication context of this process's checks (a strategy owns one the same way).
CTX = comms.CommContext(observer=comms.CommStats())

OPS = ("sum", "avg", "max", "min")
RUN_TIMEOUT_S = 150  # hard limit for one spawned run (start-up ~3 s/rank, checks a few seconds)


def _tol(op: str) -> dict[str, float]:
    """sum/max/min are exact (exact sums, see :func:`~lightning_sync.testing.exact_input`; max/min
    pick an input; int64 is exact). avg divides the exact sum by K in fp32: one rounding, <= 2^-24
    relative; rtol 1e-6 is headroom."""
    return {"rtol": 1e-6, "atol": 1e-7} if op == "avg" else {"rtol": 0.0, "atol": 0.0}


_ALGOS: dict[str, Callable[..., torch.Tensor]] = {
    "ring": lambda t, op, group: A.ring_all_reduce(CTX, t, op=op, group=group),
    "tree": lambda t, op, group: A.tree_all_reduce(CTX, t, op=op, group=group),
    "with(ring)": lambda t, op, group: A.all_reduce_with(CTX, "ring", t, op=op, group=group),
    "with(tree)": lambda t, op, group: A.all_reduce_with(CTX, "tree", t, op=op, group=group),
    "with(backend)": lambda t, op, group: A.all_reduce_with(CTX, "backend", t, op=op, group=group),
    # the same through a view of the context bound to the group (CommContext.bound): the group is the view's
    "bound(backend)": lambda t, op, group: CTX.bound(group=group).all_reduce(t, op=op),
    "bound(ring)": lambda t, op, group: CTX.bound(group=group, algorithm="ring").all_reduce(t, op=op),
    "bound(tree)": lambda t, op, group: CTX.bound(group=group, algorithm="tree").all_reduce(t, op=op),
}


def _check_all_reduces(
    ck: Checks, me: int, members: list[int], group: Any, label: str, shapes: list[tuple[int, ...]], seed0: int
) -> int:
    """All-reduce algorithms over ``members`` (global ranks; ``me`` is this rank's global rank)."""
    seed = seed0
    for shape, dtype, op in itertools.product(shapes, (torch.float32, torch.int64), OPS):
        seed += 1
        ref = (
            None
            if (op == "avg" and dtype == torch.int64)
            else reduce_reference([exact_input(r, shape, dtype, seed) for r in members], op)
        )
        backend = None
        if ref is not None:
            backend = CTX.all_reduce(exact_input(me, shape, dtype, seed), op=op, group=group)
            ck.close(f"{label} backend all_reduce{shape}[{op}, {dtype}]", backend, ref, **_tol(op))
        for name, algo in _ALGOS.items():
            case = f"{label} {name}{shape}[{op}, {dtype}]"
            t = exact_input(me, shape, dtype, seed)
            if ref is None:  # avg of integers: same ValueError as the backend path, before any send
                ck.raises(
                    case,
                    lambda algo=algo, t=t, op=op: algo(t, op=op, group=group),
                    r"int64",
                    r"'max'",
                    r"'min'",
                    r"'sum'",
                )
                continue
            out = algo(t, op=op, group=group)
            ck.true(case + " in place", out is t, type(out))
            ck.close(case + " vs reference", t, ref, **_tol(op))
            ck.close(case + " vs backend", t, backend, **_tol(op))
    return seed


def _check_ring_pieces(
    ck: Checks, me: int, members: list[int], group: Any, label: str, sizes: list[int], seed0: int
) -> int:
    """ring_reduce_scatter vs comms.reduce_scatter (same chunking), ring_all_gather vs all_gather_into."""
    seed, k, pos = seed0, len(members), members.index(me)
    for n, dtype, op in itertools.product(sizes, (torch.float32, torch.int64), OPS):
        if op == "avg" and dtype == torch.int64:
            continue
        seed += 1
        case = f"{label} ring_reduce_scatter(n={n})[{op}, {dtype}]"
        full = reduce_reference([exact_input(r, (n,), dtype, seed) for r in members], op)
        c = -(-n // k)  # chunk r is elements [r*c, min(n, (r+1)*c)) of the flattened tensor
        expected = full[pos * c : max(pos * c, min(n, (pos + 1) * c))]
        out = A.ring_reduce_scatter(CTX, exact_input(me, (n,), dtype, seed), op=op, group=group)
        ck.close(case + " vs reference", out, expected, **_tol(op))
        backend = CTX.reduce_scatter(exact_input(me, (n,), dtype, seed), op=op, group=group)
        ck.close(case + " vs backend", out, backend, **_tol(op))
    # a 2-D input is flattened first
    seed += 1
    full = reduce_reference([exact_input(r, (3, 5), torch.float32, seed) for r in members], "sum").reshape(-1)
    c = -(-15 // k)
    out = A.ring_reduce_scatter(CTX, exact_input(me, (3, 5), torch.float32, seed), group=group)
    ck.close(f"{label} ring_reduce_scatter 2-D", out, full[pos * c : min(15, (pos + 1) * c)], **_tol("sum"))
    for m, dtype in itertools.product((1, 4), (torch.float32, torch.int64)):
        seed += 1
        case = f"{label} ring_all_gather(m={m})[{dtype}]"
        ref = torch.stack([exact_input(r, (m,), dtype, seed) for r in members])
        out = A.ring_all_gather(CTX, exact_input(me, (m,), dtype, seed), group=group)
        ck.close(case + " vs reference", out, ref, rtol=0.0, atol=0.0)  # pure data movement: bit-exact
        backend = CTX.all_gather_into(torch.empty(k, m, dtype=dtype), exact_input(me, (m,), dtype, seed), group=group)
        ck.close(case + " vs backend", out, backend, rtol=0.0, atol=0.0)
    return seed


def _check_tree_traffic(ck: Checks, me: int, members: list[int], group: Any, label: str) -> dict[str, int]:
    """This rank's tree send/recv bytes; the parent checks the totals (each tree edge carries S twice)."""
    CTX.observer.reset()
    t = torch.zeros(10)  # S = 40 bytes
    A.tree_all_reduce(CTX, t, group=group)
    stats = CTX.observer
    ck.true(
        f"{label} tree entry has 0 bytes",
        stats["tree_all_reduce"].bytes == 0 and stats["tree_all_reduce"].calls == 1,
        stats["tree_all_reduce"],
    )
    out = {"send": stats["send"].bytes, "recv": stats["recv"].bytes}
    CTX.observer.reset()
    return out


def _neighbour_seqs(me: int, members: list[int], group: Any) -> tuple[int, int]:
    """The context's next point-to-point sequence numbers on ``group``: a send to the next member and a receive
    from the previous one (every member does the same, so they pair up)."""
    pos = members.index(me)
    nxt, prv = members[(pos + 1) % len(members)], members[(pos - 1) % len(members)]
    send = CTX.send(torch.ones(1), nxt, group=group, async_op=True)
    recv = CTX.recv(torch.empty(1), prv, group=group, async_op=True)
    send.wait(), recv.wait()
    return send.seq, recv.seq


def _check_bound_view(ck: Checks, me: int, members: list[int], group: Any, label: str, seed: int) -> None:
    """A bound view is the context's: its calls take the context's sequence numbers and are recorded in its
    observer; its other collectives default to its group (checked against plain-torch references, exact)."""
    k, pos = len(members), members.index(me)
    view = CTX.bound(group=group, algorithm="ring")
    ck.true(f"{label} bound rank/world_size", (view.rank, view.world_size) == (pos, k), (view.rank, view.world_size))
    ck.true(f"{label} bound observer is the context's", view.observer is CTX.observer)
    # the backend's all-reduce through the view takes the next number of the context's counter for the group
    a = CTX.all_reduce(torch.ones(3), group=group, async_op=True)
    b = CTX.bound(group=group).all_reduce(torch.ones(3), async_op=True)
    c = CTX.all_reduce(torch.ones(3), group=group, async_op=True)
    out = [w.wait() for w in (a, b, c)]
    ck.true(f"{label} bound backend shares the sequence numbers", (b.seq, c.seq) == (a.seq + 1, a.seq + 2), [a, b, c])
    ck.close(f"{label} bound backend async result", out[1], torch.full((3,), float(k)), rtol=0.0, atol=0.0)
    # the ring through the view: 2(K-1) sends and 2(K-1) receives on the context's point-to-point counter, and
    # its entry and its send bytes in the context's observer (2(K-1) chunks of ceil(n/K) fp32 elements)
    n = 3 * k + 1
    before = _neighbour_seqs(me, members, group)
    CTX.observer.reset()
    t = exact_input(me, (n,), torch.float32, seed)
    work = view.all_reduce(t, async_op=True)  # written out: complete when it returns
    stats = CTX.observer
    ring_bytes = 2 * (k - 1) * -(-n // k) * 4
    got = (stats["ring_all_reduce"].calls, stats["send"].bytes, stats["recv"].bytes)
    ck.true(f"{label} bound ring recorded in the context's observer", got == (1, ring_bytes, ring_bytes), got)
    ck.true(f"{label} bound ring async is complete", work.is_completed() and work.wait() is t, work)
    ref = reduce_reference([exact_input(r, (n,), torch.float32, seed) for r in members], "sum")
    ck.close(f"{label} bound ring vs reference", t, ref, rtol=0.0, atol=0.0)  # exact sums (exact_input)
    after = _neighbour_seqs(me, members, group)
    ck.true(
        f"{label} bound ring shares the point-to-point numbers",
        after[0] == before[0] + 2 + 4 * (k - 1),
        (before, after),
    )
    CTX.observer.reset()
    # the other collectives default to the view's group: data movement, exact
    ck.true(f"{label} bound all_gather_object", view.all_gather_object(me) == members, members)
    got_src = view.broadcast_object(me if pos == 0 else None, src=members[0])
    ck.true(f"{label} bound broadcast_object", got_src == members[0], got_src)
    gathered = view.all_gather_into(torch.empty(k, 2), exact_input(me, (2,), torch.float32, seed + 1))
    want = torch.stack([exact_input(r, (2,), torch.float32, seed + 1) for r in members])
    ck.close(f"{label} bound all_gather_into", gathered, want, rtol=0.0, atol=0.0)


def _worker(rank: int, k: int) -> tuple[list[str], int, dict[str, Any]]:
    ck = Checks()
    everyone = list(range(k))
    # sizes that divide by K, do not divide, are smaller than K, a 0-dim and a 2-D tensor
    shapes = sorted({(1,), (k - 1,), (3 * k,), (3 * k + 1,), (), (2, 5)} - {(0,)})
    seed = _check_all_reduces(ck, rank, everyone, None, f"world{k}", shapes, 0)
    seed = _check_ring_pieces(ck, rank, everyone, None, f"world{k}", sorted({1, k - 1, 4 * k, 4 * k + 1}), seed)
    traffic = {"world": _check_tree_traffic(ck, rank, everyone, None, f"world{k}")}
    _check_bound_view(ck, rank, everyone, None, f"world{k}", 5_000)

    ck.raises(
        "unknown algorithm",
        lambda: A.all_reduce_with(CTX, "allgather", torch.ones(2)),
        r"'allgather'",
        re.escape("['backend', 'hierarchical', 'ring', 'tree']"),
    )
    ck.raises(
        "unknown op in ring",
        lambda: A.ring_all_reduce(CTX, torch.ones(2), op="prod"),
        r"'prod'",
        re.escape("['avg', 'max', 'min', 'sum']"),
    )
    ck.raises("unknown op in tree", lambda: A.tree_all_reduce(CTX, torch.ones(2), op="mean"), r"'mean'")

    # sub-groups: every rank must call new_group, only members use it
    subgroups = [[0, 2]] if k == 3 else [[0, 2], [1, 2, 3]] if k == 4 else []
    for index, members in enumerate(subgroups):
        group = dist.new_group(members)
        seed = 10_000 * (index + 1)  # the same seeds on every member, whatever the others did before
        if rank not in members:
            continue
        label = f"world{k} group{members}"
        ck.true(label + " ranks", comms.group_ranks(group) == members, comms.group_ranks(group))
        sub_shapes = [(1,), (2 * len(members),), (2 * len(members) + 1,)]
        seed = _check_all_reduces(ck, rank, members, group, label, sub_shapes, seed)
        seed = _check_ring_pieces(ck, rank, members, group, label, [1, 5], seed)
        traffic[str(members)] = _check_tree_traffic(ck, rank, members, group, label)
        _check_bound_view(ck, rank, members, group, label, seed + 1)
    # all ranks still in step after the sub-group work (sum of ones: exact)
    ck.close("final all_reduce", CTX.all_reduce(torch.ones(2)), torch.full((2,), float(k)), rtol=0.0, atol=0.0)
    return ck.failures, ck.count, traffic


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_algorithms_match_backend_and_reference(world_size: int) -> None:
    results = run_distributed(_worker, world_size, timeout=RUN_TIMEOUT_S)
    # sub-group checks run on members only, so the ranks' check counts differ
    assert_all_ranks_passed(results, min_checks=150, same_count=False)
    # tree traffic: each of the K-1 tree edges carries the 40-byte tensor up once and down once, so
    # over all ranks send == recv == 2 * (K-1) * 40 bytes (exact integer accounting)
    groups = {
        "world": list(range(world_size)),
        **{str(m): m for m in ([[0, 2]] if world_size == 3 else [[0, 2], [1, 2, 3]] if world_size == 4 else [])},
    }
    for key, members in groups.items():
        per_rank = [results[r][2][key] for r in members]
        assert all(key not in results[r][2] for r in range(world_size) if r not in members)
        expected = 2 * (len(members) - 1) * 40
        assert sum(t["send"] for t in per_rank) == expected, (key, per_rank)
        assert sum(t["recv"] for t in per_rank) == expected, (key, per_rank)
        # the root (first member) only sends down and receives up: (#children) * 40 each way
        root_children = min(2, len(members) - 1)
        assert per_rank[0] == {"send": root_children * 40, "recv": root_children * 40}, (key, per_rank)
