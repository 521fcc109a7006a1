"""The one flat-buffer layout: parameters -> one padded flat buffer -> per-parameter views and shards.

Every algorithm here that moves many parameters in one message packs them the same way, so the
packing is written once:

* **DDP buckets** (:mod:`lightning_sync.sync.bucketing`) lay a bucket's gradients out with
  ``world_size=1`` (no padding) and make each ``param.grad`` a view into the bucket, so all-reducing
  the bucket is all-reducing every gradient in it, with no copy in or out;
* **ZeRO flat parameters** (:mod:`lightning_sync.sync.zero.flat_param`) lay a unit's parameters out over K
  ranks: the buffer is padded to ``padded = ceil(total / K) * K`` elements so it splits into K equal
  contiguous shards, and rank r owns ``[r * shard, (r + 1) * shard)``. Equal shards are what makes the
  all-gather and reduce-scatter of sharded training even and metadata-free (gloo has no uneven
  all-gather). Padding sits at the very end, is kept at zero, and is never visible through
  :meth:`FlatShard.views`;
* **messages of many tensors** (:class:`FlatLayout`: one flat tensor per dtype) - the parameter server's
  requests and replies (:mod:`lightning_sync.sync.ps.wire`), LocalSGD's and DiLoCo's averages
  (:mod:`lightning_sync.sync.periodic`), PowerSGD's two messages (:mod:`lightning_sync.sync.compression`) and
  the broadcast of rank 0's buffers (:mod:`lightning_sync.sync.replicas`) - so a message is a few tensors
  however many it carries.

:meth:`FlatShard.owned_slices` says which part of which parameter falls in this rank's shard, so an
optimizer can step exactly the owned elements and a checkpoint can name them by parameter and offset.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["FlatLayout", "FlatShard", "OwnedSlice"]


@dataclass(frozen=True)
class OwnedSlice:
    """Elements ``[param_offset, param_offset + length)`` of parameter ``index`` (flattened) live at
    ``[shard_offset, shard_offset + length)`` of this rank's shard."""

    index: int
    param_offset: int
    shard_offset: int
    length: int


