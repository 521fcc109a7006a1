"""The commit vote and the epoch bookkeeping of :class:`~lightning_sync.comms.membership.Membership`, in one process:
several members over one real TCPStore, no process group (their epochs are set by hand, as :meth:`join` would).
The multi-process behaviour, with SIGKILL and real gloo groups, is ``tests/multiprocess/test_live_membership.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_sync.comms.membership import Membership, MembershipKeys, MembershipLost
from lightning_sync.launch.agent import Agent
from lightning_sync.launch.node import start_rank


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _members(store: dist.TCPStore, n: int, epoch: int = 0) -> list[Membership]:
    ids = [f"m{i}" for i in range(n)]
    out = []
    for member in ids:
        m = Membership(store, member, timeout=2.0)
        m.epoch, m.members = epoch, list(ids)
        out.append(m)
    return out


@pytest.mark.parametrize(("oks", "want"), [((True, True, True), True), ((True, False, True), False)])
def test_the_decision_is_commit_only_when_every_member_says_so(
    store: dist.TCPStore, oks: tuple[bool, ...], want: bool
) -> None:
    members = _members(store, 3)
    for m, ok in zip(members, oks):
        m.cast(5, ok)
    assert [m.decision(5) for m in members] == [want] * 3


def test_a_closed_epoch_aborts_the_votes_still_open(store: dist.TCPStore) -> None:
    a, b, _lost = _members(store, 3)
    a.cast(2, True)
    b.cast(2, True)
    store.set(MembershipKeys().closed(0), b"1")  # the agent saw the third member exit before it voted
    assert a.decision(2) is False and b.decision(2) is False


def test_a_vote_completed_before_the_epoch_closed_stays_committed(store: dist.TCPStore) -> None:
    """The lost member voted to commit, then died: the count completed, so the commit is sealed, and a survivor that
    reads the decision only after the agent closed the epoch still reads commit."""
    members = _members(store, 3)
    for m in members:
        m.cast(7, True)
    store.set(MembershipKeys().closed(0), b"1")
    assert [m.decision(7) for m in members[:2]] == [True, True]


def test_votes_of_different_steps_and_epochs_do_not_mix(store: dist.TCPStore) -> None:
    old = _members(store, 2, epoch=0)
    new = _members(store, 2, epoch=1)
    old[0].cast(3, False)
    for m in new:
        m.cast(3, True)
    assert [m.decision(3) for m in new] == [True, True]


def test_a_vote_no_loss_explains_times_out_with_a_message(store: dist.TCPStore) -> None:
    a, _ = _members(store, 2)
    a.cast(1, True)
    with pytest.raises(MembershipLost, match="step 1's vote in epoch 0 did not end within 2 s"):
        a.decision(1)


def test_an_evicted_member_is_told_so(store: dist.TCPStore) -> None:
    keys = MembershipKeys()
    store.set(keys.members(0), b"m0,m1")
    store.set(keys.epoch, b"0")
    with pytest.raises(MembershipLost, match="member 'm2' is not in epoch 0"):
        Membership(store, "m2", timeout=1.0).join()


def test_bad_arguments_name_the_value_and_the_allowed_ones(store: dist.TCPStore) -> None:
    with pytest.raises(ValueError, match=r"backend='mpi' is not supported; allowed: \['gloo', 'nccl'\]"):
        Membership(store, "m0", backend="mpi")
    with pytest.raises(ValueError, match=r"backend='nccl' needs this rank's CUDA device, got device='cpu'"):
        Membership(store, "m0", backend="nccl", device="cpu")
    with pytest.raises(ValueError, match=r"nproc must be an int >= 1, got 0"):
        Agent(["python", "x.py"], 0)
    with pytest.raises(ValueError, match=r"command=\[\] is empty"):
        Agent([], 2)
    with pytest.raises(ValueError, match=r"max_restarts must be an int >= 0, got -1"):
        Agent(["python", "x.py"], 2, max_restarts=-1)
    with pytest.raises(ValueError, match=r"hang_timeout=0; allowed: seconds > 0"):
        Agent(["python", "x.py"], 2, hang_timeout=0)


def test_a_missing_store_address_says_how_to_start_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIGHTNING_SYNC_FT_STORE", raising=False)
    with pytest.raises(ValueError, match="start the job with"):
        Membership(member="m0")


def test_the_epochs_group_is_aborted_once_the_agent_closes_it_and_only_then(store: dist.TCPStore) -> None:
    """What the heartbeat thread does for NCCL, whose collectives with a lost peer wait on the GPU until their
    communicator is aborted. Here on a real one-process gloo group, where the abort itself does nothing: the check
    is when it happens, once per epoch, and that the group stays registered for the main thread to tear down."""
    member = Membership(store, "m0", timeout=2.0)
    member.members = ["m0"]
    member.keys = MembershipKeys(prefix="abort")
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("abort/g", store), rank=0, world_size=1)
        member.epoch, member._group_epoch = 3, 3
        assert member.abort_if_closed(store) is False and member.aborts == 0  # the epoch is open
        store.set(member.keys.closed(3), b"1")
        assert member.abort_if_closed(store) is True and member.aborts == 1
        assert dist.is_initialized()  # aborted, not destroyed: the main thread's leave() tears it down
        assert member.abort_if_closed(store) is False and member.aborts == 1  # once
        member.leave()
        assert not dist.is_initialized() and member._group_epoch == -1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_rank_process_gets_the_nccl_settings_its_membership_relies_on(tmp_path: Path) -> None:
    """A collective's ``wait()`` must block until it completed, and raise once its communicator is aborted (then a
    member votes only on a finished all-reduce); NCCL's watchdog must leave errors to the membership. An explicit
    environment for the ranks still wins."""
    names = ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "LIGHTNING_SYNC_FT_MEMBER")
    out = tmp_path / "env.json"
    script = f"import json, os; open({str(out)!r}, 'w').write(json.dumps([os.environ.get(k) for k in {names!r}]))"
    for env, blocking in (({}, "1"), ({"TORCH_NCCL_BLOCKING_WAIT": "0"}, "0")):
        assert start_rank([sys.executable, "-c", script], env, "127.0.0.1:1", "n0s2i1").wait(timeout=60) == 0
        assert json.loads(out.read_text()) == [blocking, "0", "n0s2i1"]


def test_a_replacement_knows_it_is_one_before_it_joins(store: dist.TCPStore) -> None:
    """The agent lists a replacement as waiting before it starts it, so the process can set itself up first and
    join at the end of its setup; one of the job's first members is not on that list."""
    keys = MembershipKeys(prefix="waits")
    store.set(keys.waiting, b"n0s1i1,n1s0i2")
    assert Membership(store, "n0s1i1", keys=keys).waits_to_join()
    assert not Membership(store, "n0s1i0", keys=keys).waits_to_join()
    assert not Membership(store, "n0s0i0", keys=MembershipKeys(prefix="none")).waits_to_join()  # no list at all


