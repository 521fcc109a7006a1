"""Each micro-batch of the global order shared out over the ranks training it: evenly over whoever is training now
(live fault tolerance), or in proportion to each rank's measured speed (rebalancing).

A job started at W ranks with per-rank batch B trains, at each micro-step j of an epoch, on the ``B * W`` entries
``j*B*W .. (j+1)*B*W`` of the epoch's global order (:mod:`lightning_sync.sampler`): rank r takes entries r, r + W,
... of them. Two things may share those entries out differently, and both keep the global batch, so every sample of
the epoch is trained once, in the same global batch as in a plain run:

* **a membership change** (a rank lost, or a replacement brought back): the same entries go strided over the K
  members now training, each taking about ``B * W / K`` (the shares differ by at most one sample);
* **a split by speed**: rank r takes ``counts[r]`` of the ``B * W`` entries (a short last micro-step in proportion,
  :func:`~lightning_sync.sync.rebalance.proportional`),
  dealt round-robin among the ranks still short of their count (:func:`deal`), so equal counts are exactly the
  strided shares.

A *place* says which: ``(rank, world)`` for the even split, ``(rank, world, counts)`` for a split by counts.

:class:`SharedBatches` is the training loader's batch sampler. It asks for this rank's place each time it yields,
and remembers for which place it made each micro-step's indices, because the loader prefetches: a batch made before
the place changed is stale, and :meth:`SharedBatches.share` gives the indices to rebuild it with. The epoch's
order, its length and the resume position are those of the :class:`~lightning_sync.sampler.GlobalOrderSampler` it
wraps (at the job's nominal world size W), so exact resume works unchanged.

A rank whose share is smaller or larger than ``B`` computes the mean loss over its share; :func:`weight_of` is the
factor that makes the average of the ranks' gradients the mean over the whole micro-batch (exactly 1 when the
shares are equal).

Imports nothing from Lightning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.utils.data import DataLoader

from lightning_sync.sampler import GlobalOrderSampler
from lightning_sync.sync.rebalance import proportional

__all__ = ["Place", "SharedBatches", "deal", "rebuild", "share_of", "size_of", "weight_of"]

#: ``(rank, world)``: the even, strided split over ``world``; ``(rank, world, counts)``: ``counts[r]`` samples of a
#: whole micro-batch to rank r (:func:`deal`)
Place = tuple[Any, ...]


def deal(entries: Sequence[int], counts: Sequence[int]) -> list[list[int]]:
    """``entries`` dealt round-robin to the ranks still short of their ``counts`` (which sum to ``len(entries)``):
    equal counts give rank r entries r, r + W, ..., the strided shares of a plain run."""
    if sum(counts) != len(entries) or min(counts, default=0) < 0:
        raise ValueError(f"counts {list(counts)} do not split {len(entries)} entries")
    out: list[list[int]] = [[] for _ in counts]
    active, done, start = [r for r, n in enumerate(counts) if n], 0, 0
    while active:  # rounds in which the same ranks take one entry each, in rank order: one slice per rank
        rounds = min(counts[r] for r in active) - done
        block = entries[start : start + rounds * len(active)]
        for i, r in enumerate(active):
            out[r].extend(block[i :: len(active)])
        start, done = start + len(block), done + rounds
        active = [r for r in active if counts[r] > done]
    return out


def _counts(entries: Sequence[int], place: Place) -> list[int] | None:
    """The counts of a place's split for this micro-batch (a short one in proportion); None for the even split."""
    if len(place) < 3 or place[2] is None:
        return None
    counts = list(place[2])
    return counts if sum(counts) == len(entries) else proportional(counts, len(entries))


def share_of(entries: list[int], *place: Any) -> list[int]:
    """This rank's indices of a micro-batch of ``entries`` for ``place`` (``rank, world[, counts]``)."""
    rank, world = place[0], place[1]
    counts = _counts(entries, place)
    return entries[rank::world] if counts is None else deal(entries, counts)[rank]


def size_of(entries: list[int], *place: Any) -> int:
    """How many of a micro-batch of ``entries`` this rank takes for ``place``, without dealing them out."""
    rank, world = place[0], place[1]
    counts = _counts(entries, place)
    return len(range(rank, len(entries), world)) if counts is None else counts[rank]


def weight_of(entries: list[int], *place: Any) -> float:
    """The factor on this rank's mean-loss gradient of a micro-batch of ``entries`` that makes the ranks' average
    the micro-batch's mean: its share of the samples times ``world`` (exactly 1 for equal shares)."""
    world, total = place[1], len(entries)
    mine = size_of(entries, *place)
    return 1.0 if mine * world == total else mine * world / total


class SharedBatches:
    """This rank's share of each micro-step of the epoch, for its place when the share is made.

    Args:
        sampler: the training loader's sampler (the epoch's global order at the nominal world size).
        batch_size: the per-rank batch ``B`` at the nominal world size.
        drop_last: the loader's ``drop_last`` (a short last micro-step is then not trained).
        view: returns this rank's :data:`Place` now.
    """

    def __init__(
        self,
        sampler: GlobalOrderSampler,
        batch_size: int,
        drop_last: bool,
        view: Callable[[], Place],
    ) -> None:
        self.sampler, self.batch_size, self.drop_last, self._view = sampler, batch_size, drop_last, view
        #: micro-step -> the place its yielded indices were made for
        self.made: dict[int, Place] = {}
        self._order: list[int] = []

    @classmethod
    def install(cls, loader: Any, view: Callable[[], Place], owner: str, why: str) -> SharedBatches:
        """Make ``loader`` (a training ``DataLoader`` over Lightning's ``DistributedSampler``, made a
        :class:`GlobalOrderSampler`) yield this rank's shares; ``owner`` names the strategy in the error, ``why``
        the feature that needs it."""
        sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
        if not isinstance(loader, DataLoader) or not isinstance(sampler, GlobalOrderSampler):
            raise ValueError(
                f"{owner}: {why} shares out each global batch from the training loader's "
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
            place = self._view()
            self.made[j] = place
            yield self.share(j, *place)

    def entries(self, j: int) -> list[int]:
        """The global-order entries of micro-step ``j`` of the current epoch (the whole micro-batch)."""
        return self._order[j * self.micro : min((j + 1) * self.micro, self.sampler.total)]

    def share(self, j: int, *place: Any) -> list[int]:
        """This rank's indices of micro-step ``j`` of the current epoch, for ``place``."""
        return share_of(self.entries(j), *place)

    def weight(self, j: int, *place: Any) -> float:
        """:func:`weight_of` micro-step ``j`` of the current epoch."""
        return weight_of(self.entries(j), *place)

    def is_stale(self, j: int, *place: Any) -> bool:
        """Whether micro-step ``j``'s batch was made for another place than ``place`` (or not at all)."""
        for old in [k for k in self.made if k < j - 1]:  # what the loop has consumed
            del self.made[old]
        return self.made.get(j) != tuple(place)


def rebuild(loader: Any, strategy: Any, indices: list[int]) -> Any:
    """The batch of ``indices``, made in this process as ``loader`` would (its dataset and ``collate_fn``) and
    moved as Lightning moves one (the module's batch-transfer hooks, the strategy's device): for a batch that was
    prefetched for another place."""
    batch = loader.collate_fn([loader.dataset[i] for i in indices])
    batch = strategy.lightning_module._on_before_batch_transfer(batch, dataloader_idx=0)
    return strategy.batch_to_device(batch, dataloader_idx=0)