class FlatShard:
    """The flat, padded, evenly sharded layout of ``shapes`` over ``world_size`` ranks.

    With ``world_size=1`` (the default) it is a plain packing: no padding, one shard that is the
    whole buffer.

    Args:
        shapes: the parameters' shapes, in flattening order.
        world_size: K, the number of shards (>= 1).
        rank: this rank's shard index, ``0 <= rank < K``.
    """

    def __init__(self, shapes: Sequence[torch.Size | tuple[int, ...]], world_size: int = 1, rank: int = 0) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [math.prod(s) for s in self.shapes]
        self.offsets: list[int] = []
        offset = 0
        for n in self.numels:
            self.offsets.append(offset)
            offset += n
        self.total = offset
        self.world_size, self.rank = world_size, rank
        self.shard_numel = -(-self.total // world_size) if self.total else 0
        self.padded = self.shard_numel * world_size
        self.start = rank * self.shard_numel
        self.end = self.start + self.shard_numel

    @property
    def padding(self) -> int:
        """Zero elements appended so the buffer divides by K."""
        return self.padded - self.total

    def new_buffer(self, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
        """A zeroed full flat buffer for this layout."""
        return torch.zeros(self.padded, dtype=dtype, device=device)

    def flatten(
        self,
        tensors: Sequence[torch.Tensor | None],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """One new padded flat buffer holding ``tensors`` (which must have :attr:`shapes`; ``None``
        leaves zeros). Dtype and device are the first tensor's unless given."""
        if len(tensors) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} tensors, got {len(tensors)}")
        for t, shape in zip(tensors, self.shapes):
            if t is not None and t.shape != shape:
                raise ValueError(f"tensor of shape {tuple(t.shape)} where {tuple(shape)} was planned")
        ref = next((t for t in tensors if t is not None), None)
        if ref is None:
            return torch.zeros(self.padded, dtype=dtype or torch.get_default_dtype(), device=device)
        dtype = dtype or ref.dtype
        where = ref.device if device is None else torch.device(device)
        if not self.padding and all(t is not None and t.dtype == dtype and t.device == where for t in tensors):
            # every element is a tensor's, in its own dtype and place: one concatenation, nothing to zero or cast
            return torch.cat([t.reshape(-1) for t in tensors])  # type: ignore[union-attr]
        flat = ref.new_zeros(self.padded, dtype=dtype, device=where)
        for t, off, n in zip(tensors, self.offsets, self.numels):
            if t is not None:
                flat[off : off + n] = t.reshape(-1)
        return flat

    def view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s elements of a full flat buffer, flat (a view)."""
        off = self.offsets[index]
        return flat[off : off + self.numels[index]]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a full flat buffer shaped like the parameters (padding excluded)."""
        self._check_full(flat)
        views = []
        for off, n, shape in zip(self.offsets, self.numels, self.shapes):
            piece = flat[off : off + n]  # a slice: one view of ``flat`` each (no multi-output view, as split's)
            # a piece is 1-D already; view(*sizes) parses faster than view(torch.Size), which a 0-d shape needs
            views.append(piece if len(shape) == 1 else piece.view(*shape) if shape else piece.view(shape))
        return views

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full flat buffer (a view)."""
        self._check_full(flat)
        return flat[self.start : self.end]

    def owned_slices(self) -> list[OwnedSlice]:
        """The pieces of parameters inside this rank's shard, in order (padding excluded)."""
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(off, self.start), min(off + n, self.end)
            if lo < hi:
                out.append(OwnedSlice(i, lo - off, lo - self.start, hi - lo))
        return out

    def _check_full(self, flat: torch.Tensor) -> None:
        if flat.dim() != 1 or flat.numel() != self.padded:
            raise ValueError(f"expected a flat buffer of {self.padded} elements, got shape {tuple(flat.shape)}")


class FlatLayout:
    """A fixed list of tensors packed as one flat tensor per dtype (per dtype and device with ``by_device``),
    groups in first-seen order; each group's packing is a :class:`FlatShard` (one shard, no padding). Both
    ends of a message build it from the same tensors in the same order, so nothing describing it is sent.

    Args:
        tensors: the tensors (or any with their shapes, dtypes and devices), in packing order.
        by_device: also keep tensors on different devices in different groups.
        device: where :meth:`flatten` builds the flat tensors (None: on their tensors' device).
    """

    def __init__(
        self, tensors: Sequence[torch.Tensor], by_device: bool = False, device: torch.device | str | None = None
    ) -> None:
        self.device = device
        self.shapes = [t.shape for t in tensors]
        groups: dict[Hashable, list[int]] = {}
        for i, t in enumerate(tensors):
            groups.setdefault((t.dtype, t.device) if by_device else t.dtype, []).append(i)
        self.dtypes = [tensors[idx[0]].dtype for idx in groups.values()]
        self.groups = list(groups.values())
        """Per flat tensor, the indices of the tensors it holds."""
        self._layouts = [FlatShard([self.shapes[i] for i in idx]) for idx in self.groups]

    def flatten(self, tensors: Sequence[torch.Tensor | None], fill_missing: bool = False) -> list[torch.Tensor]:
        """One new flat tensor per group (on :attr:`device`); ``None`` entries become zeros when
        ``fill_missing``."""
        out = []
        for dtype, idx, layout in zip(self.dtypes, self.groups, self._layouts):
            parts = []
            for i in idx:
                t = tensors[i]
                if t is None and not fill_missing:
                    raise ValueError(f"tensor {i} is None")
                parts.append(t.detach() if t is not None and t.requires_grad else t)
            out.append(layout.flatten(parts, dtype=dtype, device=self.device))
        return out

    def views(self, flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors as views into ``flats`` (in the original order)."""
        out: list[torch.Tensor | None] = [None] * len(self.shapes)
        for flat, idx, layout in zip(flats, self.groups, self._layouts):
            for i, view in zip(idx, layout.views(flat)):
                out[i] = view
        return out  # type: ignore[return-value]

    def copy_into(self, flats: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``flats`` into ``tensors`` in place (any device)."""
        with torch.no_grad():
            for t, v in zip(tensors, self.views(flats)):
                t.copy_(v)
