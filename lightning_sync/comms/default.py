"""The collectives as functions of :mod:`lightning_sync.comms`, on the default process group::

    from lightning_sync import comms
    comms.barrier()
    comms.all_reduce(t, op="avg")
    state = comms.broadcast(model_state if rank == 0 else None, src=0)

``torch.distributed``'s functions work on the default process group without a handle; these do too. Each is a
thin call of one method of a :class:`~lightning_sync.comms.context.CommContext`, the *default context*, so every
call is numbered, observed and watched exactly like a strategy's (the semantics are the context's; see
:mod:`lightning_sync.comms.collectives`).

**Whose state.** The default context belongs to the default process group, as torch's own functions' state
does: it is made on the first call, not at import, and it is checked against ``torch.distributed.group.WORLD``
on every call. Once that group is destroyed and another initialised, the next call closes the old context
(stopping a watchdog started on it, destroying its node groups) and makes a fresh one, whose sequence numbers
start again at 1. So the holder below mirrors torch's own process-wide default group, as ``comms/rpc.py``
mirrors torch's RPC agent; it keeps no state of a job beyond that group's lifetime.

A strategy's context (``strategy.comm``) is a different :class:`CommContext`: the functions here and a strategy
never share sequence numbers, statistics or a watchdog.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_sync.comms.context import CommContext
from lightning_sync.comms.work import Work

__all__ = [
    "DefaultContext",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "default_context",
    "gather",
    "reduce_scatter",
    "scatter",
]


class DefaultContext:
    """Holds the :class:`CommContext` of the current default process group; one per process (:data:`_DEFAULT`).

    Every call compares ``torch.distributed.group.WORLD`` by identity with the group the context was made for (as
    the context's sequence numbers do), and a different group gets a new context; the holder refers to the group
    only weakly, so it keeps no destroyed group alive by itself."""

    def __init__(self) -> None:
        self._ctx: CommContext | None = None
        self._world: weakref.ref[Any] | None = None
        self._lock = threading.Lock()  # two threads' first calls make one context

    def current(self) -> CommContext | None:
        """The context of the current default group if a call has made one; never makes one."""
        ctx, world = self._ctx, self._world
        if ctx is None or world is None or not dist.is_available() or world() is not dist.group.WORLD:
            return None
        return ctx

    def get(self, fn: str = "default_context") -> CommContext:
        """The context of the current default group, made on first use; ``fn`` names the caller in the error
        raised when there is no default group."""
        ctx = self.current()
        if ctx is not None:
            return ctx
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"lightning_sync.comms.{fn}() runs on the default process group, and none is initialised: call "
                "torch.distributed.init_process_group first, e.g. init_process_group('gloo', rank=RANK, "
                "world_size=WORLD) with MASTER_ADDR/MASTER_PORT set (or run inside a Trainer with a distributed "
                "strategy, and use its strategy.comm)"
            )
        with self._lock:
            ctx = self.current()
            if ctx is None:
                old, self._ctx = self._ctx, None
                if old is not None:  # its group is gone: nothing of it may reach the new one
                    old.close()
                ctx = CommContext()
                self._ctx, self._world = ctx, weakref.ref(dist.group.WORLD)
        return ctx


_DEFAULT = DefaultContext()


def default_context() -> CommContext:
    """The context behind this module's functions, made on first use for the current default process group.

    Attach an observer to measure the module functions (``comms.default_context().observer = comms.CommStats()``)
    or start its hang watchdog; a strategy's context is unaffected by either."""
    return _DEFAULT.get()


def _tensor(fn: str, name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"comms.{fn}: {name} must be a torch.Tensor, got {type(value).__name__}: {value!r:.80}")
    return value


def barrier(async_op: bool = False) -> Work[None] | None:
    """Block until every rank has entered the barrier (a :class:`Work` with ``async_op``)."""
    return _DEFAULT.get("barrier").barrier(async_op=async_op)


def broadcast(value: Any, src: int = 0, async_op: bool = False) -> Any:
    """Broadcast ``value`` from rank ``src``; returns it on every rank.

    A tensor is broadcast in place: every rank passes a tensor of the same shape and dtype. Anything else is
    pickled on ``src`` and the other ranks' argument is ignored (pass ``None``), so an object comes back as
    ``src``'s value on every rank. Whether a call broadcasts a tensor or an object is decided by each rank's own
    argument: every rank passes a tensor, or none does."""
    return _DEFAULT.get("broadcast").broadcast(value, src=src, async_op=async_op)


def scatter(scatter_list: Sequence[Any] | None, src: int = 0, async_op: bool = False) -> Any:
    """Send ``scatter_list[r]`` from ``src`` to rank r; returns this rank's chunk.

    The chunks are tensors (any shapes, one dtype) or picklable objects; only ``src``'s list is read (the other
    ranks pass ``None``). A list without exactly one chunk per rank raises on every rank."""
    return _DEFAULT.get("scatter").scatter(scatter_list, src=src, async_op=async_op)


def gather(
    tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0, async_op: bool = False
) -> list[torch.Tensor] | None | Work[list[torch.Tensor] | None]:
    """Gather every rank's ``tensor`` (first dimensions may differ) on rank ``dst``.

    On ``dst`` the result is ``gather_list`` filled in place (its tensors must have the gathered shapes) or, without
    one, a new list in rank order; on the other ranks it is ``None``. As in torch, only ``dst`` passes a
    ``gather_list``; another rank that passes one gets a :class:`ValueError` after the collective, so its peers are
    never left waiting in it."""
    ctx = _DEFAULT.get("gather")
    out = ctx.gather(_tensor("gather", "tensor", tensor), gather_list, dst=dst, async_op=async_op)
    if gather_list is not None and ctx.rank != dst:
        if async_op:
            out.wait()
        raise ValueError(
            f"comms.gather: rank {ctx.rank} passed a gather_list, but only dst={dst} receives; pass gather_list "
            "on dst only (allowed elsewhere: None)"
        )
    return out


def all_gather(tensor: torch.Tensor, async_op: bool = False) -> list[torch.Tensor] | Work[list[torch.Tensor]]:
    """Every rank's ``tensor``, as a list in rank order; first dimensions may differ between ranks."""
    return _DEFAULT.get("all_gather").all_gather(_tensor("all_gather", "tensor", tensor), async_op=async_op)


def all_reduce(tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> torch.Tensor | Work[torch.Tensor]:
    """Reduce ``tensor`` over all ranks in place with ``op`` (``sum``, ``avg``, ``max``, ``min``; ``avg`` needs a
    floating-point tensor); returns it."""
    return _DEFAULT.get("all_reduce").all_reduce(_tensor("all_reduce", "tensor", tensor), op=op, async_op=async_op)


def reduce_scatter(tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> torch.Tensor | Work[torch.Tensor]:
    """Reduce ``tensor`` (the same shape on every rank) with ``op`` and return this rank's rows of the result.

    Dim 0 (a 0-d tensor counts as one row) is split as a strategy's ``reduce_scatter`` splits it: chunks of
    ``c = ceil(n / K)`` rows for K ranks, rank r getting rows ``[r*c, min(n, (r+1)*c))``, so when K does not
    divide n the last ranks get fewer rows, or none. ``tensor`` itself is left unchanged."""
    return _DEFAULT.get("reduce_scatter").reduce_scatter(
        _tensor("reduce_scatter", "tensor", tensor), op=op, async_op=async_op
    )
