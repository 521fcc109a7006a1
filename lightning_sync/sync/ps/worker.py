"""A worker's side of the parameter server, and how it reaches the server.

:class:`PSWorker` pushes one replica's gradients and takes the global model back. It talks to the
:class:`~lightning_sync.sync.ps.server.ParameterServer` through a :class:`ServerLink`:

* :class:`LocalLink`: the server is in this process (direct calls; no bytes on any wire);
* :class:`RpcLink`: the server is on another rank, reached with ``torch.distributed.rpc`` through
  :mod:`lightning_sync.comms.rpc` (bytes counted as ``rpc_send`` / ``rpc_recv``). The server's rank
  makes its server reachable with :func:`host`; a request that arrives before then waits for it.
  Pushes and finishes are answered asynchronously (``async_execution``): no RPC thread is held while
  a push waits on the staleness bound.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from lightning_sync._checks import check_choice
from lightning_sync.sync.ps.server import ParameterServer
from lightning_sync.sync.ps.wire import WIRE_DEVICE, FlatLayout, Reply

__all__ = ["COMPENSATIONS", "LocalLink", "PSWorker", "RpcLink", "ServerLink", "check_compensation", "host"]

COMPENSATIONS = ("lookahead", "none")
"""How a worker compensates the staleness of its next gradient (see :class:`PSWorker`)."""

LOOKAHEAD_EMA = 0.5
"""Weight of the newest staleness in the worker's running estimate of its next one."""


def check_compensation(value: Any) -> str:
    """``compensation`` checked and returned: one of :data:`COMPENSATIONS`."""
    return check_choice("compensation", value, COMPENSATIONS)


class ServerLink(Protocol):
    """How a worker talks to the server (in its process, or over RPC)."""

    def pull(self, worker: int) -> Reply: ...

    def push(
        self,
        worker: int,
        read_version: int,
        grads: list[torch.Tensor],
        present: list[bool],
        buffers: list[torch.Tensor],
        clip: tuple[str, float] | None,
    ) -> Reply: ...

    def finish(self, worker: int) -> Reply: ...

    def abort(self, worker: int, message: str) -> None: ...

    def snapshot(self) -> dict[str, Any]: ...


class LocalLink:
    """The server is in this process: direct calls, no bytes on any wire. While a request waits (on the staleness
    bound, or for every worker to finish), it asks the server every second to give up on a worker silent for
    ``timeout`` seconds (:meth:`ParameterServer.expire`): a worker lost without a word would otherwise hold every
    other one for ever, since nothing else waits with a deadline in this process."""

    def __init__(self, server: ParameterServer, timeout: float = 1800.0) -> None:
        self.server, self.timeout = server, float(timeout)

    def _wait(self, future: torch.futures.Future) -> Any:
        answered = threading.Event()
        future.add_done_callback(lambda _: answered.set())
        while not answered.wait(_EXPIRY_CHECK_S):
            self.server.expire(self.timeout)
        return future.wait()

    def pull(self, worker: int) -> Reply:
        return self.server.pull(worker)

    def push(
        self,
        worker: int,
        read_version: int,
        grads: list[torch.Tensor],
        present: list[bool],
        buffers: list[torch.Tensor],
        clip: tuple[str, float] | None,
    ) -> Reply:
        return self._wait(self.server.push(worker, read_version, grads, present, buffers, clip))

    def finish(self, worker: int) -> Reply:
        return self._wait(self.server.finish(worker))

    def abort(self, worker: int, message: str) -> None:
        self.server.abort(worker, message)

    def snapshot(self) -> dict[str, Any]:
        return self.server.snapshot()


_EXPIRY_CHECK_S = 1.0  # between two looks for a silent worker while a local request waits
_SERVER_SAID = "parameter server:"  # how the server's own errors begin (ParameterServer.abort / expire / _fail)

_HOSTED: dict[str, Any] = {"server": None}
_HOSTED_READY = threading.Condition()


def host(server: ParameterServer | None) -> None:
    """Make ``server`` the one this process serves over RPC (``None``: stop serving)."""
    with _HOSTED_READY:
        _HOSTED["server"] = server
        _HOSTED_READY.notify_all()


def _hosted(timeout: float = 600.0) -> ParameterServer:
    with _HOSTED_READY:  # a worker may call before the server rank has built its server
        if not _HOSTED_READY.wait_for(lambda: _HOSTED["server"] is not None, timeout=timeout):
            raise RuntimeError(f"no parameter server was hosted on this rank within {timeout:.0f}s")
        return _HOSTED["server"]


def _remote_pull(worker: int) -> Reply:
    return _hosted().pull(worker)


def _raising(future: torch.futures.Future) -> torch.futures.Future:
    """``future`` as RPC should answer it: its exception raised as the caller's error. (RPC would send an
    exception stored with ``set_exception`` as if it were the reply; one raised in a callback it sends as
    an error.)"""
    return future.then(lambda done: done.wait())


def _remote_push(
    worker: int,
    read_version: int,
    grads: list[torch.Tensor],
    present: list[bool],
    buffers: list[torch.Tensor],
    clip: tuple[str, float] | None,
) -> torch.futures.Future:
    return _raising(_hosted().push(worker, read_version, grads, present, buffers, clip))


def _remote_finish(worker: int) -> torch.futures.Future:
    return _raising(_hosted().finish(worker))


def _remote_abort(worker: int, message: str) -> None:
    _hosted().abort(worker, message)


def _remote_snapshot() -> dict[str, Any]:
    return _hosted().snapshot()


