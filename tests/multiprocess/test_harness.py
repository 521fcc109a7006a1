"""The multi-process harness itself: rank-ordered results, failures that name the rank, hard timeouts
with stack dumps, and no leaked children on any path.

Ranks that must stay alive without taking part in a collective block on a key of the harness's own
rendezvous store that nobody sets (:func:`_block_on_store`), so no gloo connection is involved.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import pytest
import torch
import torch.distributed as dist

from lightning_sync import comms
from lightning_sync.testing import DistributedRankError, DistributedTimeoutError, run_distributed

# The communication context of this process's checks (a strategy owns one the same way).
CTX = comms.CommContext(observer=comms.CommStats())

__all__: list[str] = []

E = TypeVar("E", bound=BaseException)

PG_TIMEOUT_S = 120.0  # far beyond every run timeout below: only the harness can end a stuck rank


def _assert_no_children() -> None:
    alive = multiprocessing.active_children()
    assert alive == [], f"harness left children alive: {alive}"


def _run_expecting(error: type[E], fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> E:
    """Run ``fn`` on ``world_size`` ranks, which must raise ``error``; return it.

    Every failure path must leave no children behind, so that is asserted here too.
    """
    with pytest.raises(error) as info:
        run_distributed(fn, world_size, *args, **kwargs)
    _assert_no_children()
    return info.value


def _block_on_store(seconds: float) -> None:
    """Stay alive without touching gloo: wait for a store key that is never set."""
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=seconds)
    )
    store.wait(["lightning_sync-test-never-set"])


def _stacks_of(message: str, rank: int) -> str:
    """The stack-dump section the timeout message holds for ``rank``."""
    match = re.search(rf"--- rank {rank} stacks ---\n(.*?)(?=\n--- rank \d+ stacks ---|\Z)", message, re.S)
    assert match, f"no stack section for rank {rank} in:\n{message}"
    return match.group(1)


# --------------------------------------------------------------------------- workers (module level: picklable)


def _echo_worker(rank: int, world_size: int, base: float, *, scale: int) -> dict[str, Any]:
    return {
        "rank": rank,
        "world_size": world_size,
        "env": (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ.get("LS_HARNESS_TEST")),
        "tensor": torch.arange(rank + 1, dtype=torch.float64) * scale + base,
        "int_tensor": torch.full((2, rank + 1), rank, dtype=torch.int64),
        "pg": (dist.get_rank(), dist.get_world_size(), dist.get_backend()),
        # a real collective: every rank's contribution, in rank order
        "gathered": CTX.all_gather_object(f"r{rank}"),
    }


def _tensor_worker(rank: int, world_size: int) -> torch.Tensor:
    return torch.full((3,), float(rank * 10))


def _fail_while_peer_waits_on_subgroup(rank: int, world_size: int, how: str) -> None:
    """Rank 1 fails; rank 0 is blocked in a collective (on group [0, 2]) that rank 2 never joins."""
    sub = dist.new_group([0, 2])  # every rank must call new_group
    if rank == 1:
        if how == "raise":
            raise ValueError("boom on rank 1")
        os._exit(3)
    if rank == 0:
        CTX.all_reduce(torch.ones(2), group=sub)
    else:
        _block_on_store(PG_TIMEOUT_S)


def _fail_while_peer_waits_on_it(rank: int, world_size: int, how: str) -> None:
    """Rank 1 fails while rank 0 waits for it in an all_reduce: rank 0 then fails too, with
    'Connection closed by peer', and the harness must still name rank 1 as the root cause."""
    if rank == 1:
        if how == "raise":
            raise ValueError("boom on rank 1")
        os._exit(3)
    CTX.all_reduce(torch.ones(2))


def _exit_worker(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    _block_on_store(PG_TIMEOUT_S)


def _deadlock_worker(rank: int, world_size: int, *unused: Any) -> int:
    """Rank 1 skips the all_reduce (it waits for rank 0 to finish first): rank 0 is stuck in it."""
    if rank == 0:
        CTX.all_reduce(torch.ones(3))
    else:
        _block_on_store(PG_TIMEOUT_S)
    return rank


def _skip_collective_worker(rank: int, world_size: int) -> int:
    """Rank 1 returns at once; rank 0 does an all_reduce that rank 1 never joins."""
    if rank == 0:
        CTX.all_reduce(torch.ones(3))
    return rank


class _SlowToUnpickle:
    """An argument whose unpickling in the child takes 3 s: models a rank that is slow to start
    (slow imports or filesystem). A fixed delay, not a wait for a condition."""

    def __getstate__(self) -> dict[str, int]:
        return {"delay": 3}

    def __setstate__(self, state: dict[str, int]) -> None:
        time.sleep(state["delay"])


# --------------------------------------------------------------------------- results


@pytest.mark.timeout(90)
def test_results_come_back_in_rank_order() -> None:
    results = run_distributed(_echo_worker, 3, 0.5, timeout=60, scale=2, env={"LS_HARNESS_TEST": "yes"})
    assert [r["rank"] for r in results] == [0, 1, 2]
    for rank, res in enumerate(results):
        assert res["world_size"] == 3
        assert res["env"] == (str(rank), "3", "yes")  # rank variables and env= set inside the child
        assert res["pg"] == (rank, 3, "gloo")
        assert res["gathered"] == ["r0", "r1", "r2"]
        # tensors come back as CPU tensors, bit-exact (arange * 2 + 0.5 is exact in float64)
        expected = torch.arange(rank + 1, dtype=torch.float64) * 2 + 0.5
        assert res["tensor"].device.type == "cpu"
        torch.testing.assert_close(res["tensor"], expected, rtol=0, atol=0)
        expected_int = torch.full((2, rank + 1), rank, dtype=torch.int64)
        torch.testing.assert_close(res["int_tensor"], expected_int, rtol=0, atol=0)
    assert "LS_HARNESS_TEST" not in os.environ  # env= never touches the parent
    _assert_no_children()


@pytest.mark.timeout(90)
def test_bare_tensor_results_in_rank_order() -> None:
    results = run_distributed(_tensor_worker, 4, timeout=60)
    assert len(results) == 4
    for rank, t in enumerate(results):
        torch.testing.assert_close(t, torch.full((3,), float(rank * 10)), rtol=0, atol=0)  # exact copy
    _assert_no_children()


class _WorkerIds(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        return torch.utils.data.get_worker_info().id


def _start_method_worker(rank: int, world_size: int) -> tuple[str | None, list[int]]:
    """The start method this rank's own processes get by default, and what a DataLoader with a worker reads."""
    loader = torch.utils.data.DataLoader(_WorkerIds(), batch_size=1, num_workers=1)
    return multiprocessing.get_start_method(), [int(b) for b in loader]


