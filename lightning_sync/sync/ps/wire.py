"""What travels between a parameter-server worker and the server: tensors packed as one flat CPU tensor per
dtype (:class:`~lightning_sync.sync.flat.FlatLayout`, the same order on both sides), and the server's
:class:`Reply`.

One flat tensor per dtype keeps a request to a few tensors however many parameters the model has; both
sides build the layout from the same parameter order, so nothing describing it is ever sent. The messages are
on the CPU, where the RPC agent sends from: :data:`WIRE_DEVICE`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightning_sync.sync.flat import FlatLayout

__all__ = ["WIRE_DEVICE", "FlatLayout", "Reply"]

#: Where a message's flat tensors are built (the ``device`` of its :class:`FlatLayout`).
WIRE_DEVICE = "cpu"


@dataclass
class Reply:
    """What a worker gets back: the global model now, and whether to stop."""

    version: int
    """Server version of ``params`` (optimizer steps applied)."""
    params: list[torch.Tensor]
    """The trainable parameters, one flat tensor per dtype (:class:`FlatLayout` order)."""
    buffers: list[torch.Tensor]
    """The model's buffers, one flat tensor per dtype."""
    lrs: list[float]
    """The optimizer's current learning rate per param group (so every worker reports the global LR)."""
    global_step: int
    """Pushes applied // K: synchronous steps' worth of samples."""
    stop: bool
    """The budget is spent; the worker should stop training."""
    applied: bool = True
    """False when this push was discarded (the budget was spent before it could be applied)."""
    staleness: dict[int, int] = field(default_factory=dict)
    """Histogram so far: staleness -> applied gradients (so any rank can log it)."""
