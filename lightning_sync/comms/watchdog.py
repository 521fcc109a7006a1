"""Hang watchdog for the collectives layer: a hang becomes an error, on every live rank, that names the culprit.

With a :class:`Watchdog` started (:func:`start`, or the Lightning callback
:class:`lightning_sync.diagnostics.HangWatchdog`), every collective issued through
:mod:`lightning_sync.comms` is tracked by group, sequence number, op name and byte size, and:

* **A collective that does not complete within ``timeout`` seconds** fails on the rank that waits for it
  with a :class:`CollectiveTimeout` such as ``all_reduce #412 (4000 B) on world did not complete within
  300 s: ranks [1] never joined``, or ``... ranks took different code paths at #412: barrier (0 B) on
  ranks [1]; all_reduce (4000 B) on ranks [0, 2]``. That rank posts the message to an abort key, and every
  other rank's watchdog picks it up within ``interval`` seconds and fails its own pending or next
  collective with it. So every live rank raises, within ``timeout + 3 * interval`` seconds, and the
  message is the same everywhere.
* **A collective that fails** (gloo's "Connection closed by peer" when a peer died) is re-raised as
  :class:`RankLost` naming the ranks whose heartbeat stopped: ``all_reduce #87 (1.2 MB) on world failed
  (Connection closed by peer ...): ranks [1] lost (no heartbeat for 2.1 s; last seen in all_reduce #87)``.

**The side channel.** Every rank's watchdog thread publishes a small JSON record to the job's rendezvous
store (a separate TCPStore client connected to the default process group's store, so it never queues
behind a blocking store call of the main thread) every ``interval`` seconds: a heartbeat counter, the
last sequence number it issued on each group with the last few ops, and the collective it is waiting in.
Diagnosis reads the records of the group's ranks twice, ``2 * interval`` apart: a rank whose counter did
not move is lost; a rank whose last sequence number is below the pending one never joined; a rank whose
op at that sequence number differs took another code path (several ranks' majority op is the reference).
Nothing is parsed from logs, and no extra collective runs (a hung group could not carry one).

**Cost.** Issuing a collective appends to an in-process list under a lock. Waiting never passes a timeout
to the backend: on NCCL a timed ``Work.wait`` that runs out aborts the communicator, which would kill every
healthy job whose ranks arrive more than a slice apart. A request that already completed returns at once
(one ``is_completed`` call, then the untimed ``wait``, which returns or raises its failure). Otherwise, on
gloo, the request's future wakes the waiter the moment it completes (checking for an abort every
``interval``); where a future completes early or not at all (NCCL marks it complete once the collective is
enqueued; gloo's send and recv have none), the request is polled with a backoff from 10 us to 0.5 ms, so the
wait ends at most 0.5 ms (or about as long again as it has lasted, when shorter) after the request
completes. The store sees one small write per rank per ``interval``.

**Ranks blocked outside comms.** A rank stuck in a call that cannot be interrupted (a backend call that
blocks inside its launch, or a collective issued without ``lightning_sync.comms``) cannot raise. When the
abort has been set for ``exit_after`` seconds and the watchdog has not been stopped, the watchdog thread
writes the error to stderr and ends the process with exit code 1, as torch's NCCL watchdog does.

**Trust.** The records travel through the rendezvous store, which like everything in torch.distributed
belongs on a trusted private network (see the README's trust model).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["CollectiveError", "CollectiveTimeout", "RankLost", "Watchdog", "active", "check_args", "explain",
           "sequence_key", "start", "stop"]

_HISTORY = 8  # ops remembered per group in a rank's record: enough to compare the op at a pending seq
_POLL_MIN, _POLL_MAX = 10e-6, 0.5e-3  # seconds between polls of a request without an exact future (backoff)
_ACTIVE: Watchdog | None = None
_GENERATION = [0]  # starts in this process: every rank starts its watchdogs in the same order


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the op, its sequence number and the culprits."""


class CollectiveTimeout(CollectiveError):
    """A collective did not complete within the watchdog's timeout (or another rank's watchdog aborted)."""


class RankLost(CollectiveError):
    """A collective failed because a peer rank is gone (its heartbeat stopped)."""