@pytest.mark.timeout(90)
def test_a_rank_starts_its_own_processes_as_a_fresh_interpreter_would() -> None:
    """A rank forked by the harness's forkserver must not pass that start method on: torchrun's and Slurm's
    ranks are fresh interpreters, whose DataLoader workers fork (Linux, Python < 3.14). Inherited, every
    worker of every epoch went through a forkserver of the rank's own, started from scratch (2 s each)."""
    import subprocess
    import sys

    fresh = subprocess.run(
        [sys.executable, "-c", "import multiprocessing as m; print(m.get_start_method())"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    results = run_distributed(_start_method_worker, 2, timeout=60)
    assert [r[0] for r in results] == [fresh, fresh], (fresh, results)
    assert [r[1] for r in results] == [[0, 0], [0, 0]]  # both samples from the one worker
    _assert_no_children()


def _preloaded_worker(rank: int, world_size: int) -> list[str]:
    import sys

    return sorted(m for m in ("support.preload", "lightning_sync.strategies", "lightning_sync.cli") if m in sys.modules)


def test_forked_ranks_inherit_the_sessions_warm_up() -> None:
    """The forkserver imports the project's modules and the test suite's Hydra warm-up (``support.preload``, which
    lives under ``tests/`` and so is importable there only through the session's ``PYTHONPATH``): a forked rank
    finds them already imported. Had the warm-up failed to import, the forkserver would skip it silently and
    every CLI rank would build Hydra's parser tables again."""
    import os

    if os.environ.get("LIGHTNING_SYNC_START_METHOD", "forkserver") != "forkserver":
        pytest.skip("ranks are spawned (LIGHTNING_SYNC_START_METHOD), not forked from the preloaded server")
    results = run_distributed(_preloaded_worker, 2, timeout=60)
    assert results == [["lightning_sync.cli", "lightning_sync.strategies", "support.preload"]] * 2, results


# --------------------------------------------------------------------------- failures name the rank


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["raise", "exit"])
def test_failing_rank_is_reported_and_blocked_peers_killed(how: str) -> None:
    # Rank 0 is blocked in a collective with rank 2, and the failing rank 1 is not part of it.
    # ranks 0 and 2 would wait PG_TIMEOUT_S (120 s), past the run's 60 s timeout: the run ending in a
    # DistributedRankError, not a DistributedTimeoutError, shows the harness killed them once rank 1 failed
    err = _run_expecting(
        DistributedRankError, _fail_while_peer_waits_on_subgroup, 3, how, timeout=60, pg_timeout=PG_TIMEOUT_S
    )
    assert err.rank == 1, str(err)
    if how == "raise":
        assert "boom on rank 1" in err.remote_traceback
        assert "ValueError" in err.remote_traceback
        assert "_fail_while_peer_waits_on_subgroup" in err.remote_traceback  # where it was raised
    else:
        assert re.search(r"exit(ed with)? code 3\b", err.remote_traceback), err.remote_traceback
    assert str(err).startswith("rank 1 failed")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["raise", "exit"])
