"""The communicator interface the ``sync`` algorithms talk to (as torchft's LocalSGD/DiLoCo do).

Algorithms never call torch.distributed directly: they get a :class:`Communicator`, so they run
unchanged on a real process group (:class:`ProcessGroupCommunicator`, which goes through
:mod:`lightning_sync.comms` and is therefore measured by its context's observer) or, in one-process unit
tests, on a fake such as :class:`LoopbackCommunicator`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from lightning_sync import comms

__all__ = ["Communicator", "CompletedWork", "LoopbackCommunicator", "ProcessGroupCommunicator", "WorkLike"]


class WorkLike(Protocol):
    """An issued operation; ``wait()`` blocks until done and returns its result."""

    def wait(self) -> Any: ...


class Communicator(Protocol):
    """What an algorithm may ask of its peers."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> Any: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Any: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def all_gather_into(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Any: ...

    def reduce_scatter_into(
        self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", async_op: bool = False, scratch: bool = False
    ) -> Any: ...

    def record(self, op: str, nbytes: int, seconds: float = 0.0, calls: int = 1) -> None:
        """Record an algorithm's own local work (a codec's arithmetic) where its calls are measured."""
        ...


class ProcessGroupCommunicator:
    """A :class:`Communicator` over a torch process group, through a :class:`~lightning_sync.comms.CommContext`
    (so every call is numbered, watched, and measured by the context's observer).

    Args:
        ctx: the communication context of the job (the strategy's ``comm``); its group is the default.
        algorithm: how ``all_reduce`` runs: ``"backend"`` (the backend's own, asynchronous), or one of
            :data:`lightning_sync.comms.algorithms.ALGORITHMS` written out in ``comms`` (``"ring"``,
            ``"tree"``, ``"hierarchical"``), which complete before ``all_reduce`` returns.
        ranks_per_node: the node layout for ``"hierarchical"`` (its sub-groups are built here, once).
        group: the process group (None: the context's).
    """

    def __init__(
        self,
        ctx: comms.CommContext,
        algorithm: str = "backend",
        ranks_per_node: int | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        from lightning_sync.comms import algorithms

        if algorithm not in algorithms.ALGORITHMS:
            raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; allowed: {sorted(algorithms.ALGORITHMS)}")
        if algorithm == "hierarchical":
            ctx.node_groups(ranks_per_node)  # collective: every rank builds the sub-groups now
        self.ctx = ctx
        self._group = ctx.group if group is None else group
        self.algorithm, self.ranks_per_node = algorithm, ranks_per_node

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group (None: the default group)."""
        return self._group

    def record(self, op: str, nbytes: int, seconds: float = 0.0, calls: int = 1) -> None:
        """To the context's hooks: an algorithm's own local work (a codec's arithmetic)."""
        self.ctx.record(op, nbytes, seconds, calls)

    @property
    def rank(self) -> int:
        return comms.get_rank(self._group)

    @property
    def world_size(self) -> int:
        return comms.get_world_size(self._group)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> Any:
        if self.algorithm == "backend":
            return self.ctx.all_reduce(tensor, op=op, group=self._group, async_op=async_op)
        from lightning_sync.comms import algorithms

        if self.algorithm == "hierarchical":
            algorithms.hierarchical_all_reduce(
                self.ctx, tensor, op=op, group=self._group, ranks_per_node=self.ranks_per_node
            )
        else:
            algorithms.all_reduce_with(self.ctx, self.algorithm, tensor, op=op, group=self._group)
        return CompletedWork(tensor) if async_op else tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.ctx.broadcast_object(obj, src=src, group=self._group)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Any:
        return self.ctx.broadcast(tensor, src=src, group=self._group, async_op=async_op)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.ctx.all_gather_object(obj, group=self._group)

    def all_gather_into(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Any:
        return self.ctx.all_gather_into(output, input, group=self._group, async_op=async_op)

    def reduce_scatter_into(
        self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", async_op: bool = False, scratch: bool = False
    ) -> Any:
        return self.ctx.reduce_scatter_into(output, input, op=op, group=self._group, async_op=async_op, scratch=scratch)


class CompletedWork:
    """A :class:`WorkLike` that is already done."""

    def __init__(self, result: Any = None) -> None:
        self._result = result

    def wait(self) -> Any:
        return self._result

    def is_completed(self) -> bool:
        return True


class LoopbackCommunicator:
    """A fake for one-process tests: ``world_size`` identical ranks, all of them this process.

    Every rank is assumed to hold the same tensor, so ``sum`` multiplies by ``world_size`` and the
    other ops leave it unchanged. ``calls`` records ``(op, numel)`` for each call so tests can check
    what an algorithm sent, and when.
    """

    def __init__(self, world_size: int = 1, rank: int = 0, observer: comms.CallHook | None = None) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need world_size >= 1 and 0 <= rank < world_size, got {world_size=}, {rank=}")
        self._world, self._rank = world_size, rank
        self.observer = observer  # what an algorithm's local work (a codec's arithmetic) is recorded in
        self.calls: list[tuple[str, int]] = []

    @property
    def rank(self) -> int:
        return self._rank

    def record(self, op: str, nbytes: int, seconds: float = 0.0, calls: int = 1) -> None:
        if self.observer is not None:
            self.observer.record(op, nbytes, seconds, calls)

    @property
    def world_size(self) -> int:
        return self._world

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> Any:
        if op not in comms.REDUCE_OPS:
            raise ValueError(f"unknown reduce op {op!r}; allowed: {sorted(comms.REDUCE_OPS)}")
        self.calls.append(("all_reduce", tensor.numel()))
        if op == "sum":
            tensor.mul_(self._world)
        return CompletedWork(tensor) if async_op else tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        self.calls.append(("broadcast_object", 0))
        return obj

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Any:
        self.calls.append(("broadcast", tensor.numel()))
        return CompletedWork(tensor) if async_op else tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        self.calls.append(("all_gather_object", 0))
        return [obj] * self._world

    def all_gather_into(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Any:
        """Every rank holds ``input``, so the gathered buffer is ``input`` repeated K times."""
        if output.numel() != self._world * input.numel():
            raise ValueError(f"output has {output.numel()} elements, expected {self._world} x {input.numel()}")
        self.calls.append(("all_gather_into", input.numel()))
        output.view(self._world, -1).copy_(input.reshape(1, -1))
        return CompletedWork(output) if async_op else output

    def reduce_scatter_into(
        self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", async_op: bool = False, scratch: bool = False
    ) -> Any:
        """Every rank holds ``input``: this rank's chunk, times K for ``sum``, unchanged otherwise."""
        if op not in comms.REDUCE_OPS:
            raise ValueError(f"unknown reduce op {op!r}; allowed: {sorted(comms.REDUCE_OPS)}")
        if input.numel() != self._world * output.numel():
            raise ValueError(f"input has {input.numel()} elements, expected {self._world} x {output.numel()}")
        self.calls.append(("reduce_scatter_into", input.numel()))
        n = output.numel()
        output.view(-1).copy_(input.reshape(-1)[self._rank * n : (self._rank + 1) * n])
        if op == "sum":
            output.mul_(self._world)
        return CompletedWork(output) if async_op else output
