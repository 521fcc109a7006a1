"""Hang watchdog for the collectives layer: a hang becomes an error, on every live rank, that names the culprit.

With a :class:`Watchdog` started (:meth:`~lightning_sync.comms.context.CommContext.start_watchdog`, or the
Lightning callback :class:`lightning_sync.diagnostics.HangWatchdog`), it is a call hook of its context
(:mod:`lightning_sync.comms.hooks`, the one that waits for backend requests), so every collective issued there
is tracked by group, sequence number and signature (op name, byte size, dtype and shape, reduce op, root rank,
the logged key of a Lightning ``sync_dist`` reduction: :mod:`lightning_sync.comms.diagnosis`), and:

* **A collective that does not complete within ``timeout`` seconds** fails on the rank that waits for it
  with a :class:`CollectiveTimeout` such as ``all_reduce #412 (4.0 kB) on world did not complete within
  300 s: ranks [1] never joined``, or ``... ranks took different code paths at #412: barrier (0 B) on
  ranks [1]; all_reduce (4.0 kB, float32[1000], sum) on ranks [0, 2]``. That rank posts the message to an
  abort key, and every other rank's watchdog picks it up within ``interval`` seconds and fails its own pending
  or next collective with it. So every live rank raises, within ``timeout + 3 * interval`` seconds, and the
  message is the same everywhere.
* **A collective that fails** (gloo's "Connection closed by peer" when a peer died) is re-raised as
  :class:`RankLost` naming the ranks whose heartbeat stopped: ``all_reduce #87 (1.2 MB) on world failed
  (Connection closed by peer ...): ranks [1] lost (no heartbeat for 2.1 s; last seen in all_reduce #87)``.
* **Collectives that pair up across different calls** do not hang, so no timeout fires: rank 0 logs ``a``
  then ``b`` with ``sync_dist`` and rank 1 logs ``b`` then ``a``, and each key is averaged with the other.
  Every rank keeps a running hash of the signatures it issued on each group; :meth:`Watchdog.verify` (a collective
  the Lightning callback runs every few steps and at the end of each stage) compares them, and on a
  difference every rank raises the same :class:`CollectiveMismatch` naming the first call that differed and
  the ranks on each side: ``ranks issued different collectives on world at #57 that paired up:
  all_reduce (4 B, float32[], avg, 'training_step.a') on ranks [0]; all_reduce (4 B, float32[], avg,
  'training_step.b') on ranks [1]``. A mismatch is caught only between calls whose signatures differ: two
  tensors of one shape and dtype, reduced under no logged key, look the same.

**The side channel.** Every rank's watchdog thread publishes a small record to the job's rendezvous store
every ``interval`` seconds (:mod:`lightning_sync.comms.heartbeat`): a heartbeat counter, the last sequence number
it issued on each group with the last few ops, and the collective it is waiting in. Diagnosis reads the records of
the group's ranks twice, ``2 * interval`` apart: a rank whose counter did not move is lost; a rank whose last
sequence number is below the pending one never joined; a rank whose signature at that sequence number differs
took another code path (the smallest group of ranks is named first).

**Cost.** Issuing a collective appends its signature to an in-process ring (the last 4096 per group) and
folds it into the group's CRC-32, under a lock. Waiting never passes the backend a timeout (on NCCL one that
runs out aborts the communicator): a completed request returns at once, and an incomplete one is waited for by
the cheapest means its backend offers (:mod:`lightning_sync.comms.waiting`).

**Ranks blocked outside comms.** A rank stuck in a call that cannot be interrupted (a backend call that
blocks inside its launch, or a collective issued without ``lightning_sync.comms``) cannot raise. When the
abort has been set for ``exit_after`` seconds and the watchdog has not been stopped, the watchdog thread
writes the error to stderr and ends the process with exit code 1, as torch's NCCL watchdog does.

**Trust.** The records travel through the rendezvous store, which like everything in torch.distributed
belongs on a trusted private network (see the README's trust model).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from lightning_sync.comms.diagnosis import (
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    Pending,
    RankLost,
    explain,
    mismatch,
    sequence_key,
    signature,
)
from lightning_sync.comms.heartbeat import Heartbeats
from lightning_sync.comms.hooks import Call, CallHook
from lightning_sync.comms.payload import device_of, group_ranks
from lightning_sync.comms.waiting import Waiter

__all__ = [
    "CollectiveError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "Pending",
    "RankLost",
    "Watchdog",
    "check_args",
    "sequence_key",
]

_HISTORY = 8  # ops per group in a rank's published record: enough to compare the op at a pending seq
_KEPT = 4096  # ops per group kept in memory, to name the first that differs when verify finds a mismatch


def check_args(timeout: Any, interval: Any = None, exit_after: Any = None) -> tuple[float, float, float]:
    """Validate the watchdog's arguments (see :class:`Watchdog`); returns them with defaults filled in."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    interval = min(1.0, timeout / 5) if interval is None else interval
    if isinstance(interval, bool) or not isinstance(interval, int | float) or not 0 < interval < timeout:
        raise ValueError(f"interval must be a number of seconds in (0, timeout={timeout}), got {interval!r}")
    exit_after = timeout if exit_after is None else exit_after
    if isinstance(exit_after, bool) or not isinstance(exit_after, int | float) or exit_after < 0:
        raise ValueError(f"exit_after must be a number of seconds >= 0, got {exit_after!r}")
    return float(timeout), float(interval), float(exit_after)


