"""Flat-parameter sharding: the data layout under ZeRO stages 1-3 (Rajbhandari et al., SC 2020).

A :class:`FlatShard` flattens a group of parameters (one dtype) into one buffer of
``padded = ceil(total / K) * K`` elements, so it splits into K equal contiguous shards; rank r owns
elements ``[r * shard, (r + 1) * shard)``. Padding sits at the very end of the last shard(s), is kept
at zero, and is never visible through :meth:`FlatShard.views`.

The two collectives of sharded training are then even and metadata-free:

* **all-gather** the K shards into the full flat buffer (before a unit's forward/backward in stage 3,
  after the optimizer step in stages 1 and 2): each rank sends ``shard`` elements;
* **reduce-scatter** the full flat gradient into this rank's averaged shard (stages 2 and 3): each
  rank contributes ``padded`` elements and keeps ``shard``.

:meth:`FlatShard.owned_slices` says which part of which parameter falls in this rank's shard, so an
optimizer can step exactly the owned elements (stage 1/2 optimizer-state sharding).

:func:`zero_memory_bytes` is the per-rank memory model of the ZeRO paper for mixed-precision Adam
(2 bytes fp16 parameters, 2 bytes fp16 gradients, K=12 bytes of optimizer state per parameter:
fp32 master copy, momentum and variance): baseline 16Ψ, stage 1 4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N,
stage 3 16Ψ/N.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_sync.sync.communicator import Communicator

__all__ = ["FlatShard", "OwnedSlice", "ZERO_STAGES", "zero_memory_bytes"]

ZERO_STAGES = (1, 2, 3)


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

    Args:
        shapes: the parameters' shapes, in flattening order.
        world_size: K, the number of shards (>= 1).
        rank: this rank's shard index, ``0 <= rank < K``.
    """

    def __init__(self, shapes: Sequence[torch.Size | tuple[int, ...]], world_size: int, rank: int) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [math.prod(s) for s in self.shapes]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.total = sum(self.numels)
        self.world_size, self.rank = world_size, rank
        self.shard_numel = -(-self.total // world_size) if self.total else 0
        self.padded = self.shard_numel * world_size
        self.start = rank * self.shard_numel
        self.end = self.start + self.shard_numel

    @property
    def padding(self) -> int:
        """Zero elements appended so the buffer divides by K."""
        return self.padded - self.total

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """One padded flat buffer holding ``tensors`` (which must have :attr:`shapes`)."""
        if len(tensors) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} tensors, got {len(tensors)}")
        ref = tensors[0] if tensors else torch.empty(0)
        flat = ref.new_zeros(self.padded)
        for t, shape, off, n in zip(tensors, self.shapes, self.offsets, self.numels):
            if t.shape != shape:
                raise ValueError(f"tensor of shape {tuple(t.shape)} where {tuple(shape)} was planned")
            flat[off : off + n] = t.reshape(-1)
        return flat

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

    def reduce_scatter(self, flat: torch.Tensor, comm: Communicator, op: str = "avg",
                       async_op: bool = False) -> object:
        """Reduce a full flat buffer over the ranks into a new shard (a Work if ``async_op``)."""
        self._check_full(flat)
        out = flat.new_empty(self.shard_numel)
        return comm.reduce_scatter_into(out, flat, op=op, async_op=async_op)

    def _check_full(self, flat: torch.Tensor) -> None:
        if flat.dim() != 1 or flat.numel() != self.padded:
            raise ValueError(f"expected a flat buffer of {self.padded} elements, got shape {tuple(flat.shape)}")


def zero_memory_bytes(num_params: int, world_size: int, stage: int, optimizer_bytes: int = 12) -> float:
    """Per-rank bytes of parameters, gradients and optimizer state (mixed-precision Adam by default).

    ``stage`` 0 is the unsharded baseline; ``optimizer_bytes`` is K of the ZeRO paper (12 for
    mixed-precision Adam: fp32 master, momentum, variance).
    """
    if stage not in (0, *ZERO_STAGES):
        raise ValueError(f"stage must be one of {[0, *ZERO_STAGES]} (0 = no sharding), got {stage!r}")
    if world_size < 1 or num_params < 0:
        raise ValueError(f"need world_size >= 1 and num_params >= 0, got {world_size=}, {num_params=}")
    psi, n, k = float(num_params), float(world_size), float(optimizer_bytes)
    return {0: (4 + k) * psi, 1: 4 * psi + k * psi / n, 2: 2 * psi + (2 + k) * psi / n,
            3: (4 + k) * psi / n}[stage]
