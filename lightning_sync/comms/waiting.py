"""Waiting for a backend request while staying interruptible, without ever passing the request a timeout.

On NCCL a timed ``Work.wait(timeout)`` that runs out aborts the communicator, so a watchdog that waited in
slices would kill every healthy job whose ranks arrive more than a slice apart (data loading, a checkpoint
written by one rank, a straggler). :class:`Waiter` instead waits for the request to complete by the cheapest
means its backend offers, checking for the watchdog's abort at least every ``interval`` seconds, and only then
calls the untimed ``wait``, which returns at once or raises the request's failure:

* **Completed already** (the common case in a step that overlaps communication): one ``is_completed`` call.
* **Tensors in host memory (gloo)**: the request's future completes with it; its done-callback sets an event, so
  the wait ends the moment the request does. gloo's send, recv and reduce-scatter have no future, and their
  ``is_completed`` stays False until someone waits: a daemon thread of the waiter makes the untimed wait and
  sets the event. Were the request to hang, that thread stays blocked until gloo's own timeout fails it, and the
  caller is released by the abort.
* **Tensors on a GPU (NCCL)**: the future is marked complete once the collective is enqueued on its stream, so
  it says nothing; the request is polled (``is_completed`` queries the stream's events) with a backoff from
  10 us to 0.5 ms, so the wait ends at most 0.5 ms (or about as long again as it has lasted, when shorter) after
  the collective completes. Like the timed wait before it, this holds the host until the GPU is done.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Waiter"]

_POLL_MIN, _POLL_MAX = 10e-6, 0.5e-3  # seconds between polls of a request whose future says nothing (backoff)


def _waited(handle: Any) -> Exception | None:
    """The untimed wait of a request known to be complete: it returns at once, or with the request's failure."""
    try:
        handle.wait()
    except Exception as err:  # noqa: BLE001 - handed to the caller, which names the culprit
        return err
    return None


class Waiter:
    """Waits for backend requests (module docstring); ``check`` raises the caller's abort, if there is one.

    One caller waits at a time (the thread that issues the collectives); :meth:`wake` may come from any thread.
    """

    def __init__(self, check: Callable[[], None], interval: float) -> None:
        self._check, self._interval = check, interval
        self._event: threading.Event | None = None  # the wait in progress, for wake
        self._requests: queue.SimpleQueue[tuple[Any, threading.Event, list[Exception | None]] | None] | None = None

    def wait(self, handle: Any, on_cpu: bool) -> Exception | None:
        """Return once ``handle`` completed: ``None``, or its failure; raise the abort meanwhile (``check``).
        ``on_cpu``: the request's tensors are in host memory, so its future (if any) completes with it."""
        if handle.is_completed():
            return _waited(handle)
        if not on_cpu:
            pause = _POLL_MIN
            while not handle.is_completed():
                self._check()
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX)
            return _waited(handle)
        done = threading.Event()
        try:
            future = handle.get_future()
        except RuntimeError:  # gloo's send, recv and reduce-scatter: completed only by a wait
            outcome: list[Exception | None] = []
            self._waited_by_thread(handle, done, outcome)
            self._until(done)
            return outcome[0]
        # the future completes just before the request marks itself completed: the untimed wait covers that step
        future.add_done_callback(lambda _: done.set())
        self._until(done)
        return _waited(handle)

    def _until(self, done: threading.Event) -> None:
        self._event = done
        try:
            while not done.wait(self._interval):
                self._check()
            self._check()  # woken by an abort
        finally:
            self._event = None

    def wake(self) -> None:
        """End the wait in progress now (its ``check`` raises the abort that called this)."""
        event = self._event
        if event is not None:
            event.set()

    def _waited_by_thread(self, handle: Any, done: threading.Event, outcome: list[Exception | None]) -> None:
        if self._requests is None:
            self._requests = queue.SimpleQueue()
            threading.Thread(
                target=self._serve, args=(self._requests,), name="lightning_sync-waiter", daemon=True
            ).start()
        self._requests.put((handle, done, outcome))

    @staticmethod
    def _serve(requests: queue.SimpleQueue[tuple[Any, threading.Event, list[Exception | None]] | None]) -> None:
        while (request := requests.get()) is not None:
            handle, done, outcome = request
            outcome.append(_waited(handle))
            done.set()

    def close(self) -> None:
        """End the waiting thread once it is idle (it stays blocked in a hung request until gloo fails it)."""
        if self._requests is not None:
            self._requests.put(None)
            self._requests = None
