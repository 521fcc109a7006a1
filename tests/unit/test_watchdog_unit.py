"""The watchdog's diagnosis from published records (one process; the real multi-rank runs are in
tests/multiprocess/test_watchdog.py and test_crash_restart.py) and its argument checks."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_sync.comms.watchdog import Pending, check_args, explain
from lightning_sync.diagnostics import HangWatchdog


def _record(last: int, hist: list[list[Any]], state: str = "running", waiting: str | None = None,
            key: str = "world") -> dict[str, Any]:
    return {"beat": 7, "state": state, "host": "h", "pid": 100, "last": {key: last}, "hist": {key: hist},
            "waiting": waiting}


PENDING = Pending("all_reduce", 4, "world", [0, 1, 2], 4000)


def test_a_rank_that_never_issued_it_never_joined() -> None:
    records = {1: _record(3, [[3, "all_reduce", 4000]]),
               2: _record(4, [[4, "all_reduce", 4000]], waiting="all_reduce #4 (4.0 kB) on world for 5.0 s")}
    msg = explain(PENDING, "did not complete within 3 s", 0, records, [], silent_for=2.1)
    assert msg.startswith("all_reduce #4 (4.0 kB) on world did not complete within 3 s: ranks [1] never joined\n")
    assert "rank 1 (h pid 100): last issued #3 here, not in a collective" in msg
    assert "rank 2 (h pid 100): last issued #4 here, waiting in all_reduce #4" in msg


def test_different_code_paths_name_the_minority_first() -> None:
    records = {1: _record(4, [[3, "all_reduce", 4000], [4, "barrier", 0]]),
               2: _record(4, [[4, "all_reduce", 4000]])}
    msg = explain(PENDING, "did not complete within 3 s", 0, records, [], silent_for=2.1)
    assert "ranks took different code paths at #4: barrier (0 B) on ranks [1]; all_reduce (4.0 kB) on ranks [0, 2]" \
        in msg
    sized = {1: _record(4, [[4, "all_reduce", 8]]), 2: _record(4, [[4, "all_reduce", 4000]])}  # same op, size differs
    assert "all_reduce (8 B) on ranks [1]; all_reduce (4.0 kB) on ranks [0, 2]" in \
        explain(PENDING, "x", 0, sized, [], silent_for=2.1)


def test_lost_and_departed_ranks_are_named() -> None:
    records = {1: None, 2: _record(9, [], state="done")}
    msg = explain(PENDING, "failed (Connection closed by peer)", 0, records, [1], silent_for=2.1)
    assert "failed (Connection closed by peer): ranks [2] already left (stopped their watchdog); ranks [1] lost" in msg
    assert "rank 1: no heartbeat for 2.1 s; last seen never published a heartbeat" in msg


def test_point_to_point_reports_where_the_peer_is_and_everyone_joined_blames_the_transport() -> None:
    recv = Pending("recv", 2, "world", [0, 3], 16, peer=3)
    msg = explain(recv, "did not complete within 3 s", 0,
                  {3: _record(5, [], waiting="all_reduce #5 (4 B) on world for 4.0 s", key="world/p2p")}, [],
                  silent_for=2.1)
    assert msg.startswith("recv #2 (16 B) with rank 3 did not complete")
    assert "rank 3 (h pid 100): last issued #5 here, waiting in all_reduce #5" in msg
    joined = {1: _record(4, [[4, "all_reduce", 4000]]), 2: _record(5, [[4, "all_reduce", 4000]])}
    assert "every peer issued it; the transport did not complete it" in explain(PENDING, "x", 0, joined, [], 2.1)


@pytest.mark.parametrize(("args", "pattern"), [
    ((0,), "timeout must be a number of seconds > 0, got 0"),
    ((-1.0,), "timeout must be .* got -1.0"),
    ((True,), "timeout must be .* got True"),
    (("60",), "timeout must be .* got '60'"),
    ((10, 10), r"interval must be a number of seconds in \(0, timeout=10\), got 10"),
    ((10, 0), r"interval must be .* got 0"),
    ((10, None, -1), "exit_after must be a number of seconds >= 0, got -1"),
])
def test_bad_arguments_are_named(args: tuple[Any, ...], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        check_args(*args)
    with pytest.raises(ValueError, match=pattern):
        HangWatchdog(*args)


def test_defaults() -> None:
    assert check_args(300) == (300.0, 1.0, 300.0)
    assert check_args(2) == (2.0, 0.4, 2.0)
