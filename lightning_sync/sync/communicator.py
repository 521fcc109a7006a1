"""The communicator interface the ``sync`` algorithms talk to (as torchft's LocalSGD/DiLoCo do).

Algorithms never call torch.distributed directly: they get a :class:`Communicator`, so they run unchanged on a
real process group or, in one-process unit tests, on a fake such as :class:`LoopbackCommunicator`. On a process
group the communicator is the strategy's :class:`~lightning_sync.comms.CommContext` itself (so every call is
numbered, watched and measured by its observer), or a view of it bound to a sub-group or a written-out all-reduce
algorithm (:meth:`CommContext.bound() <lightning_sync.comms.CommContext.bound>`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lightning_sync import comms
from lightning_sync.comms.bound import CompletedWork

__all__ = ["Communicator", "CompletedWork", "LoopbackCommunicator", "WorkLike"]


class WorkLike(Protocol):
    """An issued operation; ``wait()`` blocks until done and returns its result."""

    def wait(self) -> Any: ...


class Communicator(Protocol):
    """What an algorithm may ask of its peers: a :class:`~lightning_sync.comms.CommContext`'s own methods, with
    its parameter names and order, so a context (or its bound view) is a Communicator as it is. ``group`` None
    is the communicator's own group; with ``async_op=True`` a call returns a :class:`WorkLike`."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any: ...

    def broadcast_object(
        self, value: Any, src: int = 0, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any: ...

    def record(self, op: str, nbytes: int, seconds: float = 0.0, calls: int = 1) -> None:
        """Record an algorithm's own local work (a codec's arithmetic) where its calls are measured."""
        ...

    def broadcast(
        self, value: Any, src: int = 0, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any: ...

    def all_gather_object(self, obj: Any, group: dist.ProcessGroup | None = None, async_op: bool = False) -> Any: ...

    def all_gather_into(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any: ...

    def all_to_all_into(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any: ...

    def reduce_scatter_into(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: str = "sum",
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any: ...

    def all_gather_into_coalesced(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any: ...

    def reduce_scatter_into_coalesced(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        op: str = "sum",
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any: ...


class LoopbackCommunicator:
    """A fake for one-process tests: ``world_size`` identical ranks, all of them this process.

    Every rank is assumed to hold the same tensor, so ``sum`` multiplies by ``world_size`` and the
    other ops leave it unchanged. ``calls`` records ``(op, numel)`` for each call so tests can check
    what an algorithm sent, and when. Its methods take a context's parameters in a context's order; ``group``
    is ignored, since the loopback has one group, of all its ranks.
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

    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        if op not in comms.REDUCE_OPS:
            raise ValueError(f"unknown reduce op {op!r}; allowed: {sorted(comms.REDUCE_OPS)}")
        self.calls.append(("all_reduce", tensor.numel()))
        if op == "sum":
            tensor.mul_(self._world)
        return CompletedWork(tensor) if async_op else tensor

    def broadcast_object(
        self, value: Any, src: int = 0, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        self.calls.append(("broadcast_object", 0))
        return CompletedWork(value) if async_op else value

    def broadcast(
        self, value: Any, src: int = 0, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        self.calls.append(("broadcast", value.numel()))
        return CompletedWork(value) if async_op else value

    def all_gather_object(self, obj: Any, group: dist.ProcessGroup | None = None, async_op: bool = False) -> Any:
        self.calls.append(("all_gather_object", 0))
        gathered = [obj] * self._world
        return CompletedWork(gathered) if async_op else gathered

    def all_gather_into(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        """Every rank holds ``input``, so the gathered buffer is ``input`` repeated K times."""
        if output.numel() != self._world * input.numel():
            raise ValueError(f"output has {output.numel()} elements, expected {self._world} x {input.numel()}")
        self.calls.append(("all_gather_into", input.numel()))
        output.view(self._world, -1).copy_(input.reshape(1, -1))
        return CompletedWork(output) if async_op else output

    def all_to_all_into(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        """Every rank holds ``input``, so each chunk this rank receives is the chunk ``rank`` of ``input``."""
        if output.shape != input.shape or input.numel() % self._world:
            raise ValueError(
                f"output {tuple(output.shape)} must be input's {tuple(input.shape)}, in {self._world} chunks"
            )
        self.calls.append(("all_to_all_into", input.numel()))
        n = input.numel() // self._world
        output.view(self._world, n).copy_(input.reshape(-1)[self._rank * n : (self._rank + 1) * n].view(1, n))
        return CompletedWork(output) if async_op else output

    def reduce_scatter_into(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: str = "sum",
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
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

    def all_gather_into_coalesced(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        """:meth:`all_gather_into` of each pair, recorded as one call of all their elements."""
        for o, i in zip(outputs, inputs, strict=True):
            LoopbackCommunicator.all_gather_into(self, o, i)
        self._merge_calls(len(outputs), "all_gather_into_coalesced")
        return CompletedWork(list(outputs)) if async_op else list(outputs)

    def reduce_scatter_into_coalesced(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        op: str = "sum",
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        """:meth:`reduce_scatter_into` of each pair, recorded as one call of all their elements."""
        for o, i in zip(outputs, inputs, strict=True):
            LoopbackCommunicator.reduce_scatter_into(self, o, i, op=op)
        self._merge_calls(len(outputs), "reduce_scatter_into_coalesced")
        return CompletedWork(list(outputs)) if async_op else list(outputs)

    def _merge_calls(self, n: int, op: str) -> None:
        self.calls[-n:] = [(op, sum(numel for _, numel in self.calls[-n:]))]
