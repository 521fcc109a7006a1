"""The handle of an issued collective, and the observer protocol that measurement plugs into."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from lightning_sync.comms.diagnosis import Pending
    from lightning_sync.comms.watchdog import Watchdog

__all__ = ["Observer", "Work"]

T = TypeVar("T")


class Observer(Protocol):
    """What a collective tells whoever measures it (:class:`~lightning_sync.comms.stats.CommStats` is one).

    A context without an observer skips every call below, and the clock reads around them, so measurement
    costs nothing when nobody reads it."""

    def record(self, op: str, nbytes: int, seconds: float = 0.0, calls: int = 1) -> None:
        """One call of ``op`` with ``nbytes`` of payload was issued (or ``seconds`` of local work, bytes 0)."""

    def add_seconds(self, op: str, seconds: float) -> None:
        """A call of ``op`` completed ``seconds`` after it was issued."""

    def block_begin(self) -> None:
        """The caller enters a launch or a wait."""

    def block_end(self, seconds: float, issued_async: bool = False, completed_async: bool = False) -> None:
        """The caller leaves it after ``seconds``; an async call was left in flight or ended."""

    def reset(self, in_flight: bool = False) -> None:
        """Forget what was recorded (a new job)."""


class Work(Generic[T]):
    """Handle of an issued collective. ``wait()`` blocks until it is done and returns its result.

    ``op`` and ``seq`` name the call: ``seq`` counts the collectives its context issued on the call's group in
    this job (point-to-point ops count apart), so ranks in lockstep agree on it, and the hang watchdog names a
    hung call by it. Waiting twice is allowed and returns the same result.
    """

    def __init__(
        self,
        op: str,
        seq: int,
        handles: Sequence[Any],
        finish: Callable[[], T],
        start: float,
        observer: Observer | None = None,
        watchdog: Watchdog | None = None,
        tracked: Pending | None = None,
        account: bool = True,
        in_flight: bool = False,
        blocks: bool = True,
    ) -> None:
        self.op = op
        self.seq = seq
        self._handles = list(handles)
        self._finish = finish
        self._start = start
        self._done = False
        self._result: T | None = None
        self._observer = observer
        self._watchdog = watchdog if tracked is not None else None
        self._tracked = tracked
        self._account = account
        self._in_flight = in_flight  # counted by the observer as an async call in flight until waited for
        self._blocks = blocks  # False: a wrapper whose inner Work accounts the blocked time

    def is_completed(self) -> bool:
        """True once every underlying backend request has completed (does not run ``finish``)."""
        return self._done or all(h.is_completed() for h in self._handles)

    def wait(self) -> T:
        """Block until the collective completes; returns its result (tensor, list or object)."""
        if self._done:
            return self._result  # type: ignore[return-value]
        obs, wd = self._observer, self._watchdog
        if obs is None:
            self._complete(wd)
            return self._result  # type: ignore[return-value]
        if self._blocks:
            obs.block_begin()
        blocked = time.perf_counter()
        try:
            self._complete(wd)
        finally:  # done or failed, the call is no longer in flight for the caller
            now = time.perf_counter()
            if self._blocks:
                obs.block_end(now - blocked, completed_async=self._in_flight)
                self._in_flight = False
        if self._account:
            obs.add_seconds(self.op, now - self._start)
        return self._result  # type: ignore[return-value]

    def _complete(self, wd: Watchdog | None) -> None:
        for h in self._handles:
            if wd is None:
                h.wait()
            else:  # in slices: a hang or a lost peer becomes an error naming the culprit
                wd.wait(self._tracked, h)
        if wd is not None:
            wd.finished(self._tracked)
        self._result = self._finish()
        self._done = True

    def then(self, fn: Callable[[Any], Any]) -> Work[Any]:
        """A handle whose ``wait()`` returns ``fn(self.wait())``; this one accounts the call's seconds."""
        return Work(
            self.op,
            self.seq,
            self._handles,
            lambda: fn(self.wait()),
            self._start,
            observer=self._observer,
            watchdog=self._watchdog,
            tracked=self._tracked,
            account=False,
            blocks=False,
        )

    def __repr__(self) -> str:
        return f"Work({self.op} #{self.seq}, done={self._done})"
