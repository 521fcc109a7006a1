"""Remote calls through ``torch.distributed.rpc`` (TensorPipe), counted like every collective.

The asynchronous parameter server needs point-to-point requests that a peer answers whenever it is
ready, without any group-wide collective: exactly what RPC provides. This module is the one place
such calls go through, and it records them through the caller's context (``ctx.record``), so they land in the same
:class:`~lightning_sync.comms.stats.CommStats` as the collectives:

* ``rpc_send``: the bytes of every tensor in a request's arguments (nested lists, tuples and dicts
  included), counted on the caller when the request is issued;
* ``rpc_recv``: the bytes of every tensor in the reply, counted on the caller when it arrives, with
  the round-trip seconds.

Each byte is counted once, by the caller; the callee's side of the same exchange is not counted
again. Calls to this process itself are refused: the caller should call the function directly.

Rendezvous is ``env://`` (``MASTER_ADDR``/``MASTER_PORT``; rank 0 hosts the store, or every rank joins
an existing one under torchrun / ``TORCHELASTIC_USE_AGENT_STORE``). No default process group is needed
or created. A peer that dies makes calls to it fail; a peer that stops answering makes them fail
after ``timeout`` seconds.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.rpc as rpc

from lightning_sync.comms.work import Work

if TYPE_CHECKING:
    from lightning_sync.comms.context import CommContext

__all__ = ["init", "is_initialized", "rpc_call", "shutdown", "tensor_bytes", "worker_name"]

# torch.distributed.rpc keeps one agent per process (init_rpc is process-wide by torch's design); this mirrors
# it: the rank and world it joined as, and the count of calls made through it.
_STATE: dict[str, Any] = {"rank": None, "world": None, "calls": itertools.count(1)}


def worker_name(rank: int) -> str:
    """The RPC name of global rank ``rank``."""
    return f"lightning_sync_{rank}"


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in ``obj`` (tensors, and lists / tuples / dicts / dataclass-like objects of them)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x) for x in obj.values())
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return sum(tensor_bytes(x) for x in vars(obj).values())
    return 0


def is_initialized() -> bool:
    """Whether :func:`init` has run in this process (and :func:`shutdown` has not)."""
    return _STATE["rank"] is not None


def init(rank: int, world_size: int, timeout: float | timedelta = 1800.0, num_worker_threads: int = 16) -> None:
    """Join the RPC group as global rank ``rank`` of ``world_size`` (``env://`` rendezvous).

    Raises ``ValueError`` for a bad rank, world size or timeout, and ``RuntimeError`` if this process
    already joined (call :func:`shutdown` first).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size - 1}], got {rank!r}")
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
        raise ValueError(f"timeout must be a number of seconds > 0 or a timedelta, got {timeout!r}")
    if is_initialized():
        raise RuntimeError(f"this process already joined RPC as rank {_STATE['rank']}; call shutdown() first")
    options = rpc.TensorPipeRpcBackendOptions(
        init_method="env://", rpc_timeout=float(seconds), num_worker_threads=num_worker_threads
    )
    rpc.init_rpc(worker_name(rank), rank=rank, world_size=world_size, rpc_backend_options=options)
    _STATE.update(rank=rank, world=world_size)


def shutdown(graceful: bool = True) -> None:
    """Leave the RPC group. ``graceful`` waits until every peer has called it and no call is in flight."""
    if is_initialized():
        try:
            rpc.shutdown(graceful=graceful)
        finally:
            _STATE.update(rank=None, world=None)


class _FutureHandle:
    """Adapts a ``torch.futures.Future`` to the handle protocol :class:`Work` waits on."""

    def __init__(self, future: torch.futures.Future) -> None:
        self.future = future

    def wait(self) -> Any:
        return self.future.wait()

    def is_completed(self) -> bool:
        return self.future.done()


def rpc_call(
    to: int, fn: Callable[..., Any], *args: Any, async_op: bool = False, ctx: CommContext | None = None
) -> Any:
    """Run ``fn(*args)`` on global rank ``to`` and return its result (a :class:`Work` if ``async_op``).

    ``fn`` must be a module-level function importable on the callee. The caller's context ``ctx`` (if any) records
    the request's tensor bytes as ``rpc_send``, the reply's as ``rpc_recv`` (with the round-trip time).
    """
    if not is_initialized():
        raise RuntimeError(
            "lightning_sync.comms.rpc is not initialised: call comms.rpc.init(rank, world_size) "
            "first (the async_ps strategy does this in setup_environment)"
        )
    world, me = _STATE["world"], _STATE["rank"]
    if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < world:
        raise ValueError(f"to must be a rank in [0, {world - 1}], got {to!r}")
    if to == me:
        raise ValueError(f"rpc_call to this process itself (rank {me}); call {getattr(fn, '__name__', fn)} directly")
    if ctx is not None and ctx.hooks:
        ctx.record("rpc_send", tensor_bytes(args))
    start = time.perf_counter()
    future = rpc.rpc_async(worker_name(to), fn, args=args)

    def finish() -> Any:
        value = future.wait()
        if ctx is not None and ctx.hooks:
            ctx.record("rpc_recv", tensor_bytes(value), time.perf_counter() - start)
        return value

    work = Work("rpc_recv", next(_STATE["calls"]), [_FutureHandle(future)], finish)
    return work if async_op else work.wait()
