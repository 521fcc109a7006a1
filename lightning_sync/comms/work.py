"""The handle of an issued collective: :class:`Work`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from lightning_sync.comms.hooks import Call

__all__ = ["Work"]

T = TypeVar("T")


def _finished_already() -> Any:
    raise AssertionError("a finished Work does not finish again")


class Work(Generic[T]):
    """Handle of an issued collective. ``wait()`` blocks until it is done and returns its result.

    ``op`` and ``seq`` name the call: ``seq`` counts the collectives its context issued on the call's group in
    this job (point-to-point ops count apart), so ranks in lockstep agree on it, and the hang watchdog names a
    hung call by it. ``call`` carries the hooks to notify (:mod:`lightning_sync.comms.hooks`); without it the
    handle waits for its backend requests and nobody is told. Waiting twice is allowed and returns the same result.
    """

    def __init__(
        self, op: str, seq: int, handles: Sequence[Any], finish: Callable[[], T], call: Call | None = None
    ) -> None:
        self.op = op
        self.seq = seq
        self._handles = handles
        self._finish = finish
        self._call = call
        self._done = False
        self._result: T | None = None

    def is_completed(self) -> bool:
        """True once every underlying backend request has completed (does not run ``finish``)."""
        return self._done or all(h.is_completed() for h in self._handles)

    def wait(self) -> T:
        """Block until the collective completes; returns its result (tensor, list or object)."""
        if self._done:
            return self._result  # type: ignore[return-value]
        call, self._call = self._call, None  # a wait retried after a failure tells the hooks nothing more
        if call is None:
            for h in self._handles:
                h.wait()
            self._result = self._finish()
        else:
            self._result = call.settle(self._handles, self._finish)
        self._done = True
        # the backend's requests hold their process group: a done handle kept around (a bucket's, until the next
        # backward) must not keep a destroyed group's sockets open, or a peer blocked with this process waits
        # out the group's timeout
        self._handles, self._finish = (), _finished_already
        return self._result

    def then(self, fn: Callable[[Any], Any]) -> Work[Any]:
        """A handle whose ``wait()`` returns ``fn(self.wait())``; the hooks hear of the call once, through this one."""
        return _Chained(self, fn)

    def __repr__(self) -> str:
        return f"Work({self.op} #{self.seq}, done={self._done})"


class _Chained(Work[Any]):
    """``fn`` applied to an inner handle's result; it has no backend request and no hook of its own."""

    def __init__(self, inner: Work[Any], fn: Callable[[Any], Any]) -> None:
        super().__init__(inner.op, inner.seq, (), lambda: fn(inner.wait()))
        self._inner = inner

    def is_completed(self) -> bool:
        return self._done or self._inner.is_completed()
