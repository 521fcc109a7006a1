"""Single-process tests of lightning_sync.comms: the no-process-group errors, CommStats and the cost model.

Nothing here spawns a rank; the multi-process behaviour is in tests/multiprocess/.
"""

from __future__ import annotations

import inspect
import math
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_sync import comms
from lightning_sync.bench.formulas import (
    overlapped_step_time,
    ring_allreduce_bytes,
    ring_allreduce_time,
    ring_shard_bytes,
    tree_allreduce_time,
)
from lightning_sync.comms import algorithms as A
from lightning_sync.comms.bound import BoundContext
from lightning_sync.comms.stats import CommStats, OpStats
from lightning_sync.sync.communicator import Communicator, LoopbackCommunicator

__all__: list[str] = []

# The communication context of this process's checks (a strategy owns one the same way).
CTX = comms.CommContext(observer=comms.CommStats())

# Every public entry point that talks to other ranks. Each must refuse to run without a process group.
_NEEDS_PG: dict[str, Callable[[], Any]] = {
    "all_reduce": lambda: CTX.all_reduce(torch.ones(3)),
    "all_reduce_async": lambda: CTX.all_reduce(torch.ones(3), async_op=True),
    "broadcast_tensor": lambda: CTX.broadcast(torch.ones(3), src=0),
    "broadcast_object": lambda: CTX.broadcast({"a": 1}, src=0),
    "scatter": lambda: CTX.scatter([torch.ones(1)], src=0),
    "gather": lambda: CTX.gather(torch.ones(2), dst=0),
    "gather_object": lambda: CTX.gather_object("x", dst=0),
    "all_gather": lambda: CTX.all_gather(torch.ones(2)),
    "all_gather_object": lambda: CTX.all_gather_object("x"),
    "all_gather_into": lambda: CTX.all_gather_into(torch.empty(1, 2), torch.ones(2)),
    "reduce_scatter": lambda: CTX.reduce_scatter(torch.ones(4)),
    "reduce_scatter_into": lambda: CTX.reduce_scatter_into(torch.empty(2), torch.ones(2)),
    "barrier": lambda: CTX.barrier(),
    "send": lambda: CTX.send(torch.ones(1), dst=0),
    "recv": lambda: CTX.recv(torch.ones(1), src=0),
    "get_rank": lambda: comms.get_rank(),
    "get_world_size": lambda: comms.get_world_size(),
    "group_ranks": lambda: comms.group_ranks(),
    "ring_all_reduce": lambda: A.ring_all_reduce(CTX, torch.ones(4)),
    "tree_all_reduce": lambda: A.tree_all_reduce(CTX, torch.ones(4)),
    "ring_reduce_scatter": lambda: A.ring_reduce_scatter(CTX, torch.ones(4)),
    "ring_all_gather": lambda: A.ring_all_gather(CTX, torch.ones(4)),
    "all_reduce_with_ring": lambda: A.all_reduce_with(CTX, "ring", torch.ones(4)),
    "all_reduce_with_backend": lambda: A.all_reduce_with(CTX, "backend", torch.ones(4)),
}


@pytest.mark.parametrize("name", sorted(_NEEDS_PG))
def test_collective_without_process_group_raises_runtime_error(name: str) -> None:
    assert not dist.is_initialized(), "this test needs a pytest process without a process group"
    before = CTX.observer.snapshot()
    with pytest.raises(RuntimeError, match="init_process_group"):
        _NEEDS_PG[name]()
    # the refusal happens before anything is issued, so nothing is accounted
    assert CTX.observer.snapshot() == before


def test_check_reduce_maps_ops_and_rejects_bad_ones() -> None:
    f32, i64 = torch.zeros(1), torch.zeros(1, dtype=torch.int64)
    assert comms.check_reduce("sum", f32) == dist.ReduceOp.SUM
    assert comms.check_reduce("avg", f32) == dist.ReduceOp.AVG
    assert comms.check_reduce("max", i64) == dist.ReduceOp.MAX
    assert comms.check_reduce("min", i64) == dist.ReduceOp.MIN
    assert sorted(comms.REDUCE_OPS) == ["avg", "max", "min", "sum"]
    with pytest.raises(ValueError, match=r"'prod'.*\['avg', 'max', 'min', 'sum'\]"):
        comms.check_reduce("prod", f32)
    with pytest.raises(ValueError, match=r"int64.*\['max', 'min', 'sum'\]"):
        comms.check_reduce("avg", i64)


def test_all_reduce_with_unknown_algorithm_lists_allowed_names() -> None:
    # validated before any communication, so this needs no process group
    with pytest.raises(ValueError, match=r"'butterfly'.*\['backend', 'hierarchical', 'ring', 'tree'\]"):
        A.all_reduce_with(CTX, "butterfly", torch.ones(2))


