"""Rank 0's module state to every rank: what makes data-parallel replicas start (and stay) equal.

Every data-parallel strategy begins by broadcasting rank 0's parameters and buffers, so that replicas built
from different random initializations train one model; bucketed DDP (like torch's DDP with
``broadcast_buffers``) also broadcasts rank 0's buffers before every forward, so running statistics do not
drift apart. Both are collectives: every rank calls them, in the same order. A rank that fails leaves its
peers blocked in the broadcast until the process group notices.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from lightning_sync.sync.flat import FlatLayout

__all__ = ["Broadcaster", "broadcast_buffers", "broadcast_module_states"]


class Broadcaster(Protocol):
    """What these functions need of a communicator: a :class:`~lightning_sync.comms.CommContext` and every
    :class:`~lightning_sync.sync.communicator.Communicator` have it."""

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Any: ...


def broadcast_module_states(module: nn.Module, comm: Broadcaster) -> None:
    """Rank 0's parameters and buffers into every rank's ``module``, in place: one broadcast per tensor, in
    ``parameters()`` then ``buffers()`` order. Tensors on the meta device hold no values to send; the ZeRO engine
    initializes them alike on every rank (:mod:`lightning_sync.sync.zero.materialize`)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if not t.is_meta:
                comm.broadcast(t.data, src=0)


def broadcast_buffers(module: nn.Module, comm: Broadcaster) -> None:
    """Rank 0's buffers into every rank's ``module``, in place: one flat broadcast per dtype (none without
    buffers; empty ones are left out)."""
    buffers = [b for b in module.buffers() if b.numel()]
    layout = FlatLayout(buffers)
    flats = layout.flatten(buffers)
    for flat in flats:
        comm.broadcast(flat, src=0)
    layout.copy_into(flats, buffers)