@pytest.mark.parametrize(("admits", "want"), [((True, True), "3:r1"), ((True, False), None)])
def test_a_commit_admits_a_ready_replacement_only_where_every_member_lets_it(
    store: dist.TCPStore, admits: tuple[bool, bool], want: str | None
) -> None:
    """A member whose state is not whole for a heal after this step (ZeRO's snapshot still on its way) votes to commit
    without admitting: the step commits, and the replacement waits for a later one."""
    keys = MembershipKeys()
    store.set(keys.waiting, b"r1")
    store.set(keys.ready("r1"), b"1")
    members = _members(store, 2)
    for m, admit in zip(members, admits):
        m.cast(3, True, admit)
    assert [m.decision(3) for m in members] == [True, True]
    key = keys.admit(0)
    assert (store.get(key).decode() if store.check([key]) else None) == want
    assert [m.admitted_after(3) for m in members] == [want is not None] * 2
    assert members[0].replacements_waiting()


def test_a_rank_that_finished_is_not_taken_for_hung_while_it_exits(tmp_path: Path) -> None:
    """A rank stops beating when it closes its membership at exit; the rest of its exit (the interpreter's teardown,
    seconds on a loaded machine) is no hang, and killing it there turned a finished job's status into a failure."""
    script = tmp_path / "slow_exit.py"
    script.write_text(
        "import time\n"
        "from lightning_sync.comms.membership import Membership\n"
        "membership = Membership()\n"
        "membership.start()\n"
        "time.sleep(1.0)\n"
        "membership.close()\n"
        "time.sleep(2.0)  # a slow exit, silent\n"
    )
    agent = Agent([sys.executable, str(script)], 1, hang_timeout=0.5)
    assert agent.run() == 0 and agent.hung == [], agent.losses