def active() -> Watchdog | None:
    """The running watchdog of this process, if any."""
    return _ACTIVE


def start(timeout: float, interval: float | None = None, exit_after: float | None = None) -> Watchdog:
    """Start this process's watchdog on the default process group (stopping a running one first)."""
    global _ACTIVE
    stop(clean=True)
    _ACTIVE = Watchdog(timeout, interval=interval, exit_after=exit_after)
    _ACTIVE.start()
    return _ACTIVE


def stop(clean: bool = True) -> None:
    """Stop this process's watchdog; ``clean`` tells the peers this rank left on purpose."""
    global _ACTIVE
    wd, _ACTIVE = _ACTIVE, None
    if wd is not None:
        wd.stop(clean=clean)


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


def sequence_key(group: str, peer: int | None) -> str:
    """The name sequence numbers count under: the group's, or ``"<group>/p2p"`` for point-to-point ops."""
    return group if peer is None else f"{group}/p2p"


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


@dataclass
class Pending:
    """One issued collective as the watchdog tracks it (returned by :meth:`Watchdog.issued`)."""

    op: str
    seq: int
    group: str
    ranks: list[int]
    nbytes: int
    peer: int | None = None  # point-to-point: the other rank (sequence numbers do not pair up)
    exact_future: bool = False  # the requests' futures complete with them (gloo collectives), so a wait can sleep
    start: float = field(default_factory=time.monotonic)
    handles: list[Any] | None = None  # None while the backend call is still being launched

    @property
    def key(self) -> str:
        return sequence_key(self.group, self.peer)

    def label(self) -> str:
        where = f"with rank {self.peer}" if self.peer is not None else f"on {self.group}"
        return f"{self.op} #{self.seq} ({_size(self.nbytes)}) {where}"

    def completed(self) -> bool:
        return self.handles is not None and all(h.is_completed() for h in self.handles)