def test_root_cause_named_when_the_blocked_peer_fails_too(how: str) -> None:
    # Repeated: the peer's secondary error races the root cause to the parent, so one lucky pass
    # would prove little. Every repetition must name rank 1.
    for attempt in range(3):
        err = _run_expecting(
            DistributedRankError, _fail_while_peer_waits_on_it, 2, how, timeout=60, pg_timeout=PG_TIMEOUT_S
        )
        assert err.rank == 1, f"attempt {attempt}: {err}"
        if how == "raise":
            assert "boom on rank 1" in err.remote_traceback
        else:
            assert re.search(r"exit(ed with)? code 3\b", err.remote_traceback)


@pytest.mark.timeout(90)
def test_rank_exit_code_is_reported() -> None:
    # a DistributedRankError (not a timeout after 60 s) shows the exit was noticed and the peer ended
    err = _run_expecting(DistributedRankError, _exit_worker, 2, timeout=60, pg_timeout=PG_TIMEOUT_S)
    assert err.rank == 1
    assert re.search(r"exit(ed with)? code 3\b", str(err)), str(err)


# --------------------------------------------------------------------------- timeouts


@pytest.mark.timeout(90)
def test_stuck_collective_times_out_and_names_the_stuck_rank() -> None:
    err = _run_expecting(DistributedTimeoutError, _deadlock_worker, 2, timeout=8, pg_timeout=PG_TIMEOUT_S)
    msg = str(err)
    assert re.search(r"ranks \[0(, 1)?\] never returned", msg), msg
    assert msg.startswith("_deadlock_worker on 2 ranks did not finish within 8s"), msg
    assert "--- rank 0 stacks ---" in msg


@pytest.mark.timeout(90)
def test_timeout_stack_dump_shows_where_a_slow_starting_rank_is_stuck() -> None:
    # 3 s of slow unpickling plus start-up stay well inside timeout=20: rank 0 is then surely in its
    # all_reduce when the deadline passes, and its dump must say so.
    err = _run_expecting(
        DistributedTimeoutError, _deadlock_worker, 2, _SlowToUnpickle(), timeout=20, pg_timeout=PG_TIMEOUT_S
    )
    stacks = _stacks_of(str(err), 0)
    assert "in _deadlock_worker" in stacks, stacks  # faulthandler: 'File "...", line N in <function>'
    assert "in all_reduce" in stacks, stacks


@pytest.mark.timeout(90)
def test_skipped_collective_times_out_with_stack_of_the_stuck_rank() -> None:
    # timeout=15: both ranks must be past start-up (imports take up to ~10 s on a loaded 2-core machine)
    # for rank 1 to have returned and rank 0 to be stuck in its all_reduce when the deadline passes
    err = _run_expecting(DistributedTimeoutError, _skip_collective_worker, 2, timeout=15, pg_timeout=PG_TIMEOUT_S)
    msg = str(err)
    assert "ranks [0] never returned" in msg, msg
    assert "in _skip_collective_worker" in _stacks_of(msg, 0)


# --------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("kwargs", "patterns"),
    [
        ({"world_size": 0}, [r"world_size", r">= 1", r"\b0\b"]),
        ({"world_size": -2}, [r"world_size", r">= 1", r"-2"]),
        ({"world_size": 2.0}, [r"world_size", r"int", r"2\.0"]),
        ({"world_size": 2, "backend": "mpi"}, [r"'mpi'", re.escape("['gloo', 'nccl']")]),
        ({"world_size": 2, "timeout": 0}, [r"timeout", r"> 0", r"\b0\b"]),
    ],
)
def test_bad_arguments_raise_value_error_listing_allowed(kwargs: dict[str, Any], patterns: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        run_distributed(_tensor_worker, **kwargs)
    for p in patterns:
        assert re.search(p, str(info.value)), (p, str(info.value))
    _assert_no_children()  # nothing was spawned
