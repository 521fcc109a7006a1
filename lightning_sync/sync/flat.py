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
* **parameter-server messages** (:mod:`lightning_sync.sync.ps.wire`) lay one dtype's tensors out so a
  request is a few tensors however many parameters the model has.

:meth:`FlatShard.owned_slices` says which part of which parameter falls in this rank's shard, so an
optimizer can step exactly the owned elements and a checkpoint can name them by parameter and offset.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_sync.sync.communicator import Communicator

__all__ = ["FlatShard", "OwnedSlice"]


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
        ref = next((t for t in tensors if t is not None), None)
        if ref is None:
            flat = torch.zeros(self.padded, dtype=dtype or torch.get_default_dtype(), device=device)
        else:
            flat = ref.new_zeros(self.padded, dtype=dtype, device=device)
        for t, shape, off, n in zip(tensors, self.shapes, self.offsets, self.numels):
            if t is None:
                continue
            if t.shape != shape:
                raise ValueError(f"tensor of shape {tuple(t.shape)} where {tuple(shape)} was planned")
            flat[off : off + n] = t.reshape(-1)
        return flat

    def view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s elements of a full flat buffer, flat (a view)."""
        off = self.offsets[index]
        return flat[off : off + self.numels[index]]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a full flat buffer shaped like the parameters (padding excluded)."""
        self._check_full(flat)
        return [flat[off : off + n].view(shape) for off, n, shape in zip(self.offsets, self.numels, self.shapes)]

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

    def all_gather(self, shard: torch.Tensor, comm: Communicator, async_op: bool = False) -> object:
        """Gather every rank's shard into a new full flat buffer (a Work if ``async_op``)."""
        if shard.numel() != self.shard_numel:
            raise ValueError(f"shard has {shard.numel()} elements, the plan has {self.shard_numel}")
        full = shard.new_empty(self.padded)
        return comm.all_gather_into(full, shard, async_op=async_op)

    def reduce_scatter(self, flat: torch.Tensor, comm: Communicator, op: str = "avg", async_op: bool = False) -> object:
        """Reduce a full flat buffer over the ranks into a new shard (a Work if ``async_op``)."""
        self._check_full(flat)
        out = flat.new_empty(self.shard_numel)
        return comm.reduce_scatter_into(out, flat, op=op, async_op=async_op)

    def _check_full(self, flat: torch.Tensor) -> None:
        if flat.dim() != 1 or flat.numel() != self.padded:
            raise ValueError(f"expected a flat buffer of {self.padded} elements, got shape {tuple(flat.shape)}")