class Watchdog(CallHook):
    """Turns hung or failed collectives of :mod:`lightning_sync.comms` into errors naming the culprit ranks.

    Args:
        timeout: seconds a collective may take before it is declared hung (> 0).
        interval: heartbeat and polling period in seconds (default ``min(1, timeout / 5)``; must be
            below ``timeout``).
        exit_after: seconds after an abort before a process whose main thread is blocked outside
            ``comms`` is ended with exit code 1 (default ``timeout``; >= 0).
    """

    def __init__(self, timeout: float, interval: float | None = None, exit_after: float | None = None) -> None:
        timeout, interval, exit_after = check_args(timeout, interval, exit_after)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "the hang watchdog needs the default process group: start it after "
                "init_process_group (the HangWatchdog callback does so in setup)"
            )
        self.timeout, self.interval, self.exit_after = float(timeout), float(interval), float(exit_after)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._heartbeats = Heartbeats(self.rank, self.world_size, self.interval, self._record)
        self._read = self._heartbeats.read  # the peers' records as last published
        self._lock = threading.Lock()
        self._last: dict[str, int] = {}
        self._issued: dict[str, deque[tuple[int, str, int, str, int]]] = {}  # seq, op, nbytes, detail, hash
        self._hash: dict[str, tuple[int, list[int]]] = {}  # group key: running CRC-32 of signatures, its ranks
        self._verified: dict[str, int] = {}  # group key: the last seq that verify found the same on every rank
        self._pending: dict[int, Pending] = {}
        self._waiting: Pending | None = None
        self._error: CollectiveError | None = None
        self._error_at = 0.0
        self._waiter = Waiter(self.check, self.interval)
        self._beat = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lightning_sync-watchdog", daemon=True)

    # ------------------------------------------------------------------ as a call hook (the issuing thread)

    waits = True  # it waits for the backend requests itself, in slices that an abort interrupts

    def on_issue(self, call: Call) -> Pending:
        """Record a collective about to be launched; raises the pending abort instead, if there is one. The token
        is the call as the watchdog tracks it."""
        self.check()
        like, ranks = call.like, list(group_ranks(call.group))
        on_cpu = (like.device if like is not None else device_of(call.group)).type == "cpu"
        detail = signature(like, call.detail, call.label)
        p = Pending(call.op, call.seq, call.group_name, ranks, call.nbytes, call.peer, on_cpu, detail)
        key, op, nbytes = p.key, p.op, p.nbytes
        with self._lock:
            self._last[key] = p.seq
            running = 0
            if p.peer is None:  # point-to-point sequence numbers do not pair up across ranks: nothing to compare
                running = zlib.crc32(f"{op}|{nbytes}|{detail}".encode(), self._hash.get(key, (0,))[0])
                self._hash[key] = (running, p.ranks)
            self._issued.setdefault(key, deque(maxlen=_KEPT)).append((p.seq, op, nbytes, detail, running))
            self._pending[id(p)] = p
        return p

    def on_launched(self, call: Call, token: Pending, handles: Sequence[Any]) -> None:
        token.handles = list(handles)

    def wait(self, token: Pending, handle: Any) -> None:
        """Wait for one backend request of ``token`` (never with a timeout); raise the diagnosis if it hangs or
        fails."""
        self.check()
        self._waiting = token
        try:
            failure = self._waiter.wait(handle, token.on_cpu)
        finally:
            self._waiting = None
        if isinstance(failure, RuntimeError):
            raise self._backend_failed(token, failure) from failure
        if failure is not None:
            raise failure

    def launch_failed(self, token: Pending, error: BaseException) -> BaseException | None:
        """A launch the backend refused (gloo's send writes in its launch, and fails there once the peer is gone):
        diagnosed as a failed wait is."""
        return self._backend_failed(token, error) if isinstance(error, RuntimeError) else None

    def _backend_failed(self, token: Pending, failure: RuntimeError) -> CollectiveError:
        cause = str(failure).strip().splitlines()[-1][:300] if str(failure).strip() else type(failure).__name__
        return self._fail(RankLost, token, f"failed ({cause})")

    def on_complete(self, call: Call, token: Pending, ok: bool) -> None:
        """A completed call is no longer pending. One that failed stays pending: past the timeout the watchdog
        aborts the peers still waiting in it, naming what this rank did instead."""
        if ok:
            with self._lock:
                self._pending.pop(id(token), None)

    def begin_job(self) -> None:
        """A new job on this group: forget the collectives issued so far (:meth:`forget`)."""
        self.forget()

    def forget(self) -> None:
        """Forget the collectives issued so far: their sequence numbers start again (a new job on this group)."""
        with self._lock:
            for records in (self._last, self._issued, self._hash, self._verified):
                records.clear()

    def check(self) -> None:
        """Raise the abort of this or another rank, if one happened."""
        if self._error is not None:
            raise type(self._error)(str(self._error))

    def verify(self, ctx: Any) -> None:
        """Raise :class:`CollectiveMismatch` on every rank, naming the first call that differs, unless every rank
        issued the same collectives on every group so far (same count, same signatures in the same order).
        Collective over the default group: one small ``all_gather_object`` (a second on a mismatch), recorded under
        the op prefix ``watchdog/``. Every rank compares the same gathered hashes, so all raise alike."""
        self.check()
        with self._lock:
            mine = {key: (self._last[key], running, ranks) for key, (running, ranks) in self._hash.items()}
        with ctx.scope("watchdog"):
            states = ctx.all_gather_object(mine)
        members = {key: ranks for state in states for key, (_, _, ranks) in state.items()}
        differ = sorted(
            key for key, ranks in members.items() if len({tuple(states[r].get(key, (0, 0))[:2]) for r in ranks}) > 1
        )
        if not differ:
            self._verified.update({key: seq for key, (seq, _, _) in mine.items()})
            return
        key = differ[0]
        with self._lock:
            tail = [e for e in self._issued.get(key, ()) if e[0] > self._verified.get(key, 0)]
        with ctx.scope("watchdog"):
            tails = ctx.all_gather_object(tail)
        raise self._set_error(CollectiveMismatch(mismatch(key, {r: tails[r] for r in members[key]})), post=False)

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        self._heartbeats.publish()
        self._thread.start()

    def stop(self, clean: bool = True) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._waiter.close()
        self._thread.join(timeout=5 * self.interval + 5)
        if clean:
            try:
                self._heartbeats.publish(state="done")
            except Exception:  # noqa: BLE001 - the store host may be gone already; leaving is still fine
                pass

    @property
    def error(self) -> CollectiveError | None:
        """The abort this rank raised or received, if any."""
        return self._error

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            try:
                self._heartbeats.publish()
                if self._error is None:
                    self._poll_abort()
                if self._error is None:
                    stuck = self._stuck()
                    if stuck is not None:
                        self._fail(CollectiveTimeout, stuck, f"did not complete within {self.timeout:g} s")
            except Exception as err:  # noqa: BLE001 - the store (or its host) is gone; diagnosis says so
                stuck = self._stuck() if self._error is None else None
                if stuck is not None:
                    self._set_error(
                        CollectiveTimeout(
                            f"{stuck.label()} did not complete within {self.timeout:g} s; {self.store_lost(err)}"
                        ),
                        post=False,
                    )
            if self._error is not None and time.monotonic() - self._error_at > self.exit_after:
                self._hard_exit()

    def _stuck(self) -> Pending | None:
        now = time.monotonic()
        with self._lock:
            for key, p in list(self._pending.items()):
                if p.completed():
                    del self._pending[key]  # issued async and never waited: done all the same
                elif now - p.start > self.timeout:
                    return p
        return None

    def _poll_abort(self) -> None:
        posted = self._heartbeats.posted_abort()
        if posted is not None:
            kind = RankLost if posted["kind"] == "RankLost" else CollectiveTimeout
            self._set_error(
                kind(f"aborted by the hang watchdog of rank {posted['rank']}: {posted['message']}"), post=False
            )

    def _hard_exit(self) -> None:
        if self._stopped.is_set():
            return
        sys.stderr.write(
            f"lightning_sync watchdog: rank {self.rank} is still running {self.exit_after:g} s after "
            f"the abort, blocked outside lightning_sync.comms; ending the process (exit code 1). "
            f"The abort: {self._error}\n"
        )
        sys.stderr.flush()
        os._exit(1)

    # ------------------------------------------------------------------ records and diagnosis

    def _record(self, state: str) -> dict[str, Any]:
        with self._lock:
            self._beat += 1
            waiting = self._waiting
            return {
                "beat": self._beat,
                "state": state,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "last": dict(self._last),
                "hist": {k: [v[i][:4] for i in range(-min(len(v), _HISTORY), 0)] for k, v in self._issued.items()},
                "waiting": None
                if waiting is None
                else f"{waiting.label()} for {time.monotonic() - waiting.start:.1f} s",
            }

    def store_lost(self, err: BaseException) -> str:
        """What to say when the rendezvous store cannot be reached: its host is gone."""
        return self._heartbeats.lost(err)

    def lost_ranks(self) -> list[int]:
        """Ranks whose heartbeat does not move over ``2 * interval`` seconds (the store host's loss raises)."""
        return self._heartbeats.survey([r for r in range(self.world_size) if r != self.rank])[1]

    def _set_error(self, err: CollectiveError, post: bool) -> CollectiveError:
        with self._lock:
            if self._error is not None:
                return self._error
            if post:  # the first rank to post wins; everyone raises that message
                self._heartbeats.post_abort(type(err).__name__, str(err))
            self._error, self._error_at = err, time.monotonic()
        self._waiter.wake()
        return err

    def _fail(self, kind: type[CollectiveError], p: Pending, what: str) -> CollectiveError:
        if self._error is not None:
            return self._error
        try:
            message = self._diagnose(p, what)
        except Exception as err:  # noqa: BLE001 - the store host is gone: that is the diagnosis
            return self._set_error(kind(f"{p.label()} {what}; {self.store_lost(err)}"), post=False)
        return self._set_error(kind(message), post=True)

    def _diagnose(self, p: Pending, what: str) -> str:
        others = [r for r in ([p.peer] if p.peer is not None else p.ranks) if r != self.rank]
        records, lost = self._heartbeats.survey(others)
        return explain(p, what, self.rank, records, lost, silent_for=2 * self.interval + 0.1)