def _async_execution(fn: Callable[..., Any]) -> Callable[..., Any]:
    """RPC runs ``fn`` and answers when the future it returns completes (no thread blocks meanwhile)."""
    import torch.distributed.rpc as rpc

    return rpc.functions.async_execution(fn) if rpc.is_available() else fn


_remote_push = _async_execution(_remote_push)
_remote_finish = _async_execution(_remote_finish)


class RpcLink:
    """The server is on rank ``server_rank``: requests over ``torch.distributed.rpc`` (counted bytes)."""

    def __init__(self, server_rank: int, ctx: Any = None) -> None:
        self.server_rank = server_rank
        self.ctx = ctx  # the strategy's context, whose hooks count the requests' and replies' bytes

    def _call(self, fn: Any, *args: Any) -> Any:
        from lightning_sync.comms import rpc

        try:
            return rpc.rpc_call(self.server_rank, fn, *args, ctx=self.ctx)
        except RuntimeError as exc:
            if _SERVER_SAID in str(exc):  # the server answered with why training stopped
                raise
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise RuntimeError(
                f"the parameter server on rank {self.server_rank} is unreachable (its process lost?), so training "
                f"stopped: {first}"
            ) from exc

    def pull(self, worker: int) -> Reply:
        return self._call(_remote_pull, worker)

    def push(
        self,
        worker: int,
        read_version: int,
        grads: list[torch.Tensor],
        present: list[bool],
        buffers: list[torch.Tensor],
        clip: tuple[str, float] | None,
    ) -> Reply:
        return self._call(_remote_push, worker, read_version, grads, present, buffers, clip)

    def finish(self, worker: int) -> Reply:
        return self._call(_remote_finish, worker)

    def abort(self, worker: int, message: str) -> None:
        self._call(_remote_abort, worker, message)

    def snapshot(self) -> dict[str, Any]:
        return self._call(_remote_snapshot)


# ---------------------------------------------------------------------- the worker
class PSWorker:
    """One worker's side: push this replica's gradients, take the global model back.

    Staleness compensation (``lookahead=True``)
        A gradient computed on version r is applied at version r + tau, after tau other steps. The
        worker therefore computes it where the global model is expected to be by then, not where it
        was: after each push it sets its replica to

            theta_r + tau_hat * (theta_r - theta_q) / (r - q)

        where theta_q is the global model of its previous reply (version q), so the fraction is the
        server's mean update per version since then, and tau_hat is a running estimate of this
        worker's staleness (an exponential average of its pushes' staleness, weight
        :data:`LOOKAHEAD_EMA`). This is the lookahead of DANA (Hakimi et al., "Taming Momentum in a
        Distributed Asynchronous Environment", 2019), made optimizer-agnostic by extrapolating the
        observed update rather than the momentum buffer, and computed on the worker from the models it
        receives anyway (theta_q is the previous reply, which the worker keeps as :attr:`last`): no
        extra bytes and no extra state. A gradient that is never
        stale (``max_staleness=0``) gives tau_hat = 0 and no extrapolation at all, so synchronous
        training is unchanged bit for bit. :meth:`pull` and :meth:`finish` (evaluation, setup, end of
        fit) always take the global model exactly.

    Args:
        worker: this worker's index (its global rank).
        params: the replica's trainable parameters, in the server's order.
        buffers: the replica's buffers, in the server's order.
        link: how to reach the server.
        lookahead: compensate staleness as above.
    """

    def __init__(
        self,
        worker: int,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        link: ServerLink,
        lookahead: bool = False,
    ) -> None:
        self.worker, self.params, self.buffers, self.link = worker, list(params), list(buffers), link
        self.layout = FlatLayout(self.params, device=WIRE_DEVICE)
        self.buffer_layout = FlatLayout(self.buffers, device=WIRE_DEVICE)
        self.lookahead = lookahead
        self.version = 0
        self.steps = 0
        self.expected_staleness = 0.0
        """tau_hat: the running estimate of this worker's next staleness (0 unless ``lookahead``)."""
        self.last: Reply | None = None
        """The latest reply (its ``params``: the global model this replica was last set from)."""

    def _take(self, reply: Reply, extrapolate: bool = False) -> Reply:
        target, prev = reply.params, self.last
        if extrapolate and self.expected_staleness > 0 and prev is not None and reply.version > prev.version:
            scale = self.expected_staleness / (reply.version - prev.version)
            target = [
                new + (new - old) * scale if new.is_floating_point() else new
                for new, old in zip(reply.params, prev.params)
            ]
        self.layout.copy_into(target, self.params)
        self.buffer_layout.copy_into(reply.buffers, self.buffers)
        self.version, self.last = reply.version, reply
        return reply

    def pull(self) -> Reply:
        """Take the newest global model; the next gradient is computed on it."""
        return self._take(self.link.pull(self.worker))

    def push(self, clip: tuple[str, float] | None = None) -> Reply:
        """Send the replica's current gradients (``.grad``; missing ones are flagged), wait until the
        server applied them, and take the new global model (extrapolated, with ``lookahead``)."""
        grads = [p.grad for p in self.params]
        present = [g is not None for g in grads]
        read = self.version
        reply = self.link.push(
            self.worker,
            read,
            self.layout.flatten(grads, fill_missing=True),
            present,
            self.buffer_layout.flatten(self.buffers),
            clip,
        )
        self.steps += 1
        if self.lookahead and reply.applied:  # applied in the step that made reply.version
            staleness = reply.version - 1 - read
            self.expected_staleness += LOOKAHEAD_EMA * (staleness - self.expected_staleness)
        return self._take(reply, extrapolate=reply.applied)

    def finish(self) -> Reply:
        """Leave the bound; wait for every worker to finish and take the final global model."""
        return self._take(self.link.finish(self.worker))
