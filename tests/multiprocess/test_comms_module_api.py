"""The documented module API of lightning_sync.comms (``comms.barrier()``, ``comms.broadcast(...)``, ...) on 3 gloo
ranks: every documented example verbatim against a single-process reference, and the default context's lifetime.

One spawned run performs every check (spawning ranks costs seconds); checks never raise inside a rank (see
:mod:`lightning_sync.testing.checks`), and the parent asserts that no rank reported a failure.

Tolerances: data movement (broadcast, scatter, gather, all_gather) copies bits, so it is compared exactly. The
reductions use integer-valued float32 inputs whose sum over the ranks is a multiple of K, so ``sum`` is exact and
``avg`` is exact when the backend sums, then divides; rtol 1e-6 leaves room for a backend that divides each term
first (one rounding of at most 2^-24 relative per term).
"""

from __future__ import annotations

import gc
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_sync import comms
from lightning_sync.testing import Checks, assert_all_ranks_passed, exact_input, reduce_reference, run_distributed

__all__: list[str] = []

WORLD = 3
RUN_TIMEOUT_S = 120  # start-up ~3 s a rank on a loaded machine, the checks a few seconds, a second rendezvous
EXACT = {"rtol": 0.0, "atol": 0.0}  # data movement copies bits; integer sums are exact in fp32
AVG = {"rtol": 1e-6, "atol": 0.0}  # see the module docstring: exact unless the backend divides before summing


def _live_contexts() -> list[comms.CommContext]:
    gc.collect()  # a context that is garbage but not yet collected must not count
    # type(), not isinstance(): isinstance would read __class__ of torch's deprecated module proxies, which warn
    return [o for o in gc.get_objects() if type(o) is comms.CommContext]


def _model_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)  # rank 0's model; every rank can build the reference from the same seed
    return torch.nn.Linear(3, 2).state_dict()


def _calls(stats: comms.CommStats) -> int:
    return sum(s.calls for s in stats.snapshot().values())


