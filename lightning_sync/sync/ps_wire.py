"""What travels between a parameter-server worker and the server: tensors packed as one flat tensor per
dtype (:class:`FlatLayout`, the same order on both sides), and the server's :class:`Reply`.

One flat tensor per dtype keeps a request to a few tensors however many parameters the model has; both
sides build the layout from the same parameter order, so nothing describing it is ever sent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["FlatLayout", "Reply"]


class FlatLayout:
    """A fixed list of tensors packed as one flat tensor per dtype (in first-seen dtype order)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.shapes = [t.shape for t in tensors]
        self.groups: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            self.groups.setdefault(t.dtype, []).append(i)

    def flatten(self, tensors: Sequence[torch.Tensor | None], fill_missing: bool = False) -> list[torch.Tensor]:
        """One new CPU tensor per dtype; ``None`` entries become zeros when ``fill_missing``."""
        out = []
        for dtype, idx in self.groups.items():
            parts = []
            for i in idx:
                t = tensors[i]
                if t is None:
                    if not fill_missing:
                        raise ValueError(f"tensor {i} is None")
                    t = torch.zeros(self.shapes[i], dtype=dtype)
                parts.append(t.detach().reshape(-1).to("cpu", dtype))
            out.append(torch.cat(parts) if parts else torch.zeros(0, dtype=dtype))
        return out

    def views(self, flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors as views into ``flats`` (in the original order)."""
        out: list[torch.Tensor | None] = [None] * len(self.shapes)
        for flat, idx in zip(flats, self.groups.values()):
            offset = 0
            for i in idx:
                n = math.prod(self.shapes[i])
                out[i] = flat[offset : offset + n].view(self.shapes[i])
                offset += n
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
