"""Communication accounting: :class:`CommStats`, what each op's bytes mean.

:class:`CommStats` is a call hook (:mod:`lightning_sync.comms.hooks`): every collective of a context it is
attached to counts once, with its op name and payload bytes, when it is issued, and its seconds when it completes;
entries that are not backend calls (a codec's arithmetic, a remote call) come through :meth:`CommStats.record`.

What "bytes" means, per op (always *this rank's* buffer as handed to the backend, padding included):

==================  ===============================================================
op                  bytes recorded on this rank
==================  ===============================================================
all_reduce          the tensor
broadcast           the tensor (the pickled object for objects), on every rank
all_gather          this rank's (padded) input
gather              this rank's (padded) input
scatter             the (padded) chunk this rank receives
reduce_scatter      this rank's (padded) full input
send / recv         the tensor sent / received (the ring and tree algorithms use these)
metadata            the small size/shape exchanges that uneven inputs and objects need
==================  ===============================================================

So the *wire* traffic of an algorithm is what its ``send`` entries say; the backend's own
collectives are counted by payload, and :func:`lightning_sync.bench.formulas.ring_allreduce_bytes`
converts a payload into the bytes a ring all-reduce puts on the wire.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_sync.comms.hooks import Call, CountingHook

__all__ = ["CommStats", "OpStats"]


@dataclass
class OpStats:
    """Totals for one op name."""

    calls: int = 0
    """How many times the op was issued."""
    bytes: int = 0
    """Payload bytes, as defined in the module docstring."""
    seconds: float = 0.0
    """Wall seconds from issue to completion (for async ops: to the end of ``wait()``)."""


class CommStats(CountingHook):
    """Per-op calls, payload bytes and seconds, as a call hook. Thread-safe; read with :meth:`snapshot`.

    Besides the totals per op it keeps the seconds callers spent blocked in collectives
    (:meth:`blocked_seconds`) and the seconds an async call ran under the caller's own work
    (:meth:`covered_seconds`). A call costs two clock reads and two short holds of one lock when it is synchronous
    (issue, completion), four when it is asynchronous (launch and wait apart), and no object beyond its token."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._ops: dict[str, OpStats] = {}
        self._lock = threading.Lock()
        self._blocked = 0.0
        self._outstanding = 0  # async calls issued and not yet waited for
        self._blocking = 0  # callers inside a launch or a wait now
        self._covered = 0.0
        self._mark = clock()

    # ------------------------------------------------------------------ as a call hook
    def on_issue(self, call: Call) -> Any:
        """Count the call (:meth:`begin`). The token: a synchronous call's issue time (when its caller became
        blocked, too); an asynchronous call's ``[issued at, blocked since, in flight]``, which its launch and wait
        update."""
        now = self.begin(call.op, call.nbytes)
        return [now, now, False] if call.async_op else now

    def begin(self, op: str, nbytes: int) -> float:
        """Count a call of ``op`` and its bytes; its caller is blocked from now on. Returns the time."""
        now = self._clock()
        self._lock.acquire()  # not `with`: this runs on every call, and nothing below can raise
        entry = self._ops.get(op)
        if entry is None:
            entry = self._ops[op] = OpStats()
        entry.calls += 1
        entry.bytes += nbytes
        if self._outstanding > 0 and self._blocking == 0:  # _tick_at(now), written out
            self._covered += now - self._mark
        self._mark = now
        self._blocking += 1
        self._lock.release()
        return now

    def on_launched(self, call: Call, token: Any, handles: Any) -> None:
        """An async call leaves the caller, in flight; a synchronous one keeps it blocked until it completes."""
        if call.async_op:
            now = self._clock()
            with self._lock:
                if self._outstanding > 0 and self._blocking == 0:  # _tick_at(now), written out
                    self._covered += now - self._mark
                self._mark = now
                self._blocking = max(0, self._blocking - 1)
                self._blocked += now - token[1]
                self._outstanding += 1
            token[2] = True

    def on_wait(self, call: Call, token: Any) -> None:
        """The caller waits for an async call: blocked again."""
        token[1] = self._clock()
        with self._lock:
            self._tick_at(token[1])
            self._blocking += 1

    def on_complete(self, call: Call, token: Any, ok: bool) -> None:
        """The caller is released (:meth:`end`)."""
        self.end(call.op, token, ok)

    def end(self, op: str, token: Any, ok: bool) -> None:
        """The caller of a call of ``op`` is released; a completed call adds its seconds since issue to its op.
        ``token``: what :meth:`begin` or :meth:`on_issue` returned."""
        now = self._clock()
        if token.__class__ is list:  # an asynchronous call's
            issued, since, in_flight = token
        else:
            issued = since = token
            in_flight = False
        self._lock.acquire()  # as in on_issue
        if self._outstanding > 0 and self._blocking == 0:  # _tick_at(now), written out
            self._covered += now - self._mark
        self._mark = now
        if self._blocking > 0:  # never below 0: a new job forgets the callers blocked in the previous one's calls
            self._blocking -= 1
        self._blocked += now - since
        if in_flight and self._outstanding > 0:
            self._outstanding -= 1
        if ok:
            entry = self._ops.get(op)
            if entry is None:  # reset while the call was in flight
                entry = self._ops[op] = OpStats()
            entry.seconds += now - issued
        self._lock.release()

    def begin_job(self) -> None:
        """A new job: forget everything, calls in flight included (:meth:`reset`)."""
        self.reset(in_flight=True)

    # ------------------------------------------------------------------ entries and readings
    def record(self, op: str, nbytes: int, seconds: float = 0.0, calls: int = 1) -> None:
        """Add one (or ``calls``) call(s) of ``op`` moving ``nbytes`` in ``seconds``."""
        with self._lock:
            entry = self._ops.setdefault(op, OpStats())
            entry.calls += calls
            entry.bytes += int(nbytes)
            entry.seconds += seconds

    def add_seconds(self, op: str, seconds: float) -> None:
        """Add time to ``op`` without counting a call (async ops: the time spent in ``wait``)."""
        with self._lock:
            self._ops.setdefault(op, OpStats()).seconds += seconds

    def blocked_seconds(self) -> float:
        """Seconds callers spent blocked in collectives; unlike an op's ``seconds`` (issue to completion),
        time an async op ran while the caller computed does not count."""
        with self._lock:
            return self._blocked

    def _tick(self) -> None:  # under the lock
        self._tick_at(self._clock())

    def _tick_at(self, now: float) -> None:  # under the lock
        if self._outstanding > 0 and self._blocking == 0:
            self._covered += now - self._mark
        self._mark = now

    def block_begin(self) -> None:
        """A caller enters a launch or a ``Work.wait`` (:meth:`covered_seconds` stops counting)."""
        with self._lock:
            self._tick()
            self._blocking += 1

    def block_end(self, seconds: float, issued_async: bool = False, completed_async: bool = False) -> None:
        """The caller leaves the launch or wait it entered with :meth:`block_begin`, after ``seconds``
        (added to :meth:`blocked_seconds`); ``issued_async``: the launch left an async call in flight,
        ``completed_async``: the wait ended one."""
        with self._lock:
            self._tick()
            self._blocking = max(0, self._blocking - 1)
            self._blocked += seconds
            self._outstanding += int(issued_async) - int(completed_async)
            self._outstanding = max(0, self._outstanding)

    def covered_seconds(self) -> float:
        """Seconds during which at least one async collective was in flight (issued, not yet waited for)
        while no caller was blocked in a launch or a wait: the caller's own work (compute) that had
        communication running under it, the time an overlapping strategy can hide communication behind.
        Counted for the whole process (a handle never waited for keeps counting)."""
        with self._lock:
            self._tick()
            return self._covered

    def reset(self, in_flight: bool = False) -> None:
        """Forget everything recorded so far; calls still in flight stay in flight unless ``in_flight`` (a new
        job: the previous one's calls never waited for must not count as covering this one's compute)."""
        with self._lock:
            self._ops.clear()
            self._blocked = 0.0
            self._tick()
            self._covered = 0.0
            if in_flight:
                self._outstanding = self._blocking = 0

    def snapshot(self) -> dict[str, OpStats]:
        """A copy of the per-op totals, safe to keep while recording continues."""
        with self._lock:
            return {k: OpStats(v.calls, v.bytes, v.seconds) for k, v in self._ops.items()}

    def __getitem__(self, op: str) -> OpStats:
        return self.snapshot().get(op, OpStats())

    @property
    def total_bytes(self) -> int:
        """Payload bytes over every op."""
        return sum(v.bytes for v in self.snapshot().values())

    @property
    def total_seconds(self) -> float:
        """Seconds over every op."""
        return sum(v.seconds for v in self.snapshot().values())

    def as_metrics(self, prefix: str = "comm/") -> dict[str, float]:
        """Flat ``{prefix}{op}/{calls,bytes,seconds}`` dict, ready for ``LightningModule.log_dict``."""
        out: dict[str, float] = {}
        for op, s in sorted(self.snapshot().items()):
            out[f"{prefix}{op}/calls"] = float(s.calls)
            out[f"{prefix}{op}/bytes"] = float(s.bytes)
            out[f"{prefix}{op}/seconds"] = s.seconds
        return out

    def table(self) -> str:
        """A human-readable table of the totals."""
        rows = [f"{'op':<22}{'calls':>8}{'MiB':>12}{'seconds':>10}"]
        for op, s in sorted(self.snapshot().items()):
            rows.append(f"{op:<22}{s.calls:>8}{s.bytes / 2**20:>12.3f}{s.seconds:>10.3f}")
        return "\n".join(rows)
