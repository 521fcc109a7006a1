"""Where a ZeRO rank's buddy copy goes and who rebuilds a lost rank's shards (:mod:`lightning_sync.sync.zero.buddy`):
pure bookkeeping, one process. The copies themselves, on real gloo ranks, are ``tests/multiprocess/test_zero_buddy.py``
and ``tests/multiprocess/test_live_zero.py``."""

from __future__ import annotations

import pytest

from lightning_sync.sync.zero.buddy import ShardsLost, buddy_shift, contributors


@pytest.mark.parametrize(
    ("nodes", "shift"),
    [
        (["0"], 0),  # alone: no buddy
        (["0", "0", "0"], 1),  # one node: the next rank
        (["0", "0", "1", "1"], 2),  # two nodes of two: every copy crosses to the other node
        (["0", "0", "0", "1", "1", "1"], 3),
        (["0", "0", "1"], 1),  # uneven: two of three copies cross either way; the smaller shift
    ],
)
def test_the_buddy_shift_sends_as_many_copies_to_another_node_as_it_can(nodes: list[str], shift: int) -> None:
    assert buddy_shift(nodes) == shift


def test_a_lost_rank_is_rebuilt_by_its_buddy_and_the_others_by_themselves() -> None:
    then = ["a", "b", "c", "d"]
    assert contributors(then, 2, ["b", "c", "d"]) == {0: "c", 1: "b", 2: "c", 3: "d"}  # a's copy is on c
    assert contributors(then, 2, ["b", "c", "d", "new"]) == {0: "c", 1: "b", 2: "c", 3: "d"}  # a newcomer holds none
    assert contributors(then, 1, ["a", "c"]) == {0: "a", 1: "c", 2: "c", 3: "a"}  # b's copy on c, d's on a
    with pytest.raises(ShardsLost, match=r"the shards of a \(rank 0 of 4 when they were last copied\) are lost: a "
                       r"was lost and so was c, which held their copy"):  # fmt: skip
        contributors(then, 2, ["b", "d"])


def test_shards_lost_is_not_a_runtime_error() -> None:
    """The live membership takes a RuntimeError for a lost member and trains past it; this must end the job."""
    assert not issubclass(ShardsLost, RuntimeError)
