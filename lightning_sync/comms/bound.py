"""A view of a :class:`~lightning_sync.comms.context.CommContext` bound to one process group and one all-reduce
algorithm: what :meth:`CommContext.bound() <lightning_sync.comms.context.CommContext.bound>` returns.

A ``sync`` algorithm talks to one communicator and never names a group or an algorithm. Where it must run on a
sub-group, or with a written-out all-reduce (ring, tree, hierarchical) instead of the backend's, the strategy
hands it a bound view of its context. The view is not a second context: each call is the context's own method
with the view's group filled in, so it takes the context's sequence numbers, is measured by its observer,
watched by its watchdog, and the hierarchical all-reduce's node groups are the context's (its ``begin_job``
and ``close`` release them).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from lightning_sync.comms.algorithms import ALGORITHMS, AlgorithmContext, all_reduce_with, hierarchical_all_reduce
from lightning_sync.comms.payload import get_rank, get_world_size

if TYPE_CHECKING:
    from lightning_sync.comms.hooks import CallHook

__all__ = ["BoundContext", "CompletedWork"]


class _Context(AlgorithmContext, Protocol):
    """What the view forwards to: a :class:`~lightning_sync.comms.context.CommContext` (which satisfies this as it
    is), named as a protocol so that the context, which makes views, and the view do not import each other. The
    view's own methods carry the exact signatures."""

    group: dist.ProcessGroup | None
    observer: CallHook | None

    def barrier(self, *args: Any, **kwargs: Any) -> Any: ...
    def broadcast(self, *args: Any, **kwargs: Any) -> Any: ...
    def broadcast_object(self, *args: Any, **kwargs: Any) -> Any: ...
    def all_gather(self, *args: Any, **kwargs: Any) -> Any: ...
    def all_gather_into(self, *args: Any, **kwargs: Any) -> Any: ...
    def all_gather_into_coalesced(self, *args: Any, **kwargs: Any) -> Any: ...
    def all_to_all_into(self, *args: Any, **kwargs: Any) -> Any: ...
    def all_gather_object(self, *args: Any, **kwargs: Any) -> Any: ...
    def gather(self, *args: Any, **kwargs: Any) -> Any: ...
    def gather_object(self, *args: Any, **kwargs: Any) -> Any: ...
    def scatter(self, *args: Any, **kwargs: Any) -> Any: ...
    def reduce_scatter(self, *args: Any, **kwargs: Any) -> Any: ...
    def reduce_scatter_into(self, *args: Any, **kwargs: Any) -> Any: ...
    def reduce_scatter_into_coalesced(self, *args: Any, **kwargs: Any) -> Any: ...


class CompletedWork:
    """A handle of an operation that completed before it was returned; ``wait()`` gives its result."""

    def __init__(self, result: Any = None) -> None:
        self._result = result

    def wait(self) -> Any:
        return self._result

    def is_completed(self) -> bool:
        return True


