"""One seeded global order of the training samples, and a position in it: the state exact resume reads.

Lightning gives each training rank a ``DistributedSampler(shuffle=True, seed=PL_GLOBAL_SEED)``. Its epoch
order is one permutation of the dataset, seeded by ``seed + epoch`` and extended cyclically to a multiple of
the world size W; rank r takes entries r, r + W, r + 2W, ... So after every rank has trained b batches of B
samples, exactly the first ``b * B * W`` entries of that order have been trained on, whatever the rank: the
state of the whole data pipeline is one number, the position in the epoch's global order. That number means
the same samples at any world size: a run of W' ranks resumes from it by dealing out the rest of the order
the same way, and as long as the global batch (per-rank batch x W x accumulation) is held, each later
optimizer step trains on the same set of samples as it would have in the interrupted run. The order is the
same permutation at every world size; only the padding at the epoch's end (to a multiple of W) differs, and
a short last global batch is weighted by its micro-batches (Lightning's accumulation averages their means),
so its update depends on the split.

:class:`GlobalOrderSampler` wraps the ``DistributedSampler`` (Lightning keeps calling ``set_epoch`` on it)
and yields exactly what it yields, except in the one epoch it was told to resume, where it starts at the
saved position. It is a sampler of the main process: a ``DataLoader``'s workers receive the indices it
yields, so it resumes the same way for ``num_workers`` 0, > 0 and persistent workers, provided the position
is set before the loader's iterator is created (workers prefetch at creation).

:class:`EvaluationShardSampler` is the evaluation counterpart: the same order cut to the dataset (no
sample repeated), rank r taking entries r, r + W, ...; the shards differ by at most one sample.

Both are ``DistributedSampler`` subclasses, because user code, libraries and Lightning itself test
``isinstance(sampler, DistributedSampler)`` before they call ``set_epoch`` or read ``num_replicas``, ``rank``,
``epoch``, ``shuffle``, ``seed``, ``drop_last``, ``num_samples`` or ``total_size``. Those attributes are the
wrapped sampler's, read (and written) through, so they keep their meaning: ``num_samples`` is what this rank
yields in an epoch and ``total_size`` what all ranks share out (for the evaluation shards, as in Lightning's
``UnrepeatedDistributedSampler``, the dataset itself).

Imports nothing from Lightning.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

__all__ = ["EvaluationShardSampler", "GlobalOrderSampler", "global_order", "shard_for_evaluation"]


def global_order(size: int, epoch: int, seed: int, shuffle: bool, total: int) -> list[int]:
    """The epoch's global order as ``DistributedSampler`` builds it: a permutation of ``range(size)`` seeded
    by ``seed + epoch`` (or ``range(size)`` without ``shuffle``), extended cyclically or cut to ``total``."""
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(size, generator=g).tolist()
    else:
        order = list(range(size))
    if total <= len(order):
        return order[:total]
    return (order * -(-total // len(order)))[:total]


class _FromBase:
    """An attribute of the wrapped ``DistributedSampler`` (``self.base``), read and written through it: the
    wrapper never holds a copy that could fall out of step with what it yields."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, sampler: Any, owner: type | None = None) -> Any:
        return self if sampler is None else getattr(sampler.base, self.name)

    def __set__(self, sampler: Any, value: Any) -> None:
        setattr(sampler.base, self.name, value)


class _ShardOf(DistributedSampler):
    """What both samplers share: a ``DistributedSampler`` whose every attribute is that of ``base``, the
    sampler Lightning installed, which they replace.

    ``DistributedSampler.__init__`` is not called: it would build a second set of attributes (and ask the
    default process group for the ones not given), where these are ``base``'s.
    """

    dataset = _FromBase()
    num_replicas = _FromBase()
    rank = _FromBase()
    epoch = _FromBase()
    shuffle = _FromBase()
    seed = _FromBase()
    drop_last = _FromBase()

    def __init__(self, base: DistributedSampler) -> None:
        self.base = base

    def set_epoch(self, epoch: int) -> None:
        self.base.set_epoch(epoch)


