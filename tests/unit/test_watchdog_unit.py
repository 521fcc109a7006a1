"""The watchdog's diagnoses from published records (a hang, collectives that paired up across different calls),
in one process (the real multi-rank runs are in tests/multiprocess/test_watchdog.py and test_crash_restart.py),
and its argument checks."""

from __future__ import annotations

import zlib
from typing import Any

import pytest

from lightning_sync.comms.diagnosis import Pending, describe, explain, mismatch
from lightning_sync.comms.watchdog import check_args
from lightning_sync.diagnostics import HangWatchdog


def _record(
    last: int, hist: list[list[Any]], state: str = "running", waiting: str | None = None, key: str = "world"
) -> dict[str, Any]:
    return {
        "beat": 7,
        "state": state,
        "host": "h",
        "pid": 100,
        "last": {key: last},
        "hist": {key: hist},
        "waiting": waiting,
    }


PENDING = Pending("all_reduce", 4, "world", [0, 1, 2], 4000)


def test_a_rank_that_never_issued_it_never_joined() -> None:
    records = {
        1: _record(3, [[3, "all_reduce", 4000]]),
        2: _record(4, [[4, "all_reduce", 4000]], waiting="all_reduce #4 (4.0 kB) on world for 5.0 s"),
    }
    msg = explain(PENDING, "did not complete within 3 s", 0, records, [], silent_for=2.1)
    assert msg.startswith("all_reduce #4 (4.0 kB) on world did not complete within 3 s: ranks [1] never joined\n")
    assert "rank 1 (h pid 100): last issued #3 here, not in a collective" in msg
    assert "rank 2 (h pid 100): last issued #4 here, waiting in all_reduce #4" in msg


def test_different_code_paths_name_the_minority_first() -> None:
    records = {1: _record(4, [[3, "all_reduce", 4000], [4, "barrier", 0]]), 2: _record(4, [[4, "all_reduce", 4000]])}
    msg = explain(PENDING, "did not complete within 3 s", 0, records, [], silent_for=2.1)
    assert (
        "ranks took different code paths at #4: barrier (0 B) on ranks [1]; all_reduce (4.0 kB) on ranks [0, 2]" in msg
    )
    sized = {1: _record(4, [[4, "all_reduce", 8]]), 2: _record(4, [[4, "all_reduce", 4000]])}  # same op, size differs
    assert "all_reduce (8 B) on ranks [1]; all_reduce (4.0 kB) on ranks [0, 2]" in explain(
        PENDING, "x", 0, sized, [], silent_for=2.1
    )


def test_the_same_op_and_size_under_other_keys_are_different_code_paths() -> None:
    pending = Pending("all_reduce", 4, "world", [0, 1], 4, detail="float32[], avg, 'training_step.a'")
    records = {1: _record(4, [[4, "all_reduce", 4, "float32[], avg, 'training_step.b'"]])}
    assert (
        "different code paths at #4: all_reduce (4 B, float32[], avg, 'training_step.a') on ranks [0]; "
        "all_reduce (4 B, float32[], avg, 'training_step.b') on ranks [1]"
        in explain(pending, "x", 0, records, [], silent_for=2.1)
    )


def test_describe() -> None:
    assert describe("barrier", 0) == "barrier (0 B)"
    assert describe("all_reduce", 4000, "float32[1000], sum") == "all_reduce (4.0 kB, float32[1000], sum)"


def _issued(*sigs: tuple[str, int, str]) -> list[list[Any]]:
    """Entries ``[seq, op, nbytes, detail, running hash]`` from seq 1, hashed as the watchdog does."""
    out, running = [], 0
    for seq, (op, nbytes, detail) in enumerate(sigs, 1):
        running = zlib.crc32(f"{op}|{nbytes}|{detail}".encode(), running)
        out.append([seq, op, nbytes, detail, running])
    return out


