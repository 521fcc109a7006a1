"""Even all-gather and reduce-scatter on gloo as one round of pairwise sends and receives.

gloo's own ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` are several times slower than the bytes they
move: on 2 CPU cores, at K = 2 to 4 and 4 KiB to 32 MiB, its reduce-scatter took 3-14x as long as the exchange
below and, from 16 MiB, longer than an all-reduce of the same buffer, which moves twice the bytes
(``docs/comms.md``, "gloo fast paths"). Here every rank sends the chunk each peer needs straight to it and
receives the peers' chunks for itself, all K - 1 pairs in flight at once: each rank moves (K - 1)/K of the
buffer, as a ring does, in one latency step instead of K - 1.

* **all-gather**: rank r's ``input`` goes to every peer and lands in chunk r of everyone's ``output``.
* **all-to-all**: rank r sends chunk j of its ``input`` to rank j, and rank j's chunk r lands in chunk j of
  its ``output``.
* **reduce-scatter**: rank r sends chunk j of its ``input`` to rank j and receives every peer's chunk r; the
  reduction of its own chunk with theirs runs on this rank when the handle is waited on. The first peer's chunk
  lands in ``output`` itself and only K > 2 needs a buffer, of (K - 2) chunks; ``input`` is only read.

The messages carry a tag of their own, so they never pair with a user's ``send``/``recv`` (tag 0). Between two
ranks, gloo pairs the messages of one tag in the order they were posted, and every rank issues its collectives
in the same order, so exchanges in flight together still pair up correctly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_sync.comms.payload import get_rank, get_world_size, group_ranks

__all__ = ["EXCHANGE_TAG", "REDUCERS", "all_gather_exchange", "all_to_all_exchange", "reduce_scatter_exchange"]

#: the tag of every exchange message (any fixed value other than torch's default 0)
EXCHANGE_TAG = 0x5A17

#: how a received chunk folds into the one held: ``op`` -> in-place binary op (``avg`` sums, then divides by K)
REDUCERS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "sum": torch.Tensor.add_,
    "avg": torch.Tensor.add_,
    "max": lambda acc, x: torch.maximum(acc, x, out=acc),
    "min": lambda acc, x: torch.minimum(acc, x, out=acc),
}


Launch = Callable[[bool], list[Any]]


def all_gather_exchange(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[Launch, Callable[[], torch.Tensor]]:
    """``(launch, finish)`` for :meth:`~lightning_sync.comms.collectives.Collectives._issue`: ``launch`` copies
    ``input`` into this rank's chunk of ``output`` and starts the exchange (asynchronous whatever ``blocking``
    says); ``finish`` returns ``output``."""
    world, rank, ranks = get_world_size(group), get_rank(group), group_ranks(group)
    chunks = output.view(-1).chunk(world)

    def launch(blocking: bool) -> list[Any]:
        mine = chunks[rank]
        mine.copy_(input.reshape(-1))
        return _post([(ranks[j], mine, chunks[j]) for j in range(world) if j != rank], group)

    return launch, lambda: output


def all_to_all_exchange(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[Launch, Callable[[], torch.Tensor]]:
    """``(launch, finish)``: ``launch`` copies this rank's own chunk across and starts the exchange of the others;
    ``finish`` returns ``output``. ``input`` is only read."""
    world, rank, ranks = get_world_size(group), get_rank(group), group_ranks(group)
    sent, received = input.reshape(-1).chunk(world), output.view(-1).chunk(world)

    def launch(blocking: bool) -> list[Any]:
        received[rank].copy_(sent[rank])
        return _post([(ranks[j], sent[j], received[j]) for j in range(world) if j != rank], group)

    return launch, lambda: output


def reduce_scatter_exchange(
    output: torch.Tensor, input: torch.Tensor, op: str, group: dist.ProcessGroup | None
) -> tuple[Launch, Callable[[], torch.Tensor]]:
    """``(launch, finish)``: ``launch`` starts the exchange of ``input``'s chunks; ``finish``, once its handles
    completed, reduces this rank's chunk into ``output`` and returns it."""
    world, rank, ranks = get_world_size(group), get_rank(group), group_ranks(group)
    chunks, out = input.reshape(-1).chunk(world), output.view(-1)
    peers = [j for j in range(world) if j != rank]
    extra: list[torch.Tensor] = []  # the receive buffers beyond ``output`` (K > 2)
    fold = REDUCERS[op]

    def launch(blocking: bool) -> list[Any]:
        extra[:] = out.new_empty((world - 2) * out.numel()).chunk(world - 2) if world > 2 else ()
        return _post([(ranks[j], chunks[j], slot) for j, slot in zip(peers, [out, *extra])], group)

    def finish() -> torch.Tensor:
        if not peers:  # a group of one: its own chunk is the result
            out.copy_(chunks[rank])
            return output
        fold(out, chunks[rank])
        for slot in extra:
            fold(out, slot)
        extra.clear()
        if op == "avg":
            out.div_(world)
        return output

    return launch, finish


def _post(pairs: list[tuple[int, torch.Tensor, torch.Tensor]], group: dist.ProcessGroup | None) -> list[Any]:
    """For each ``(peer, send, receive)``: send ``send`` to global rank ``peer`` and receive its message into
    ``receive``, every message in flight at once; the handles."""
    handles = []
    for peer, send, receive in pairs:
        handles.append(dist.isend(send, dst=peer, group=group, tag=EXCHANGE_TAG))
        handles.append(dist.irecv(receive, src=peer, group=group, tag=EXCHANGE_TAG))
    return handles