def _examples(ck: Checks, rank: int, k: int, markers: Path) -> None:
    """The examples of docs/comms.md, verbatim, each against a reference computed here."""
    # barrier: the last rank writes its marker late, so a barrier that let a rank through early would leave that
    # rank without it; the delay only exposes such a barrier, the barrier is what makes the check pass
    if rank == k - 1:
        time.sleep(0.5)
    (markers / f"rank{rank}").touch()
    comms.barrier()
    seen = sorted(p.name for p in markers.iterdir())
    ck.true("barrier: every rank arrived first", seen == [f"rank{r}" for r in range(k)], seen)

    tensor = exact_input(rank, (4, 3), torch.float32, seed=1)
    comms.broadcast(tensor, src=0)
    ck.close("broadcast(tensor, src=0)", tensor, exact_input(0, (4, 3), torch.float32, seed=1), **EXACT)

    model_state = _model_state()
    state = comms.broadcast(model_state if rank == 0 else None, src=0)  # objects too
    ref = _model_state()
    ck.true("broadcast(model_state): keys", isinstance(state, dict) and list(state) == list(ref), state)
    for key in ref:
        ck.close(f"broadcast(model_state)[{key}]", state.get(key) if isinstance(state, dict) else None, ref[key])

    scatter_list = [exact_input(r, (r + 1, 2), torch.float32, seed=2) for r in range(k)]
    my_chunk = comms.scatter(scatter_list if rank == 0 else None, src=0)
    ck.close("scatter(scatter_list, src=0)", my_chunk, exact_input(rank, (rank + 1, 2), torch.float32, seed=2))

    # uneven first dims, int64: rank r sends r + 1 rows
    my_tensor = exact_input(rank, (rank + 1, 2), torch.int64, seed=3)
    refs = [exact_input(r, (r + 1, 2), torch.int64, seed=3) for r in range(k)]
    if rank == 0:
        gather_list = [torch.zeros(r + 1, 2, dtype=torch.int64) for r in range(k)]
        out = comms.gather(my_tensor, gather_list, dst=0)
        # the very list passed in, filled in place
        ck.close(
            "gather(my_tensor, gather_list, dst=0)", out if out is gather_list else f"not gather_list: {out}", refs
        )
    else:
        out = comms.gather(my_tensor, dst=0)
        ck.true("gather(my_tensor, dst=0) on another rank", out is None, out)

    all_tensors = comms.all_gather(my_tensor)
    ck.close("all_gather(my_tensor)", all_tensors, refs)

    # 7 rows on 3 ranks: chunks of ceil(7/3) = 3 rows, so ranks get 3, 3 and 1 rows
    base = torch.arange(14, dtype=torch.float32).reshape(7, 2)
    t = base * (rank + 1)  # the sum over ranks is 6 * base: avg = 2 * base, a multiple of K
    comms.all_reduce(t, op="avg")
    avg = reduce_reference([base * (r + 1) for r in range(k)], "avg")
    ck.close('all_reduce(t, op="avg")', t, avg, **AVG)
    mine = comms.reduce_scatter(t, op="sum")
    full, c = avg * k, -(-7 // k)
    ck.close('reduce_scatter(t, op="sum")', mine, full[rank * c : min(7, (rank + 1) * c)], **AVG)
    ck.true("reduce_scatter rows", mine.shape[0] == [3, 3, 1][rank], tuple(mine.shape))
    ck.close("reduce_scatter left t alone", t, avg, **AVG)
    # 6 rows divide evenly: 2 each
    even = comms.reduce_scatter(torch.ones(6, 2, dtype=torch.int64) * (rank + 1), op="max")
    ck.close("reduce_scatter(6 rows, max)", even, torch.full((2, 2), k, dtype=torch.int64))


def _worker(rank: int, k: int, markers: str) -> tuple[list[str], int]:
    ck = Checks()
    # lazy: the process group exists and comms is imported, but no call has made the default context yet
    before = _live_contexts()
    default = comms.default_context()
    made = [c for c in _live_contexts() if all(c is not b for b in before)]
    ck.true("the first call made exactly one context", made == [default], (len(before), len(made)))
    ck.true("default_context() is stable", comms.default_context() is default)
    default.observer = comms.CommStats()  # measure the module functions (issues nothing)

    side = comms.CommContext(observer=comms.CommStats())  # a strategy's context, used beside the functions
    side.all_reduce(torch.ones(2))
    _examples(ck, rank, k, Path(markers))
    side_work = side.all_reduce(torch.ones(2), async_op=True)
    ck.close("side context's all_reduce", side_work.wait(), torch.full((2,), float(k)), **EXACT)
    # sequence numbers: each context counts its own calls only
    ck.true("side seq counts only its own calls", side_work.seq == 2, side_work)
    issued = _calls(default.observer)  # every call the examples issued (metadata exchanges included)
    work = comms.all_reduce(torch.ones(3), async_op=True)
    ck.true("module seq counts only module calls", work.seq == issued + 1, (work, issued))
    ck.close("async all_reduce", work.wait(), torch.full((3,), float(k)), **EXACT)
    # statistics: each observer saw its own context's calls only
    ck.true("side stats: its 2 all_reduces only", _calls(side.observer) == 2, side.observer.snapshot())
    ck.true("side stats: all_reduce only", set(side.observer.snapshot()) == {"all_reduce"}, side.observer.snapshot())
    ck.true("module stats: 2 all_reduces", default.observer["all_reduce"].calls == 2, default.observer.snapshot())
    expected_ops = {"barrier", "broadcast", "scatter", "gather", "all_gather", "all_reduce", "reduce_scatter"}
    ck.true("module stats: every example", expected_ops <= set(default.observer.snapshot()), default.observer)

    # gather_list on a rank that is not dst: refused after the collective, so every rank stays in step
    part = torch.tensor([rank])
    if rank == 0:
        ck.close("gather, a peer passed a list", comms.gather(part, dst=0), [torch.tensor([r]) for r in range(k)])
    else:
        ck.raises("gather_list off dst", lambda: comms.gather(part, [torch.zeros(1)] * k, dst=0), r"dst=0", r"None")
    ck.close("in step after the refusal", comms.all_reduce(torch.ones(1)), torch.full((1,), float(k)), **EXACT)

    # a watchdog and node groups on the default context, then a new default group in this same process
    default.start_watchdog(60.0, interval=0.2)
    default.node_groups(ranks_per_node=1)
    comms.barrier()
    dist.destroy_process_group()
    ck.raises(
        "no group", lambda: comms.all_reduce(torch.ones(1)), r"all_reduce", r"init_process_group", exc=RuntimeError
    )
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("comms_module_api/second", store),
        rank=rank,
        world_size=k,
        timeout=timedelta(seconds=60),
    )
    work = comms.all_reduce(torch.full((2,), float(rank)), async_op=True)
    ck.true("new group: sequence numbers from 1", work.seq == 1, work)
    ck.close("new group: all_reduce", work.wait(), torch.full((2,), float(sum(range(k)))), **EXACT)
    fresh = comms.default_context()
    ck.true("new group: a new context", fresh is not default)
    ck.true("new group: no observer carried over", fresh.observer is None, fresh.observer)
    ck.true("new group: no watchdog", fresh.watchdog is None, fresh.watchdog)
    ck.true("the old context's watchdog was stopped", default.watchdog is None, default.watchdog)
    ck.true("the old context's node groups were released", default.release_node_groups() == 0)
    ck.true("the old context's stats stayed its own", default.observer["all_reduce"].calls == 3, default.observer)
    # the strategy's context keeps counting for itself on the new group: its first call there is #1 too
    side_work = side.barrier(async_op=True)
    ck.true("side context on the new group", side_work.seq == 1 and side_work.wait() is None, side_work)
    ck.true("side stats untouched by the module", _calls(side.observer) == 3, side.observer.snapshot())
    return ck.result()


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_documented_module_api_on_three_ranks(tmp_path: Path) -> None:
    """The examples verbatim against references, sequence numbers and stats apart from a strategy's context, and
    a fresh default context after destroy_process_group and a second init_process_group."""
    results = run_distributed(_worker, WORLD, str(tmp_path), timeout=RUN_TIMEOUT_S)
    assert_all_ranks_passed(results, min_checks=35)