A, B = ("all_reduce", 4, "float32[], avg, 'a'"), ("all_reduce", 4, "float32[], avg, 'b'")
BUCKET = ("all_reduce", 4000, "float32[1000], avg")


def test_mismatch_names_the_first_call_that_differs_minority_first() -> None:
    issued = {0: _issued(BUCKET, A, B, BUCKET), 1: _issued(BUCKET, A, B, BUCKET), 2: _issued(BUCKET, B, A, BUCKET)}
    assert mismatch("world", issued).startswith(
        "ranks issued different collectives on world at #2 that paired up: all_reduce (4 B, float32[], avg, 'b') "
        "on ranks [2]; all_reduce (4 B, float32[], avg, 'a') on ranks [0, 1] (nothing hung"
    )


def test_mismatch_of_a_rank_that_issued_fewer_and_of_calls_no_longer_kept() -> None:
    fewer = {0: _issued(BUCKET, A), 1: _issued(BUCKET)}
    assert (
        "at #2 that paired up: all_reduce (4 B, float32[], avg, 'a') on ranks [0]; nothing (its last was #1) on "
        "ranks [1]" in mismatch("world", fewer)
    )
    # the calls that differed (#1) were dropped from the kept ring: only #2 and #3 are left
    dropped = {0: _issued(A, BUCKET, BUCKET)[1:], 1: _issued(B, BUCKET, BUCKET)[1:]}
    assert mismatch("world", dropped).startswith(
        "ranks issued different collectives on world before #2 that paired up (the calls that differed are older "
        "than the last 2 kept)"
    )


def test_lost_and_departed_ranks_are_named() -> None:
    records = {1: None, 2: _record(9, [], state="done")}
    msg = explain(PENDING, "failed (Connection closed by peer)", 0, records, [1], silent_for=2.1)
    assert "failed (Connection closed by peer): ranks [2] already left (stopped their watchdog); ranks [1] lost" in msg
    assert "rank 1: no heartbeat for 2.1 s; last seen never published a heartbeat" in msg


def test_point_to_point_reports_where_the_peer_is_and_everyone_joined_blames_the_transport() -> None:
    recv = Pending("recv", 2, "world", [0, 3], 16, peer=3)
    msg = explain(
        recv,
        "did not complete within 3 s",
        0,
        {3: _record(5, [], waiting="all_reduce #5 (4 B) on world for 4.0 s", key="world/p2p")},
        [],
        silent_for=2.1,
    )
    assert msg.startswith("recv #2 (16 B) with rank 3 did not complete")
    assert "rank 3 (h pid 100): last issued #5 here, waiting in all_reduce #5" in msg
    joined = {1: _record(4, [[4, "all_reduce", 4000]]), 2: _record(5, [[4, "all_reduce", 4000]])}
    assert "every peer issued it; the transport did not complete it" in explain(PENDING, "x", 0, joined, [], 2.1)


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        ((0,), "timeout must be a number of seconds > 0, got 0"),
        ((-1.0,), "timeout must be .* got -1.0"),
        ((True,), "timeout must be .* got True"),
        (("60",), "timeout must be .* got '60'"),
        ((10, 10), r"interval must be a number of seconds in \(0, timeout=10\), got 10"),
        ((10, 0), r"interval must be .* got 0"),
        ((10, None, -1), "exit_after must be a number of seconds >= 0, got -1"),
    ],
)
def test_bad_arguments_are_named(args: tuple[Any, ...], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        check_args(*args)
    with pytest.raises(ValueError, match=pattern):
        HangWatchdog(*args)


@pytest.mark.parametrize("every", [-1, 1.5, True, "10"])
def test_a_bad_verify_every_is_named(every: Any) -> None:
    with pytest.raises(ValueError, match=f"verify_every must be an int >= 0, got {every!r}"):
        HangWatchdog(60, verify_every=every)


def test_defaults() -> None:
    assert check_args(300) == (300.0, 1.0, 300.0)
    assert check_args(2) == (2.0, 0.4, 2.0)
