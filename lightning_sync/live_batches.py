"""Each micro-batch of the global order shared out over whoever is training now: the data side of live fault
tolerance.

A job started at W ranks with per-rank batch B trains, at each micro-step j of an epoch, on the ``B * W`` entries
``j*B*W .. (j+1)*B*W`` of the epoch's global order (:mod:`lightning_sync.sampler`): rank r takes entries r, r + W,
... of them. When a rank is lost and the job goes on at K < W ranks, or a replacement brings it back, the global
batch is held: the same entries are shared out strided over the K members of the current membership epoch, each
taking about ``B * W / K`` (the shares differ by at most one sample). Every sample of the epoch is then trained
once, in the same global batch as in an uninterrupted run, whatever the failures.

:class:`LiveBatches` is the training loader's batch sampler. It asks for the current rank and world size each time
it yields, and remembers for which it made each micro-step's indices, because the loader prefetches: a batch made
before a membership change is stale, and :meth:`LiveBatches.share` gives the indices to rebuild it with. The
epoch's order, its length and the resume position are those of the :class:`~lightning_sync.sampler.GlobalOrderSampler`
it wraps (at the job's nominal world size W), so exact resume works unchanged.

A member whose share is smaller or larger than ``B`` computes the mean loss over its share; :meth:`LiveBatches.weight`
is the factor that makes the average of the members' gradients the mean over the whole micro-batch (1 when the
shares are equal).

Imports nothing from Lightning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from lightning_sync.sampler import GlobalOrderSampler

__all__ = ["LiveBatches", "share_of", "weight_of"]


def share_of(entries: list[int], rank: int, world: int) -> list[int]:
    """Member ``rank`` of ``world``'s indices of a micro-batch of ``entries``: every ``world``-th from its rank."""
    return entries[rank::world]


def weight_of(entries: list[int], rank: int, world: int) -> float:
    """The factor on member ``rank``'s mean-loss gradient of a micro-batch of ``entries`` that makes the members'
    average the micro-batch's mean: its share of the samples times ``world`` (exactly 1 for equal shares)."""
    total = len(entries)
    mine = len(range(rank, total, world))
    return 1.0 if mine * world == total else mine * world / total


class LiveBatches:
    """This member's share of each micro-step of the epoch, for the membership current when it is made.

    Args:
        sampler: the training loader's sampler (the epoch's global order at the nominal world size).
        batch_size: the per-rank batch ``B`` at the nominal world size.
        drop_last: the loader's ``drop_last`` (a short last micro-step is then not trained).
        view: returns this member's ``(rank, world_size)`` now.
    """

    def __init__(
        self,
        sampler: GlobalOrderSampler,
        batch_size: int,
        drop_last: bool,
        view: Callable[[], tuple[int, int]],
    ) -> None:
        self.sampler, self.batch_size, self.drop_last, self._view = sampler, batch_size, drop_last, view
        #: micro-step -> the (rank, world size) its yielded indices were made for
        self.made: dict[int, tuple[int, int]] = {}
        self._order: list[int] = []

    @classmethod
    def install(cls, loader: Any, view: Callable[[], tuple[int, int]], owner: str) -> LiveBatches:
        """Make ``loader`` (a training ``DataLoader`` over Lightning's ``DistributedSampler``, made a
        :class:`GlobalOrderSampler`) yield this member's shares; ``owner`` names the strategy in the error."""
        sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
        if not isinstance(loader, DataLoader) or not isinstance(sampler, GlobalOrderSampler):
            raise ValueError(
                f"{owner}: live fault tolerance shares out each global batch from the training loader's "
                f"DistributedSampler; this loader has {type(sampler).__name__}. Use a map-style dataset with a "
                f"DataLoader(batch_size=...) and Trainer(use_distributed_sampler=True)"
            )
        batches = cls(sampler, loader.batch_size, loader.drop_last, view)
        # a DataLoader refuses a new batch sampler once built, but reads it anew for every iterator
        object.__setattr__(loader, "batch_sampler", batches)
        return batches

    @property
    def micro(self) -> int:
        """Entries of the global order in one micro-step (``B`` x the nominal world size)."""
        return self.batch_size * self.sampler.world_size

    def __len__(self) -> int:
        per_rank = len(self.sampler)
        return per_rank // self.batch_size if self.drop_last else -(-per_rank // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        self._order, start = self.sampler.entries()
        self.made = {}
        for j in range(start // self.micro, len(self)):
            rank, world = self._view()
            self.made[j] = (rank, world)
            yield self.share(j, rank, world)

    def entries(self, j: int) -> list[int]:
        """The global-order entries of micro-step ``j`` of the current epoch (the whole micro-batch)."""
        return self._order[j * self.micro : min((j + 1) * self.micro, self.sampler.total)]

    def share(self, j: int, rank: int, world: int) -> list[int]:
        """Member ``rank`` of ``world``'s indices of micro-step ``j`` of the current epoch."""
        return share_of(self.entries(j), rank, world)

    def weight(self, j: int, rank: int, world: int) -> float:
        """:func:`weight_of` micro-step ``j`` of the current epoch."""
        return weight_of(self.entries(j), rank, world)

    def is_stale(self, j: int, rank: int, world: int) -> bool:
        """Whether micro-step ``j``'s batch was made for another membership than ``(rank, world)`` (or not at all)."""
        for old in [k for k in self.made if k < j - 1]:  # what the loop has consumed
            del self.made[old]
        return self.made.get(j) != (rank, world)