class GlobalOrderSampler(_ShardOf):
    """This rank's share of the epoch's global order, from a resume position (see the module docstring).

    Args:
        base: the ``DistributedSampler`` it replaces; its epoch, seed, shuffle, world size, rank and padding
            are read from it, so ``base.set_epoch`` (what Lightning calls) moves this sampler too.
    """

    num_samples = _FromBase()
    total_size = _FromBase()

    def __init__(self, base: DistributedSampler) -> None:
        super().__init__(base)
        self._resume: tuple[int, int] | None = None  # (epoch, position): where that epoch starts, once

    @property
    def world_size(self) -> int:
        return int(self.base.num_replicas)

    @property
    def total(self) -> int:
        """Entries of the epoch's global order that the ranks share out (the padded or cut dataset size)."""
        return int(self.base.total_size)

    def __iter__(self) -> Iterator[int]:
        order, start = self.entries()
        return iter(order[start + int(self.base.rank) : self.total : self.world_size])

    def entries(self) -> tuple[list[int], int]:
        """The current epoch's global order, and the position where this epoch's iteration starts (0, or where
        it was told to resume)."""
        start = 0
        if self._resume is not None:
            epoch, position = self._resume
            if epoch == int(self.epoch):
                start = position
            else:  # Lightning moved on to another epoch: the saved position no longer applies
                self._resume = None
        order = global_order(
            len(self.base.dataset), int(self.epoch), int(self.base.seed), bool(self.base.shuffle), self.total
        )
        return order, start

    def __len__(self) -> int:
        return int(self.base.num_samples)  # the whole epoch: Lightning counts the resumed epoch's batches

    def position(self, batches: int, batch_size: int) -> int:
        """The global position after every rank trained ``batches`` batches of ``batch_size`` samples."""
        return min(batches * batch_size * self.world_size, self.total)

    def state(self, batches: int, batch_size: int, epoch_done: bool, accumulate: int = 1) -> dict[str, Any]:
        """What a checkpoint carries: the epoch to continue and the position in its global order (the next
        epoch at 0 when this one is done), what must match for the position to mean the same samples, and
        the shape of a global batch (``batch_size`` per rank x world size x ``accumulate`` micro-batches)."""
        here = int(self.epoch)
        epoch, position = (here + 1, 0) if epoch_done else (here, self.position(batches, batch_size))
        return {
            "epoch": epoch,
            "position": position,
            "world_size": self.world_size,
            "dataset_size": len(self.base.dataset),
            "seed": int(self.base.seed),
            "batch_size": batch_size,
            "global_batch": batch_size * self.world_size * accumulate,
            "epoch_done": epoch_done,
        }

    def resume(self, state: Mapping[str, Any], batch_size: int | None = None, accumulate: int = 1) -> int:
        """Start epoch ``state["epoch"]`` at ``state["position"]``, and make it the current epoch now, before
        any iterator is created; returns the batches of ``batch_size`` that each rank of this run has already
        trained in that epoch (0 at an epoch's start, or without ``batch_size``).

        An epoch's start fits any dataset, world size and batch. A position inside an epoch needs the
        checkpoint's dataset and seed (else the samples left would not be the interrupted run's). At another
        world size or per-rank batch it also needs the checkpoint's global batch (``batch_size`` x world x
        ``accumulate``): the position is then a whole number of global batches, so the rest of the epoch
        falls into the same global batches as in an uninterrupted run. Anything else raises ``ValueError``
        naming both sides."""
        epoch, position = int(state["epoch"]), int(state["position"])
        batches = 0
        if position:
            here = {
                "world_size": self.world_size,
                "batch_size": batch_size,
                "global_batch": None if batch_size is None else batch_size * self.world_size * accumulate,
                "dataset_size": len(self.base.dataset),
                "seed": int(self.base.seed),
            }
            keys = ["dataset_size", "seed"]
            if (state.get("world_size"), state.get("batch_size", batch_size)) != (self.world_size, batch_size):
                keys.append("global_batch")  # reshaped: the global batch must hold
            if any(state.get(k) != here[k] for k in keys):
                raise ValueError(
                    f"the checkpoint stopped inside epoch {epoch} at sample {position} of its global order with "
                    f"{_describe(state)}; this run has {_describe(here)}, so the rest of that epoch would not "
                    f"be the samples, or the global batches, the interrupted run had left. "
                    f"{_advice(state, self.world_size, batch_size)}"
                )
            grid = self.world_size * (batch_size or 1)
            if not 0 < position <= self.total or position % grid:
                raise ValueError(
                    f"position {position} is not a multiple of the world size {self.world_size} x batch "
                    f"{batch_size or 1} within the epoch's {self.total} samples"
                )
            batches = position // grid if batch_size else 0
        self.base.set_epoch(epoch)
        self._resume = (epoch, position)
        return batches