@pytest.mark.parametrize("bad", ["butterfly", "Ring", None])
def test_bound_view_with_unknown_algorithm_lists_allowed_names(bad: object) -> None:
    # refused when the view is made, before any collective (hierarchical's would build node groups): no process
    # group is needed, and a rank with a typo fails at once instead of leaving its peers in a collective
    with pytest.raises(ValueError, match=rf"{re.escape(repr(bad))}.*\['backend', 'hierarchical', 'ring', 'tree'\]"):
        CTX.bound(algorithm=bad)  # type: ignore[arg-type]


def _parameters(fn: Callable[..., Any]) -> list[tuple[str, Any]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("impl", [comms.CommContext, BoundContext, LoopbackCommunicator], ids=lambda c: c.__name__)
def test_communicators_take_the_protocols_parameters_in_its_order(impl: type) -> None:
    """One vocabulary: the context, its bound view and the one-process fake all take the Communicator protocol's
    parameters, with its names, order and defaults (a trailing extra, such as all_reduce's ``label``, is allowed), so
    a call written against one runs on the others."""
    methods = [n for n, v in vars(Communicator).items() if callable(v) and not n.startswith("_")]
    assert {"all_reduce", "broadcast", "reduce_scatter_into"} <= set(methods), methods
    for name in methods:
        want, got = _parameters(getattr(Communicator, name)), _parameters(getattr(impl, name))
        assert got[: len(want)] == want, (name, got)
    for name in ("rank", "world_size"):
        assert isinstance(getattr(impl, name), property), name


def test_bound_view_takes_the_contexts_parameters_for_every_collective() -> None:
    """Every method of the view is the context's method of the same name, with the same parameters."""
    methods = [n for n, v in vars(BoundContext).items() if callable(v) and not n.startswith("_")]
    assert len(methods) >= 15, methods  # every collective of the context, and scope()
    for name in methods:
        assert _parameters(getattr(BoundContext, name)) == _parameters(getattr(comms.CommContext, name)), name


# --------------------------------------------------------------------------- CommStats


def test_comm_stats_record_accumulates_calls_bytes_seconds() -> None:
    s = CommStats()
    assert s.snapshot() == {}
    s.record("all_reduce", 4000, 0.5)
    s.record("all_reduce", 1000.0, 0.25)  # float bytes are stored as int
    s.record("send", 12, calls=3)
    s.add_seconds("all_reduce", 1.0)  # time without a call
    s.add_seconds("broadcast", 2.0)  # creates the entry with 0 calls
    snap = s.snapshot()
    assert snap["all_reduce"] == OpStats(calls=2, bytes=5000, seconds=1.75)
    assert isinstance(snap["all_reduce"].bytes, int)
    assert snap["send"] == OpStats(calls=3, bytes=12, seconds=0.0)
    assert snap["broadcast"] == OpStats(calls=0, bytes=0, seconds=2.0)
    assert s["missing"] == OpStats()  # unknown op reads as zeros ...
    assert "missing" not in s.snapshot()  # ... without creating an entry
    assert s.total_bytes == 5012
    assert s.total_seconds == pytest.approx(3.75, abs=1e-12)  # sum of exact binary fractions


def test_comm_stats_snapshot_is_a_copy_and_reset_clears() -> None:
    s = CommStats()
    s.record("gather", 10, 1.0)
    snap = s.snapshot()
    snap["gather"].bytes = 999  # mutating the copy ...
    s.record("gather", 5)  # ... and recording afterwards ...
    assert snap["gather"].calls == 1  # ... leaves the snapshot as it was
    assert s["gather"] == OpStats(calls=2, bytes=15, seconds=1.0)
    s.reset()
    assert s.snapshot() == {}
    assert s.total_bytes == 0 and s.total_seconds == 0.0
    assert s["gather"] == OpStats()


def test_comm_stats_as_metrics_and_table() -> None:
    s = CommStats()
    s.record("send", 2**20, 0.5)
    s.record("all_reduce", 3 * 2**19, 1.25, calls=4)
    metrics = s.as_metrics()
    assert metrics == {
        "comm/all_reduce/calls": 4.0,
        "comm/all_reduce/bytes": float(3 * 2**19),
        "comm/all_reduce/seconds": 1.25,
        "comm/send/calls": 1.0,
        "comm/send/bytes": float(2**20),
        "comm/send/seconds": 0.5,
    }
    assert [k.split("/")[1] for k in metrics] == ["all_reduce"] * 3 + ["send"] * 3  # ops in sorted order
    assert all(isinstance(v, float) for v in metrics.values())
    assert set(s.as_metrics(prefix="x.")) == {k.replace("comm/", "x.", 1) for k in metrics}
    lines = s.table().splitlines()
    assert len(lines) == 3
    assert lines[0].split() == ["op", "calls", "MiB", "seconds"]
    assert lines[1].split() == ["all_reduce", "4", "1.500", "1.250"]  # 1.5 MiB, sorted first
    assert lines[2].split() == ["send", "1", "1.000", "0.500"]
    assert CommStats().table().split() == ["op", "calls", "MiB", "seconds"]


def test_comm_stats_is_thread_safe() -> None:
    s = CommStats()
    threads = [threading.Thread(target=lambda: [s.record("send", 3) for _ in range(2000)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert s["send"] == OpStats(calls=16000, bytes=48000, seconds=0.0)  # no lost update


def test_context_stats_reset_and_work_without_handles() -> None:
    CTX.observer.reset()
    assert CTX.observer.snapshot() == {}
    other = comms.CommContext(observer=comms.CommStats())
    assert other.observer is not CTX.observer  # every context measures into its own observer
    calls = []
    # a fixed clock, so no wall time is read: issued at 900 s, completed at 1000 s
    now = [900.0]
    ctx = comms.CommContext(observer=comms.CommStats(clock=lambda: now[0]))
    call = comms.Call(ctx.hooks, "unit_op", 7, "world", None, None, 0, None, "", None, True)
    call.issue()
    assert ctx.observer["unit_op"].calls == 1  # counted once, when issued
    now[0] = 1000.0
    work = comms.Work("unit_op", 7, [], lambda: calls.append(1) or "result", call)
    assert work.is_completed()  # no backend request outstanding
    assert "unit_op #7" in repr(work) and "done=False" in repr(work)
    assert work.wait() == "result"
    assert work.wait() == "result"  # waiting twice returns the same result ...
    assert calls == [1]  # ... without running finish again
    assert "done=True" in repr(work)
    stats = ctx.observer["unit_op"]
    assert stats.calls == 1 and stats.seconds == 100.0  # wait() adds the seconds since issue, never a call
    assert "unit_op" in ctx.observer.snapshot()
    assert other.observer.snapshot() == {} and CTX.observer.snapshot() == {}  # nothing reached another context
    ctx.observer.reset()
    assert ctx.observer.snapshot() == {}


# --------------------------------------------------------------------------- cost model
# Hand-computed values; the formulas are in the stats module docstring. Float results are compared
# with rel=1e-12: each is a handful of double-precision operations, so only last-bit rounding differs.


@pytest.mark.parametrize(
    ("nbytes", "k", "expected"),
    [
        (1000, 1, 0.0),
        (1000, 2, 1000.0),
        (1000, 4, 1500.0),
        (4096, 8, 7168.0),
        (0, 5, 0.0),
        (3, 3, 4.0),
    ],
)
def test_ring_allreduce_bytes(nbytes: int, k: int, expected: float) -> None:
    assert ring_allreduce_bytes(nbytes, k) == pytest.approx(expected, rel=1e-12)
    # reduce-scatter (or all-gather) is exactly half of the all-reduce
    assert ring_shard_bytes(nbytes, k) == pytest.approx(expected / 2, rel=1e-12)


@pytest.mark.parametrize(("nbytes", "k", "expected"), [(1000, 4, 750.0), (1000, 1, 0.0), (900, 3, 600.0)])
def test_ring_shard_bytes(nbytes: int, k: int, expected: float) -> None:
    assert ring_shard_bytes(nbytes, k) == pytest.approx(expected, rel=1e-12)


def test_ring_allreduce_time() -> None:
    # K=8, S=1e9 B, BW=1e10 B/s, alpha=1e-5 s: 14 * 1e-5 + 2*7/8 * 1e9 / 1e10 = 1.4e-4 + 0.175
    assert ring_allreduce_time(1e9, 8, 1e10, 1e-5) == pytest.approx(0.17514, rel=1e-12)
    # K=2, no latency: 2*1/2 * 1e6 / 1e6 = 1 s
    assert ring_allreduce_time(1e6, 2, 1e6) == pytest.approx(1.0, rel=1e-12)
    # K=1: nothing to send
    assert ring_allreduce_time(1e6, 1, 1e6, 1.0) == 0.0
    # latency-only: K=4 -> 6 messages
    assert ring_allreduce_time(0, 4, 1.0, 0.5) == pytest.approx(3.0, rel=1e-12)


@pytest.mark.parametrize(("k", "depth"), [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4)])
def test_tree_allreduce_time_depth(k: int, depth: int) -> None:
    # 2 * ceil(log2 K) * (alpha + S / BW) with alpha = 1e-5, S / BW = 1e6 / 1e9 = 1e-3
    assert tree_allreduce_time(1e6, k, 1e9, 1e-5) == pytest.approx(2 * depth * 1.01e-3, rel=1e-12)


def test_tree_beats_ring_only_when_latency_bound() -> None:
    # 8 ranks, 1 us latency, 10 GB/s: a 1 KiB message is latency-bound, a 1 GiB one bandwidth-bound
    small_ring, small_tree = ring_allreduce_time(1024, 8, 1e10, 1e-6), tree_allreduce_time(1024, 8, 1e10, 1e-6)
    big_ring, big_tree = ring_allreduce_time(2**30, 8, 1e10, 1e-6), tree_allreduce_time(2**30, 8, 1e10, 1e-6)
    assert small_tree < small_ring
    assert big_ring < big_tree
    assert math.isclose(big_tree / big_ring, 6 / 1.75, rel_tol=1e-3)  # 6 S/BW vs 1.75 S/BW + latencies


def test_overlapped_step_time() -> None:
    assert overlapped_step_time(2.0, 3.0, 0.5) == 3.5
    assert overlapped_step_time(3.0, 2.0) == 3.0
    assert overlapped_step_time(1.0, 1.0, 0.0) == 1.0


@pytest.mark.parametrize(
    ("fn", "args", "pattern"),
    [
        (ring_allreduce_bytes, (100, 0), r"world_size must be >= 1, got 0"),
        (ring_allreduce_bytes, (-1, 2), r"payload bytes must be >= 0, got -1"),
        (ring_shard_bytes, (100, -3), r"world_size must be >= 1, got -3"),
        (ring_shard_bytes, (-5.5, 2), r"payload bytes must be >= 0, got -5.5"),
        (ring_allreduce_time, (100, 2, 0), r"bandwidth must be > 0 bytes/s, got 0"),
        (ring_allreduce_time, (100, 2, -1e9), r"bandwidth must be > 0 bytes/s, got -1000000000.0"),
        (ring_allreduce_time, (100, 0, 1e9), r"world_size must be >= 1, got 0"),
        (ring_allreduce_time, (-100, 2, 1e9), r"payload bytes must be >= 0, got -100"),
        (tree_allreduce_time, (100, 2, 0.0), r"bandwidth must be > 0 bytes/s, got 0.0"),
        (tree_allreduce_time, (100, 0, 1e9), r"world_size must be >= 1, got 0"),
        (tree_allreduce_time, (-1, 4, 1e9), r"payload bytes must be >= 0, got -1"),
    ],
)
def test_cost_model_value_errors(fn: Callable[..., float], args: tuple[float, ...], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        fn(*args)


def test_blocked_seconds_add_up_apart_from_the_ops_and_reset() -> None:
    s = CommStats()
    for seconds in (0.25, 0.5):  # two launches or waits that blocked the caller
        s.block_begin()
        s.block_end(seconds)
    s.record("all_reduce", 8, 1.0)
    assert s.blocked_seconds() == 0.75 and s.total_seconds == 1.0  # blocked time is not an op's time
    s.reset()
    assert s.blocked_seconds() == 0.0 and s.snapshot() == {}


def test_covered_seconds_count_the_callers_own_time_with_an_async_call_in_flight() -> None:
    now = [0.0]
    s = CommStats(clock=lambda: now[0])

    def blocked(seconds: float, **kw: bool) -> None:  # a launch or a wait of `seconds`
        s.block_begin()
        now[0] += seconds
        s.block_end(seconds, **kw)

    blocked(0.5)  # a synchronous call: nothing in flight afterwards
    now[0] += 2.0  # compute with nothing in flight: not covered
    blocked(0.1, issued_async=True)  # an async launch
    now[0] += 3.0  # compute with it in flight: covered
    blocked(0.1, issued_async=True)  # a second one
    now[0] += 1.0  # covered once, not twice
    blocked(0.4, completed_async=True)  # the wait for the first: blocked, not covered
    now[0] += 0.5  # the second still in flight: covered
    blocked(0.2, completed_async=True)
    now[0] += 7.0  # nothing in flight
    assert s.covered_seconds() == pytest.approx(4.5)
    assert s.blocked_seconds() == pytest.approx(1.3)
    blocked(0.1, issued_async=True)
    now[0] += 2.0
    s.reset()  # the call stays in flight; the count starts again
    now[0] += 0.25
    assert s.covered_seconds() == pytest.approx(0.25) and s.blocked_seconds() == 0.0
    s.reset(in_flight=True)  # a new job: the previous one's call no longer counts as in flight
    now[0] += 1.0
    assert s.covered_seconds() == 0.0
    blocked(0.1, completed_async=True)  # its late wait does not make the count negative
    now[0] += 1.0
    assert s.covered_seconds() == 0.0
