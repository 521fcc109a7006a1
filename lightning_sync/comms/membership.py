"""Live membership: the ranks of a job as a sequence of epochs, each with its own process group.

A gloo group cannot outlive a member's death: ``abort()`` is a no-op, and a collective with a dead peer fails (at
once when the peer's sockets close, as after SIGKILL) and leaves the group unusable. So a job that keeps training
after a loss gives each *membership epoch* a group of its own, built afresh on a store prefix of its own over a
TCPStore that outlives every rank (the fault-tolerance agent's, :mod:`lightning_sync.launch.agent`), and never
reuses a group that lost a member. The default group is rebuilt for each epoch (destroyed, then initialized with
the epoch's ranks), so every collective of the run follows the membership: ours, Lightning's ``barrier`` /
``broadcast`` / ``reduce`` and torchmetrics' syncs, which all use the default group.

**Who decides the membership.** The agent does: it sees a rank process exit and publishes the next epoch, its
members in rank order (:class:`MembershipKeys`). A rank only reads it. A member is named by a stable *member id*
(its node and local slot, and how many times that slot was started), so its rank may change from epoch to epoch.

**The commit vote.** A step is applied only when every member of the epoch reports that its part completed
(torchft's ``should_commit``). Each member writes its vote to the store; the member that completes the count seals
the decision (commit when every vote says so), and a member that sees the epoch closed seals it as an abort. The
decision is sealed by ``compare_set``, so all members read the same one whatever the order of events, even when a
member voted and died before the others read: a step is committed on every survivor or on none, and an aborted
step is replayed by the next epoch's members.

**Healing.** A replacement the agent started joins at a step boundary: the commit that admits it
(:meth:`Membership.cast`) is followed, once the members have applied that step, by the epoch the agent publishes with it
(:meth:`Membership.enter_admitted`). Whoever enters an epoch with members that lack the training state (those not
yet in a committed step) first runs the ``heal`` collective: rank 0, a member that trained all along, sends the
state. The replacement runs it right after :meth:`Membership.join`, the members right after they enter, so it is
always each one's first collective in the epoch, whichever way they came in (an admission, or a replay after a
loss).

Nothing here imports Lightning; a strategy owns one :class:`Membership` and asks it for the current rank and size.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import threading
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_sync.comms.membership_keys import BEAT_S, ENV_MEMBER, ENV_STORE, MembershipKeys, parse_members

__all__ = [
    "BEAT_S",
    "ENV_MEMBER",
    "ENV_STORE",
    "Membership",
    "MembershipKeys",
    "MembershipLost",
    "parse_members",
    "poll",
]

_POLL_S = 0.002  # between two looks at the store while waiting for a vote or an epoch


class MembershipLost(RuntimeError):
    """This process is not a member of the newest epoch (it was evicted), or no new epoch came in time."""


class Membership:
    """One rank's view of the live membership, over the agent's store (see the module docstring).

    Args:
        store: the agent's store (a client ``TCPStore``), or None to connect to :data:`ENV_STORE`.
        member: this process's member id, or None to read :data:`ENV_MEMBER`.
        backend: the process groups' backend: ``"gloo"``, or ``"nccl"`` with ``device``. A gloo collective with a
            lost peer fails by itself once the peer's sockets close; an NCCL one waits on the GPU, so this member's
            heartbeat thread aborts the epoch's communicators once the agent closes the epoch (see :meth:`_beat`).
        device: this rank's CUDA device (``"nccl"`` only).
        timeout: seconds a collective of an epoch's group may take, and how long :meth:`next_epoch` waits for the
            agent to publish a new epoch before it gives up.
        keys: the protocol's keys (their job prefix).
    """

    def __init__(
        self,
        store: dist.Store | None = None,
        member: str | None = None,
        backend: str = "gloo",
        timeout: float = 60.0,
        keys: MembershipKeys | None = None,
        heal: Callable[[int], None] | None = None,
        on_enter: Callable[[], None] | None = None,
        device: torch.device | None = None,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"Membership: backend={backend!r} is not supported; allowed: ['gloo', 'nccl']")
        if backend == "nccl" and (device is None or torch.device(device).type != "cuda"):
            raise ValueError(f"Membership: backend='nccl' needs this rank's CUDA device, got device={device!r}")
        self.device = torch.device(device) if device is not None else None
        self.store = store if store is not None else connect_store(timeout)
        self.member = member if member is not None else os.environ[ENV_MEMBER]
        self.backend, self.timeout = backend, float(timeout)
        self.keys = keys or MembershipKeys()
        #: ``heal(source)``, called by every member right after it enters an epoch that has members not holding
        #: the training state yet: a collective on the epoch's group that copies the state from rank ``source``
        self.heal = heal
        #: called after this member entered an epoch (its rank and world size changed)
        self.on_enter = on_enter
        self.epoch = -1
        self.members: list[str] = []
        #: members known to hold the training state: those of the first epoch, and every member of an epoch that
        #: committed a step with this one (a newcomer holds it after its first committed step). Only a sealed
        #: decision adds to it, so every member of an epoch agrees on who still needs a heal
        self.healed: set[str] = set()
        #: the step this member runs first: 0, or for a newcomer the step its admitting epoch starts at
        self.start_step = 0
        self._admitting = False  # the last committed step admits replacements: enter_admitted() moves on
        self._beating: threading.Thread | None = None
        self._stop_beating = threading.Event()
        # the epoch whose group is up, or -1; the heartbeat thread aborts it (NCCL) under this lock, which the main
        # thread holds to tear a group down
        self._group_lock = threading.Lock()
        self._group_epoch = -1
        #: NCCL: the epoch's gloo group of the same ranks, for host tensors (None on gloo, whose group takes them)
        self.host_group: dist.ProcessGroup | None = None
        #: how many epochs' communicators this member aborted because the agent closed them (NCCL)
        self.aborts = 0

    # ------------------------------------------------------------------ the epoch
    @property
    def rank(self) -> int:
        return self.members.index(self.member)

    @property
    def world_size(self) -> int:
        return len(self.members)

    def newest_epoch(self) -> int:
        return int(self.store.get(self.keys.epoch))

    def join(self) -> None:
        """Start this member's heartbeat and enter the newest epoch, waiting for the agent to publish the first one.
        A replacement (a member the agent started after a loss) waits to be admitted at a step boundary and starts
        at that epoch's step."""
        self.start()
        self._enter_after(-1)
        if self.epoch > 0:
            self.start_step = int(self.store.get(self.keys.start(self.epoch)))

    def start(self) -> None:
        """Start this member's heartbeat (:meth:`join` does it first): the agent watches a process from its start."""
        if self._beating is None:
            self._beating = threading.Thread(target=self._beat, args=(self.store.clone(),), daemon=True)
            self._beating.start()
            atexit.register(self.close)

    def waits_to_join(self) -> bool:
        """Whether this process is a replacement the agent started for a running job (the agent lists it as
        waiting before it starts it): it is admitted at a step boundary, after its peers' next commit."""
        waiting = self.store.get(self.keys.waiting) if self.store.check([self.keys.waiting]) else b""
        return self.member in parse_members(waiting)

    def next_epoch(self) -> None:
        """After a failure: leave the current epoch's group and enter the next epoch the agent publishes."""
        self._enter_after(self.epoch)

    @property
    def admitting(self) -> bool:
        """Whether the last committed step admitted replacements (:meth:`enter_admitted` then moves on)."""
        return self._admitting

    def enter_admitted(self) -> bool:
        """At the first step boundary after a committed step that admitted replacements: enter the epoch the agent
        published with them (its first collective heals them). Called where the training state is whole, the
        committed step applied; returns whether it moved on."""
        if not self._admitting:
            return False
        self._admitting = False
        self.next_epoch()
        return True

    def _enter_after(self, after: int) -> None:
        """Enter the newest epoch after ``after`` once each of its members has shown up (so that building its group
        cannot wait for a member lost meanwhile: then the agent closes that epoch too, and the next one is taken),
        and heal the members that need the training state. A heal that fails (a member lost while it ran) moves on
        to the next epoch in the same way."""
        while True:
            epoch = self._wait_for_epoch(after)
            members = parse_members(self.store.get(self.keys.members(epoch)))
            if self.member not in members and self.epoch < 0 and self._is_waiting():
                after = epoch  # a replacement, not admitted yet: the next epoch may
                continue
            if self.member not in members:
                raise MembershipLost(
                    f"Membership: member {self.member!r} is not in epoch {epoch} ({members}); it was evicted"
                )
            if not self._all_present(epoch, members):
                after = epoch
                continue
            self._destroy_group()  # a group that lost a member is never reused
            self.epoch, self.members = epoch, members
            if epoch == 0:
                self.healed = set(members)
            if self.device is not None:
                torch.cuda.set_device(self.device)  # NCCL's communicators start lazily, at the first collective
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore(self.keys.group(epoch), self.store),
                rank=self.rank,
                world_size=self.world_size,
                timeout=datetime.timedelta(seconds=self.timeout),
            )
            self._group_epoch = epoch
            # NCCL moves device memory only: a gloo group beside it carries what lives on the host (ZeRO's buddy
            # copies go from one rank's host memory to another's, off the GPU)
            timeout = datetime.timedelta(seconds=self.timeout)
            self.host_group = dist.new_group(backend="gloo", timeout=timeout) if self.backend == "nccl" else None
            if self.on_enter is not None:
                self.on_enter()
            if self._healed_here():
                return
            after = epoch

    def _healed_here(self) -> bool:
        """Copy the training state to the epoch's members that lack it (False: a member was lost meanwhile)."""
        if set(self.members) <= self.healed:
            return True
        if self.heal is None:
            raise ValueError(
                f"Membership: members {sorted(set(self.members) - self.healed)} joined and need the training "
                f"state, but this Membership has no heal function"
            )
        try:
            self.heal(0)  # rank 0 holds it: the agent lists replacements after the members that trained
        except RuntimeError as exc:  # a collective with a lost member
            traceback.clear_frames(exc.__traceback__)
            self.leave()
            return False
        return True

    def _beat(self, store: dist.Store) -> None:
        """The heartbeat thread, on a store client of its own: it beats while the process runs (even while the main
        thread waits inside a collective, which releases the GIL) and stops when the process stops."""
        key = self.keys.beat(self.member)
        while not self._stop_beating.is_set():
            try:
                store.add(key, 1)
                if self.backend == "nccl":
                    self.abort_if_closed(store)
            except (RuntimeError, dist.DistError):  # the agent's store is gone: the job is over
                return
            self._stop_beating.wait(BEAT_S)

    def abort_if_closed(self, store: dist.Store) -> bool:
        """Abort the current epoch's group if the agent closed the epoch (a member was lost). An NCCL collective
        with a lost peer does not fail by itself: it waits on the GPU, and the main thread with it, until the
        communicator is aborted; the collective then raises, and the loss goes on as with gloo. True if it did."""
        epoch = self._group_epoch
        if epoch < 0 or not store.check([self.keys.closed(epoch)]):
            return False
        with self._group_lock:
            if self._group_epoch != epoch or not dist.is_initialized():
                return False
            self._group_epoch = -1
            try:  # every backend's communicators; the group stays registered until the main thread tears it down
                dist.group.WORLD.abort()
            except RuntimeError:  # already failing by itself: the heartbeat must go on, or the agent evicts this one
                return False
            self.aborts += 1
        return True

    def _destroy_group(self) -> None:
        with self._group_lock:
            self._group_epoch, self.host_group = -1, None
            if dist.is_initialized():
                dist.destroy_process_group()

    def _is_waiting(self) -> bool:
        """Whether this member is a replacement the agent started and the membership has not admitted yet; if so,
        say that it is up (the next committed step admits it)."""
        waiting = parse_members(self.store.get(self.keys.waiting)) if self.store.check([self.keys.waiting]) else []
        if self.member not in waiting:
            return False
        self.store.set(self.keys.ready(self.member), b"1")
        return True

    def _wait_for_epoch(self, after: int) -> int:
        if not poll(lambda: self.store.check([self.keys.epoch]) and self.newest_epoch() > after, self.timeout):
            raise MembershipLost(f"Membership: no epoch after {after} was published within {self.timeout:g} s")
        return self.newest_epoch()  # epochs only grow: still after ``after``

    def _all_present(self, epoch: int, members: list[str]) -> bool:
        """Announce this member in ``epoch``; True once every member has, False if the epoch closed first."""
        present = self.keys.present(epoch)
        self.store.set(f"{present}/{self.member}", b"1")
        keys, closed = [f"{present}/{m}" for m in members], [self.keys.closed(epoch)]
        if not poll(lambda: self.store.check(keys) or self.store.check(closed), self.timeout):
            raise MembershipLost(f"Membership: not every member of epoch {epoch} showed up within {self.timeout:g} s")
        return self.store.check(keys)

    def leave(self) -> None:
        """Tear down this epoch's group and close its connections (a failure, or the end of the run). The group's
        sockets close only when nothing refers to it any more: until they do, a peer blocked in a collective with
        this member waits out the group's timeout. After a failure :meth:`run_committed` clears the failed call's
        frames, which held it; the young generations' collection catches what is left in reference cycles (a full
        one would cost about 90 ms with torch loaded, nine times the teardown itself)."""
        if dist.is_initialized():
            self._destroy_group()
            gc.collect(1)

    def close(self) -> None:
        """The end of the run: stop the heartbeat and tear down the group. Registered at exit too: a heartbeat
        thread still inside a store call while the interpreter shuts down aborts the process (SIGABRT), which the
        agent would count as a loss."""
        if self._beating is not None:
            try:  # before the beat stops: the agent then gives the exit its time
                self.store.set(self.keys.leaving(self.member), b"1")
            except (RuntimeError, dist.DistError):  # the agent's store is gone: the job is over
                pass
            self._stop_beating.set()
            self._beating.join(timeout=5.0)
            self._beating = None
            atexit.unregister(self.close)
        self.leave()

    # ------------------------------------------------------------------ the commit vote
    def vote(self, step: int, ok: bool, admits: bool = True) -> bool:
        """Whether step ``step`` is committed in this epoch: every member's part completed (``ok`` is this
        member's). A collective over the store, not the group, so it works with the group broken; see the module
        docstring for why every member reads the same decision. A committed step admits the replacements that are
        ready only where every member's ``admits`` says it may (its state is whole for a heal after this step)."""
        self.cast(step, ok, admits)
        return self.decision(step)

    def cast(self, step: int, ok: bool, admits: bool = True) -> None:
        """This member's vote on ``step``; the member whose vote completes the count seals the decision."""
        key = self.keys.vote(self.epoch, step)
        self.store.set(f"{key}/vote/{self.rank}", (b"1" if admits else b"2") if ok else b"0")
        if self.store.add(f"{key}/votes", 1) == self.world_size:
            votes = self.store.multi_get([f"{key}/vote/{r}" for r in range(self.world_size)])
            commit = all(v != b"0" for v in votes)
            admit = commit and all(v == b"1" for v in votes)
            if admit and (ready := self._ready_replacements()):  # before the decision: whoever reads it, reads this
                self.store.compare_set(self.keys.admit(self.epoch), "", f"{step}:{','.join(ready)}")
            self.store.compare_set(f"{key}/decision", "", "commit" if commit else "abort")

    def replacements_waiting(self) -> bool:
        """Whether the agent started replacements that are not admitted yet (one may be admitted at a coming step)."""
        return (
            bool(parse_members(self.store.get(self.keys.waiting))) if self.store.check([self.keys.waiting]) else False
        )

    def _ready_replacements(self) -> list[str]:
        if not self.store.check([self.keys.waiting]):
            return []
        waiting = parse_members(self.store.get(self.keys.waiting))
        return [m for m in waiting if self.store.check([self.keys.ready(m)])]

    def admitted_after(self, step: int) -> bool:
        """Whether this epoch admits replacements after its committed step ``step`` (then every member enters the
        next epoch, which the agent publishes with them)."""
        key = self.keys.admit(self.epoch)
        return self.store.check([key]) and self.store.get(key).split(b":", 1)[0] == str(step).encode()

    def decision(self, step: int) -> bool:
        """Wait for ``step``'s sealed decision (sealing it as an abort once the epoch is closed); True: commit."""
        decision = f"{self.keys.vote(self.epoch, step)}/decision"
        closed = self.keys.closed(self.epoch)
        if not poll(lambda: self.store.check([decision]) or self.store.check([closed]), self.timeout):
            raise MembershipLost(
                f"Membership: step {step}'s vote in epoch {self.epoch} did not end within {self.timeout:g} s "
                f"and no member was reported lost"
            )
        if not self.store.check([decision]):  # a member was lost before every vote was in
            self.store.compare_set(decision, "", "abort")
        return self.store.get(decision) == b"commit"

    def run_committed(self, step: int, attempt: Callable[[], None], admits: Callable[[], bool] | None = None) -> int:
        """Run ``attempt`` (this member's part of step ``step``, its collectives included) until the members commit
        it; after an abort, enter the next epoch and run it again there (``attempt`` reads :attr:`rank` and
        :attr:`world_size` anew). Returns how many attempts were aborted. An error that no lost member explains
        (no new epoch follows) is raised again once :meth:`next_epoch` gives up. A commit that admits replacements
        is entered by :meth:`enter_admitted`, once the caller has applied the step; ``admits()``, asked after a
        completed attempt, says whether this member lets the step admit any (:meth:`vote`)."""
        aborted = 0
        while True:
            error: BaseException | None = None
            try:
                attempt()
            except RuntimeError as exc:  # a collective with a lost member (gloo: "Connection reset by peer")
                error = exc
                # at once, before the vote: a survivor still inside a collective with this member waits on its
                # sockets (not the lost one's) until the group's timeout unless they close. The failed call's frames
                # hold the group: their locals go (the traceback's lines stay, for the error raised if no epoch
                # follows)
                traceback.clear_frames(exc.__traceback__)
                self.leave()
            if self.vote(step, error is None, error is None and (admits is None or admits())):
                self.healed |= set(self.members)
                self._admitting = self.admitted_after(step)
                return aborted
            aborted += 1
            try:
                self.next_epoch()
            except MembershipLost as lost:
                raise lost from error


def poll(ready: Callable[[], bool], timeout: float) -> bool:
    """Ask ``ready()`` every few milliseconds until it says True (True) or ``timeout`` seconds have passed (False):
    how the members and the agents wait on the store."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


def connect_store(timeout: float) -> dist.TCPStore:
    """A client of the agent's store named by :data:`ENV_STORE` (``host:port``)."""
    try:
        host, port = os.environ[ENV_STORE].rsplit(":", 1)
    except (KeyError, ValueError):
        raise ValueError(
            f"Membership: {ENV_STORE}={os.environ.get(ENV_STORE)!r}; expected host:port of the fault-tolerance "
            f"agent's store (start the job with `python -m lightning_sync.launch.agent`)"
        ) from None
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout))