def _describe(state: Mapping[str, Any]) -> str:
    """``world 2 x batch 8 (global batch 48), 1437 samples, seed 3`` for a message; unknowns say so."""
    g = state.get("global_batch")
    return (
        f"world {state.get('world_size')} x batch {state.get('batch_size', '?')} "
        f"(global batch {g if g else '?'}), {state.get('dataset_size')} samples, seed {state.get('seed')}"
    )


def _advice(state: Mapping[str, Any], world: int, batch_size: int | None) -> str:
    """What would make a refused resume work: the accumulation that holds the checkpoint's global batch at
    this world size and batch, where there is one; else a checkpoint saved at an epoch's end."""
    g = state.get("global_batch")
    if g and batch_size and g % (batch_size * world) == 0:
        return (
            f"Keep the global batch {g}: accumulate {g // (batch_size * world)} micro-batches of {batch_size} "
            f"on {world} ranks (Trainer(accumulate_grad_batches=...), or lightning-sync train "
            f"batch.global_size={g} batch.per_device={batch_size})."
        )
    return "Resume with the checkpoint's settings, or from a checkpoint saved at an epoch's end."


class EvaluationShardSampler(_ShardOf):
    """This rank's share of the dataset for evaluation, with no sample repeated.

    ``DistributedSampler`` pads the dataset to a multiple of the world size by repeating samples, so a synced
    metric counts them twice. Here the ``len(dataset)`` entries of the order (``base``'s, unshuffled unless it
    shuffles) are dealt out strided: the shards differ by at most one sample. Strided shards are the most even
    there are, so when they give the ranks different numbers of batches (:meth:`batches`), no split without
    repeats can give them the same.

    Args:
        base: the ``DistributedSampler`` it replaces (its epoch, seed, shuffle, world size and rank are read).
    """

    @property
    def num_samples(self) -> int:
        """The samples this rank evaluates (Lightning's ``UnrepeatedDistributedSampler`` means the same)."""
        return len(range(int(self.base.rank), len(self.base.dataset), int(self.base.num_replicas)))

    @property
    def total_size(self) -> int:
        """The samples all ranks evaluate together: the dataset, none repeated."""
        return len(self.base.dataset)

    def __iter__(self) -> Iterator[int]:
        size = len(self.base.dataset)
        order = global_order(size, int(self.base.epoch), int(self.base.seed), bool(self.base.shuffle), size)
        return iter(order[int(self.base.rank) :: int(self.base.num_replicas)])

    def __len__(self) -> int:
        return self.num_samples

    def batches(self, batch_size: int, drop_last: bool) -> list[int]:
        """Every rank's number of batches of ``batch_size`` (the same computation on every rank)."""
        world, size = int(self.base.num_replicas), len(self.base.dataset)
        shards = [len(range(r, size, world)) for r in range(world)]
        return [n // batch_size if drop_last else -(-n // batch_size) for n in shards]


def shard_for_evaluation(loader: Any) -> int:
    """Give an evaluation ``loader`` whose batches come from a plain ``DistributedSampler`` an
    :class:`EvaluationShardSampler` instead, in place, when every rank then runs the same number of batches.
    Returns how many samples stay repeated: 0, or the sampler's padding when the shards' batch counts would
    differ (a collective issued in every evaluation step, such as ZeRO-3's parameter gathers or a metric
    logged with ``on_step`` and ``sync_dist``, would then find no partner on the rank that ran out first).
    Other loaders are left as they are (0)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    base = getattr(batch_sampler, "sampler", None)
    batch_size = getattr(batch_sampler, "batch_size", None)
    # a DistributedSampler subclass (ours, once in place; Lightning's unrepeated one for prediction; a user's)
    # is left alone: only the exact type is known to order samples the way the shards assume
    if not isinstance(loader, DataLoader) or type(base) is not DistributedSampler or not isinstance(batch_size, int):
        return 0
    shards = EvaluationShardSampler(base)
    if len(set(shards.batches(batch_size, bool(batch_sampler.drop_last)))) > 1:
        return int(base.total_size) - len(base.dataset)
    batch_sampler.sampler = shards
    return 0