class Watchdog:
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
            raise RuntimeError("the hang watchdog needs the default process group: start it after "
                               "init_process_group (the HangWatchdog callback does so in setup)")
        self.timeout, self.interval, self.exit_after = float(timeout), float(interval), float(exit_after)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        _GENERATION[0] += 1
        self._store, self.store_address = _client_store(_GENERATION[0])
        self._lock = threading.Lock()
        self._last: dict[str, int] = {}
        self._history: dict[str, list[list[Any]]] = {}
        self._pending: dict[int, Pending] = {}
        self._waiting: Pending | None = None
        self._error: CollectiveError | None = None
        self._error_at = 0.0
        self._wake: threading.Event | None = None  # set on an abort, to end a wait at once
        self._beat = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lightning_sync-watchdog", daemon=True)

    # ------------------------------------------------------------------ called by comms (main thread)

    def issued(self, op: str, seq: int, group: str, ranks: Sequence[int], nbytes: int,
               peer: int | None = None, exact_future: bool = False) -> Pending:
        """Record a collective about to be launched; raises the pending abort instead, if there is one."""
        self.check()
        p = Pending(op, seq, group, list(ranks), nbytes, peer, exact_future)
        with self._lock:
            self._last[p.key] = seq
            hist = self._history.setdefault(p.key, [])
            hist.append([seq, op, nbytes])
            del hist[:-_HISTORY]
            self._pending[id(p)] = p
        return p

    def launched(self, p: Pending, handles: Sequence[Any]) -> None:
        p.handles = list(handles)

    def wait(self, p: Pending, handle: Any) -> None:
        """Wait for one backend request of ``p``; raise the diagnosis if it hangs or fails (module docstring:
        never a timed ``Work.wait``)."""
        self.check()
        if not handle.is_completed():
            self._waiting = p
            try:
                self._until_completed(p, handle)
            finally:
                self._waiting = None
        try:  # completed: returns at once, or raises the request's failure
            handle.wait()
        except RuntimeError as err:
            cause = str(err).strip().splitlines()[-1][:300] if str(err).strip() else type(err).__name__
            raise self._fail(RankLost, p, f"failed ({cause})") from err

    def _until_completed(self, p: Pending, handle: Any) -> None:
        """Return once ``handle`` completed; raise the abort (this rank's hang, or another rank's) meanwhile."""
        future = None
        if p.exact_future:
            try:
                future = handle.get_future()
            except RuntimeError:  # gloo's send and recv have none
                future = None
        if future is not None:
            # The future completes just before the request marks itself completed: the untimed wait that
            # follows covers that last step (polling is_completed here would spin against it).
            done = threading.Event()
            future.add_done_callback(lambda _: done.set())
            self._wake = done  # an abort sets it too
            try:
                while not done.wait(self.interval):
                    self.check()
                self.check()
            finally:
                self._wake = None
            return
        pause = _POLL_MIN
        while not handle.is_completed():
            self.check()
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX)

    def finished(self, p: Pending) -> None:
        with self._lock:
            self._pending.pop(id(p), None)

    def check(self) -> None:
        """Raise the abort of this or another rank, if one happened."""
        if self._error is not None:
            raise type(self._error)(str(self._error))

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        self._publish()
        self._thread.start()

    def stop(self, clean: bool = True) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._thread.join(timeout=5 * self.interval + 5)
        if clean:
            try:
                self._publish(state="done")
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
                self._publish()
                if self._error is None:
                    self._poll_abort()
                if self._error is None:
                    stuck = self._stuck()
                    if stuck is not None:
                        self._fail(CollectiveTimeout, stuck, f"did not complete within {self.timeout:g} s")
            except Exception as err:  # noqa: BLE001 - the store (or its host) is gone; diagnosis says so
                stuck = self._stuck() if self._error is None else None
                if stuck is not None:
                    self._set_error(CollectiveTimeout(
                        f"{stuck.label()} did not complete within {self.timeout:g} s; {self.store_lost(err)}"),
                        post=False)
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
        if self._store.check(["abort"]):
            posted = json.loads(self._store.get("abort"))
            kind = RankLost if posted["kind"] == "RankLost" else CollectiveTimeout
            self._set_error(kind(f"aborted by the hang watchdog of rank {posted['rank']}: {posted['message']}"),
                            post=False)

    def _hard_exit(self) -> None:
        if self._stopped.is_set():
            return
        sys.stderr.write(f"lightning_sync watchdog: rank {self.rank} is still running {self.exit_after:g} s after "
                         f"the abort, blocked outside lightning_sync.comms; ending the process (exit code 1). "
                         f"The abort: {self._error}\n")
        sys.stderr.flush()
        os._exit(1)

    # ------------------------------------------------------------------ records and diagnosis

    def _record(self, state: str) -> dict[str, Any]:
        with self._lock:
            self._beat += 1
            waiting = self._waiting
            return {"beat": self._beat, "state": state, "host": socket.gethostname(), "pid": os.getpid(),
                    "last": dict(self._last), "hist": {k: list(v) for k, v in self._history.items()},
                    "waiting": None if waiting is None else
                    f"{waiting.label()} for {time.monotonic() - waiting.start:.1f} s"}

    def _publish(self, state: str = "running") -> None:
        self._store.set(f"hb/{self.rank}", json.dumps(self._record(state)))

    def _pause(self, seconds: float) -> None:
        """Sleep, still publishing this rank's heartbeat (peers may be diagnosing at the same time)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, self.interval / 2))
            self._publish()

    def _read(self, ranks: Sequence[int]) -> dict[int, dict[str, Any] | None]:
        out: dict[int, dict[str, Any] | None] = {}
        for r in ranks:
            key = f"hb/{r}"
            out[r] = json.loads(self._store.get(key)) if self._store.check([key]) else None
        return out

    def store_lost(self, err: BaseException) -> str:
        """What to say when the rendezvous store cannot be reached: its host is gone."""
        return (f"the rendezvous store at {self.store_address} is unreachable ({err}): its host (under Lightning: "
                f"global rank 0) is lost")

    def lost_ranks(self) -> list[int]:
        """Ranks whose heartbeat does not move over ``2 * interval`` seconds (the store host's loss raises)."""
        return self._survey([r for r in range(self.world_size) if r != self.rank])[1]

    def _survey(self, ranks: Sequence[int]) -> tuple[dict[int, dict[str, Any] | None], list[int]]:
        """The ranks' records, read twice ``2 * interval`` apart, and the lost ones: no record, or a
        running rank whose heartbeat did not move (every live rank publishes at least once meanwhile)."""
        first = self._read(ranks)
        self._pause(2 * self.interval + 0.1)
        now = self._read(ranks)
        lost = [r for r in ranks if now[r] is None or (now[r]["state"] == "running" and first[r] is not None
                                                         and now[r]["beat"] == first[r]["beat"])]
        return now, lost

    def _set_error(self, err: CollectiveError, post: bool) -> CollectiveError:
        with self._lock:
            if self._error is not None:
                return self._error
            if post:  # the first rank to post wins; everyone raises that message
                mine = json.dumps({"rank": self.rank, "kind": type(err).__name__, "message": str(err)})
                self._store.compare_set("abort", "", mine)
            self._error, self._error_at = err, time.monotonic()
            wake = self._wake
        if wake is not None:
            wake.set()
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
        records, lost = self._survey(others)
        return explain(p, what, self.rank, records, lost, silent_for=2 * self.interval + 0.1)


def explain(p: Pending, what: str, rank: int, records: Mapping[int, dict[str, Any] | None], lost: Sequence[int],
            silent_for: float) -> str:
    """The diagnosis of ``p`` (pending on ``rank``) from its peers' published records.

    Per peer: lost (in ``lost``: no heartbeat for ``silent_for`` s), left (stopped its watchdog), never
    joined (its last sequence number on the group is below ``p.seq``), or issued something at ``p.seq``
    whose op or size differs (different code paths; the ranks are grouped by what they issued, the
    smallest group first, since with three or more ranks the odd one out is the culprit).
    """
    key = p.key
    left, never, sig_by_rank, details = [], [], {rank: (p.op, p.nbytes)}, []
    for r in sorted(records):
        rec = records.get(r)
        where = "never published a heartbeat" if rec is None else (
            f"waiting in {rec['waiting']}" if rec["waiting"] else "not in a collective")
        if r in lost:
            details.append(f"rank {r}: no heartbeat for {silent_for:.1f} s; last seen {where}")
            continue
        details.append(f"rank {r} ({rec['host']} pid {rec['pid']}): last issued #{rec['last'].get(key, 0)} "
                       f"here, {where}")
        if rec["state"] == "done":
            left.append(r)
        elif p.peer is not None:
            continue  # point-to-point: where the peer is (above) is the diagnosis
        elif rec["last"].get(key, 0) < p.seq:
            never.append(r)
        else:
            at = {h[0]: (h[1], h[2]) for h in rec["hist"].get(key, [])}
            if p.seq in at:
                sig_by_rank[r] = at[p.seq]
    parts = []
    sigs: dict[tuple[str, int], list[int]] = {}
    for r, sig in sorted(sig_by_rank.items()):
        sigs.setdefault(sig, []).append(r)
    if len(sigs) > 1:
        ranked = sorted(sigs.items(), key=lambda kv: (len(kv[1]), kv[1]))  # the minority first
        parts.append(f"ranks took different code paths at #{p.seq}: " +
                     "; ".join(f"{op} ({_size(n)}) on ranks {rs}" for (op, n), rs in ranked))
    if never:
        parts.append(f"ranks {never} never joined")
    if left:
        parts.append(f"ranks {left} already left (stopped their watchdog)")
    if lost:
        parts.append(f"ranks {lost} lost")
    if not parts:
        parts.append("every peer issued it; the transport did not complete it")
    return f"{p.label()} {what}: " + "; ".join(parts) + "\n  " + "\n  ".join(details)


def _client_store(generation: int) -> tuple[dist.Store, str]:
    """A store client of our own, in a namespace of this watchdog generation."""
    base = dist.distributed_c10d._get_default_store()
    under = base
    while isinstance(under, dist.PrefixStore):
        under = under.underlying_store
    if isinstance(under, dist.TCPStore):
        store: dist.Store = dist.TCPStore(under.host, under.port, is_master=False, timeout=timedelta(seconds=30),
                                          wait_for_workers=False)
        address = f"{under.host}:{under.port}"
    else:  # a FileStore or HashStore: share the default one
        store, address = base, type(under).__name__
    return dist.PrefixStore(f"lightning_sync/watchdog/{generation}", store), address
