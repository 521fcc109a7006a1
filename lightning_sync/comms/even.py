"""The even, flat all-gather and reduce-scatter that sharding is built on, one tensor or several per call.

Every rank passes buffers of the same sizes, so no metadata is exchanged. On gloo each runs as one round of
pairwise sends and receives (:mod:`lightning_sync.comms.pairwise`), where gloo's own ops are several times
slower; NCCL runs its native ops. The ``_coalesced`` forms issue several such ops as one call, with one handle
and one sequence number: ZeRO-3 gathers (and reduce-scatters) a group of small consecutive units at once, so
that a rank waits once for the group instead of once per unit. Their messages are the same; only the waits, the
wake-ups and the bookkeeping per unit go.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_sync.comms.collectives import Collectives
from lightning_sync.comms.pairwise import all_gather_exchange, all_to_all_exchange, reduce_scatter_exchange
from lightning_sync.comms.payload import (
    ALL_GATHER_SINGLE,
    REDUCE_SCATTER_SINGLE,
    check_even,
    check_reduce,
    get_world_size,
    handles_of,
    is_gloo,
    nbytes,
)
from lightning_sync.comms.work import Work

__all__ = ["EvenCollectives"]

_Parts = tuple[Callable[[bool], list[Any]], Callable[[], torch.Tensor]]  # (launch, finish) of one tensor's op


class EvenCollectives(Collectives):
    """:meth:`all_gather_into` and :meth:`reduce_scatter_into`, and their ``_coalesced`` forms."""

    def all_gather_into(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> torch.Tensor | Work[torch.Tensor]:
        """``output`` (world_size x input.numel()) gets every rank's flat ``input``."""
        group = self._g(group)
        launch, finish = self._gather_parts(output, input, group)
        return self._issue("all_gather", nbytes(input), launch, finish, async_op, group=group, like=input)

    def all_to_all_into(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> torch.Tensor | Work[torch.Tensor]:
        """Chunk j of every rank's flat ``input`` (world_size equal chunks) goes to rank j, where rank r's lands in
        chunk r of ``output`` (as large as ``input``). What a codec whose chunks cannot be summed as they travel
        sends to each chunk's owner. ``input`` is only read, and must stay unchanged until the call completes."""
        group = self._g(group)
        world = get_world_size(group)
        if output.shape != input.shape or output.dtype != input.dtype or input.numel() % world:
            raise ValueError(
                f"all_to_all_into needs an output of the input's shape and dtype, in {world} equal chunks: got "
                f"input {tuple(input.shape)} {input.dtype}, output {tuple(output.shape)} {output.dtype}"
            )
        if self._exchanges(group, input.reshape(-1)[: input.numel() // world]):
            launch, finish = all_to_all_exchange(output, input, group)
        else:

            def launch(blocking: bool) -> list[Any]:
                flat_out, flat_in = output.view(-1), input.reshape(-1)
                return handles_of(dist.all_to_all_single(flat_out, flat_in, group=group, async_op=not blocking))

            def finish() -> torch.Tensor:
                return output

        return self._issue("all_to_all", nbytes(input), launch, finish, async_op, group=group, like=input)

    def reduce_scatter_into(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: str = "sum",
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> torch.Tensor | Work[torch.Tensor]:
        """This rank's chunk of the reduction of every rank's flat ``input`` (world_size x output.numel()) into
        ``output``. ``input`` is only read, and must stay unchanged until the call completes."""
        group = self._g(group)
        launch, finish = self._reduce_parts(output, input, op, group)
        return self._issue(
            "reduce_scatter", nbytes(input), launch, finish, async_op, group=group, like=input, detail=op
        )

    def all_gather_into_coalesced(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> list[torch.Tensor] | Work[list[torch.Tensor]]:
        """:meth:`all_gather_into` of each ``(output, input)`` pair, as one call; returns the outputs."""
        group = self._g(group)
        parts = [self._gather_parts(o, i, group) for o, i in self._pairs(outputs, inputs)]
        size = sum(nbytes(i) for i in inputs)
        return self._issue("all_gather", size, *_together(parts), async_op, group=group, like=inputs[0])

    def reduce_scatter_into_coalesced(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        op: str = "sum",
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> list[torch.Tensor] | Work[list[torch.Tensor]]:
        """:meth:`reduce_scatter_into` of each ``(output, input)`` pair, as one call; returns the outputs."""
        group = self._g(group)
        parts = [self._reduce_parts(o, i, op, group) for o, i in self._pairs(outputs, inputs)]
        size = sum(nbytes(i) for i in inputs)
        return self._issue("reduce_scatter", size, *_together(parts), async_op, group=group, like=inputs[0], detail=op)

    # ------------------------------------------------------------------ one tensor's op, either backend
    @staticmethod
    def _pairs(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[tuple[Any, Any]]:
        if not inputs or len(outputs) != len(inputs):
            raise ValueError(
                f"a coalesced call needs one output per input and at least one of each, got {len(outputs)} "
                f"outputs and {len(inputs)} inputs"
            )
        return list(zip(outputs, inputs))

    def _exchanges(self, group: dist.ProcessGroup | None, chunk: torch.Tensor) -> bool:
        """Whether an op whose per-rank chunk is ``chunk`` runs as a pairwise exchange: on gloo, from
        :attr:`~lightning_sync.comms.context.CommSettings.gloo_exchange_min_chunk_bytes`."""
        return is_gloo(group) and nbytes(chunk) >= self.settings.gloo_exchange_min_chunk_bytes

    def _gather_parts(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None) -> _Parts:
        check_even("all_gather_into", "output", output, "input", input, group)
        if self._exchanges(group, input):
            return all_gather_exchange(output, input, group)

        def launch(blocking: bool) -> list[Any]:
            return handles_of(ALL_GATHER_SINGLE(output.view(-1), input.reshape(-1), group=group, async_op=not blocking))

        return launch, lambda: output

    def _reduce_parts(
        self, output: torch.Tensor, input: torch.Tensor, op: str, group: dist.ProcessGroup | None
    ) -> _Parts:
        red = check_reduce(op, input)
        check_even("reduce_scatter_into", "input", input, "output", output, group)
        if self._exchanges(group, output):
            return reduce_scatter_exchange(output, input, op, group)

        def launch(blocking: bool) -> list[Any]:
            return handles_of(
                REDUCE_SCATTER_SINGLE(output.view(-1), input.reshape(-1), op=red, group=group, async_op=not blocking)
            )

        return launch, lambda: output


def _together(parts: list[_Parts]) -> tuple[Callable[[bool], list[Any]], Callable[[], list[torch.Tensor]]]:
    """One ``(launch, finish)`` for several ops: every op is issued asynchronously (a synchronous one would hold
    the next back), and ``finish`` finishes each in turn."""
    if len(parts) == 1:
        launch, finish = parts[0]
        return launch, lambda: [finish()]
    return (lambda blocking: [h for launch, _ in parts for h in launch(False)]), (lambda: [f() for _, f in parts])