class BoundContext:
    """The collectives of ``ctx`` on ``group`` by default, with ``all_reduce`` run by ``algorithm``.

    Every method takes the context's arguments in the context's order; a ``group`` passed to a call overrides
    the view's.

    Args:
        ctx: the context every call goes through.
        group: the process group the view's calls default to (None: the context's).
        algorithm: how ``all_reduce`` runs: ``"backend"`` (the backend's own, asynchronous when asked), or one of
            the written-out algorithms of :mod:`lightning_sync.comms.algorithms` (``"ring"``, ``"tree"``,
            ``"hierarchical"``), which complete before ``all_reduce`` returns (with ``async_op=True`` it returns a
            :class:`CompletedWork`).
        ranks_per_node: the node layout of ``"hierarchical"`` (None: from the environment). Its node groups are
            built here, collectively, so that no rank builds them inside backward; every rank binds alike.
    """

    def __init__(
        self,
        ctx: _Context,
        group: dist.ProcessGroup | None = None,
        algorithm: str = "backend",
        ranks_per_node: int | None = None,
    ) -> None:
        if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
            raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; allowed: {sorted(ALGORITHMS)}")
        if algorithm == "hierarchical":
            ctx.node_groups(ranks_per_node)  # collective: every rank builds the sub-groups now
        self.ctx = ctx
        self.group = ctx.group if group is None else group
        self.algorithm, self.ranks_per_node = algorithm, ranks_per_node

    def _g(self, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        return self.group if group is None else group

    @property
    def observer(self) -> CallHook | None:
        """The context's observer: what an algorithm's own local work (a codec's arithmetic) is recorded in."""
        return self.ctx.observer

    def record(self, op: str, nbytes: int, seconds: float = 0.0, calls: int = 1) -> None:
        """The context's :meth:`~lightning_sync.comms.context.CommContext.record`: an algorithm's own local work."""
        self.ctx.record(op, nbytes, seconds, calls)

    @property
    def rank(self) -> int:
        """This process's rank in the view's group."""
        return get_rank(self.group)

    @property
    def world_size(self) -> int:
        """The number of ranks in the view's group."""
        return get_world_size(self.group)

    def scope(self, name: str) -> AbstractContextManager[None]:
        """The context's :meth:`~lightning_sync.comms.context.CommContext.scope`."""
        return self.ctx.scope(name)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: str = "sum",
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
        label: str | None = None,
    ) -> Any:
        """All-reduce ``tensor`` in place with the view's algorithm; returns it (or a Work)."""
        group = self._g(group)
        if self.algorithm == "backend":
            return self.ctx.all_reduce(tensor, op=op, group=group, async_op=async_op, label=label)
        if self.algorithm == "hierarchical":
            hierarchical_all_reduce(self.ctx, tensor, op=op, group=group, ranks_per_node=self.ranks_per_node)
        else:
            all_reduce_with(self.ctx, self.algorithm, tensor, op=op, group=group)
        return CompletedWork(tensor) if async_op else tensor

    def barrier(self, group: dist.ProcessGroup | None = None, async_op: bool = False) -> Any:
        return self.ctx.barrier(group=self._g(group), async_op=async_op)

    def reduce(
        self,
        tensor: torch.Tensor,
        dst: int,
        op: str = "sum",
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        return self.ctx.reduce(tensor, dst, op=op, group=self._g(group), async_op=async_op)

    def broadcast(
        self, value: Any, src: int = 0, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        return self.ctx.broadcast(value, src=src, group=self._g(group), async_op=async_op)

    def broadcast_object(
        self, value: Any, src: int = 0, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        return self.ctx.broadcast_object(value, src=src, group=self._g(group), async_op=async_op)

    def all_gather(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False) -> Any:
        return self.ctx.all_gather(tensor, group=self._g(group), async_op=async_op)

    def all_gather_into(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        return self.ctx.all_gather_into(output, input, group=self._g(group), async_op=async_op)

    def all_to_all_into(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        return self.ctx.all_to_all_into(output, input, group=self._g(group), async_op=async_op)

    def all_gather_into_coalesced(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        return self.ctx.all_gather_into_coalesced(outputs, inputs, group=self._g(group), async_op=async_op)

    def all_gather_object(self, obj: Any, group: dist.ProcessGroup | None = None, async_op: bool = False) -> Any:
        return self.ctx.all_gather_object(obj, group=self._g(group), async_op=async_op)

    def gather(
        self,
        tensor: torch.Tensor,
        gather_list: list[torch.Tensor] | None = None,
        dst: int = 0,
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        return self.ctx.gather(tensor, gather_list, dst=dst, group=self._g(group), async_op=async_op)

    def gather_object(
        self, obj: Any, dst: int = 0, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        return self.ctx.gather_object(obj, dst=dst, group=self._g(group), async_op=async_op)

    def scatter(
        self, chunks: Sequence[Any] | None, src: int = 0, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        return self.ctx.scatter(chunks, src=src, group=self._g(group), async_op=async_op)

    def reduce_scatter(
        self, tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        return self.ctx.reduce_scatter(tensor, op=op, group=self._g(group), async_op=async_op)

    def reduce_scatter_into(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: str = "sum",
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        return self.ctx.reduce_scatter_into(output, input, op=op, group=self._g(group), async_op=async_op)

    def reduce_scatter_into_coalesced(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        op: str = "sum",
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        return self.ctx.reduce_scatter_into_coalesced(outputs, inputs, op=op, group=self._g(group), async_op=async_op)

    def send(
        self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        return self.ctx.send(tensor, dst, group=self._g(group), async_op=async_op)

    def recv(
        self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        return self.ctx.recv(tensor, src, group=self._g(group), async_op=async_op)

    def __repr__(self) -> str:
        return f"BoundContext(algorithm={self.algorithm!r}, group={self.group!r})"
