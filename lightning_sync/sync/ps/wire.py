"""What travels between a parameter-server worker and the server: tensors packed as one flat tensor per
dtype (:class:`FlatLayout`, the same order on both sides), and the server's :class:`Reply`.

One flat tensor per dtype keeps a request to a few tensors however many parameters the model has; both
sides build the layout from the same parameter order, so nothing describing it is ever sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lightning_sync.sync.flat import FlatShard

__all__ = ["FlatLayout", "Reply"]


class FlatLayout:
    """A fixed list of tensors packed as one flat tensor per dtype (in first-seen dtype order); each
    dtype's packing is a :class:`~lightning_sync.sync.flat.FlatShard` (one shard, no padding)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.shapes = [t.shape for t in tensors]
        self.groups: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            self.groups.setdefault(t.dtype, []).append(i)
        self._layouts = [FlatShard([self.shapes[i] for i in idx]) for idx in self.groups.values()]

    def flatten(self, tensors: Sequence[torch.Tensor | None], fill_missing: bool = False) -> list[torch.Tensor]:
        """One new CPU tensor per dtype; ``None`` entries become zeros when ``fill_missing``."""
        out = []
        for (dtype, idx), layout in zip(self.groups.items(), self._layouts):
            parts = []
            for i in idx:
                t = tensors[i]
                if t is None and not fill_missing:
                    raise ValueError(f"tensor {i} is None")
                parts.append(None if t is None else t.detach())
            out.append(layout.flatten(parts, dtype=dtype, device="cpu"))
        return out

    def views(self, flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors as views into ``flats`` (in the original order)."""
        out: list[torch.Tensor | None] = [None] * len(self.shapes)
        for flat, idx, layout in zip(flats, self.groups.values(), self._layouts):
            for i, view in zip(idx, layout.views(flat)):
                out[i] = view
        return out  # type: ignore[return-value]

    def copy_into(self, flats: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``flats`` into ``tensors`` in place (any device)."""
        with torch.no_grad():
            for t, v in zip(tensors, self.views(flats)):
                t.copy_(v)


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
