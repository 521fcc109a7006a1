"""``Rebalancing``: a synchronous strategy's share of each global batch per rank, set by each rank's measured speed.

The strategy owns one when built with ``rebalance=True``. The training loader's batches become this rank's shares
(:class:`~lightning_sync.shares.SharedBatches`): every micro-batch is the same ``B x W`` entries of the global order
as in a plain run, split by the counts the :class:`~lightning_sync.sync.rebalance.Rebalancer` holds. Each rank's
loss is weighted by its share (:func:`~lightning_sync.shares.weight_of`), so the all-reduced gradient is the mean
over the global batch, not the mean of the ranks' means: the result is a single process's on the same batches.

**What is measured.** Each rank times its own work on a micro-batch: from ``training_step``'s start to the end of
backward, less the seconds it spent blocked in the strategy's collectives (``CommStats.blocked_seconds``), so a fast
rank waiting for a slow one does not count as slow. The first optimizer step of a fit is set aside (it carries
one-time costs: allocations, caches). Then every ``every`` optimizer steps the ranks all-gather their
seconds and samples (one small collective) and each updates the same rebalancer with the same numbers: the new
split needs no other message, and it applies from the next micro-batch on. A batch the loader prefetched under the
old split is made again from the dataset in this process (:func:`~lightning_sync.shares.rebuild`).

**Checkpoints.** The split and the smoothed speeds travel in the checkpoint (the same on every rank), so a resume
at the same world size continues with them; at another world size, or with another per-rank batch, it starts even.
The position in the epoch is that of the global order, which rebalancing does not change.

**The deadline** (``deadline``, off by default) is an approximation, documented as one: a micro-batch whose forward
alone took longer than ``deadline`` x the median rank's predicted compute for its share (a rank stalled for a
moment) is dropped. Its rank skips its backward and sends zeros in every gradient bucket (the all-reduces must
still run), and before the optimizer step the ranks all-reduce how many samples arrived, so the gradient becomes
the mean over the samples that arrived. The dropped samples are not trained in this epoch: the step is no longer
the synchronous one, and the global batch of that step is smaller.

Rank 0 says each move in the log (``rebalance: each micro-batch of 64 now split [40, 24] over the ranks ...``).

Imports nothing of Lightning's internals.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_sync._checks import check_bool, check_int
from lightning_sync._lightning import batch_index, trainer_of
from lightning_sync.shares import SharedBatches, rebuild, share_of, size_of, weight_of
from lightning_sync.sync.rebalance import Rebalancer

__all__ = ["DROPPED", "REBALANCE", "SAVED", "SHARE", "Rebalancing"]

#: the checkpoint key of the rebalancing state
REBALANCE = "lightning_sync_rebalance"
#: logged gauges: each rank's fraction of a micro-batch, the compute seconds the split saved so far, and the
#: micro-batches dropped past the deadline (all ranks)
SHARE, SAVED, DROPPED = "rebalance/share_rank_{}", "rebalance/seconds_saved", "rebalance/dropped"


class Rebalancing:
    """One rank's part in rebalancing (module docstring); the strategy calls each method from the hook its name says.

    Args:
        owner: the strategy (its ranks, communication context, module and device).
        every: optimizer steps between two measurements (and so between two possible moves of the split).
        deadline: drop a micro-batch whose forward alone took longer than this many times the median rank's
            predicted compute for its share (None: never; :meth:`late`).
    """

    def __init__(self, owner: Any, every: int, deadline: float | None = None) -> None:
        self._owner = owner
        self.every, self.deadline = every, deadline
        #: micro-batches dropped past the deadline, all ranks together
        self.dropped = 0
        #: this rank's dropped micro-batches, as (epoch, batch index)
        self.dropped_here: list[tuple[int, int]] = []
        self._late = False  # this micro-batch was dropped
        self._arrived = self._expected = 0  # samples of this optimizer window: this rank's that arrived, all ranks' due
        self._window_drops = 0  # micro-batches this rank dropped in this optimizer window
        self.rebalancer: Rebalancer | None = None
        self.batches: SharedBatches | None = None
        self.weight = 1.0  # on this micro-batch's loss
        #: samples this rank computed in this fit (read by the straggler detector)
        self.samples = 0
        self._loader: Any = None
        self._saved: Mapping[str, Any] | None = None  # from a checkpoint, for the rebalancer made at install
        self._started: tuple[float, float] | None = None  # (clock, blocked seconds) at this micro-batch's start
        self._busy, self._window_samples, self._steps = 0.0, 0, 0
        self._share = 0  # samples of the micro-batch in progress
        self._warm = False  # the fit's first optimizer step was measured and set aside (it carries one-time costs)

    @classmethod
    def make(cls, owner: Any, rebalance: bool, every: int, deadline: float | None) -> Rebalancing | None:
        """The strategy's ``rebalance``, ``rebalance_every`` and ``rebalance_deadline``, checked: one for ``owner``,
        or None without ``rebalance``. Not with live fault tolerance, whose membership already splits each global
        batch over the ranks training now."""
        check_bool("rebalance", rebalance)
        check_int("rebalance_every", every, 1)
        if deadline is not None and (
            isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not 1 < deadline < math.inf
        ):
            raise ValueError(f"rebalance_deadline must be None or a finite number > 1, got {deadline!r}")
        if deadline is not None and not rebalance:
            raise ValueError(f"rebalance_deadline={deadline!r} needs rebalance=True; allowed without it: None")
        if not rebalance:
            return None
        if owner.live is not None:
            raise ValueError(
                f"{type(owner).__name__}: rebalance=True is not supported under the fault-tolerance agent "
                f"(fault_tolerant=True): allowed there is rebalance=False; or run without the agent"
            )
        return cls(owner, every, None if deadline is None else float(deadline))

    # ------------------------------------------------------------------ data
    def install(self, loader: Any) -> Any:
        """The training loader's batches become this rank's shares of the split in force when each is trained."""
        owner = self._owner
        self.batches = SharedBatches.install(loader, self._place, type(owner).__name__, "rebalance=True")
        self._loader = loader
        self._busy, self._window_samples, self._steps, self._warm = 0.0, 0, 0, False
        world, micro = owner.world_size, self.batches.micro
        if self.rebalancer is None or (self.rebalancer.world, self.rebalancer.micro) != (world, micro):
            self.rebalancer = Rebalancer(world, micro)
        if self._saved is not None:
            self.rebalancer.load_state_dict(self._saved)
            self._saved = None
        return loader

    def _place(self) -> tuple[int, int, tuple[int, ...]]:
        assert self.rebalancer is not None
        return self._owner.global_rank, self._owner.world_size, tuple(self.rebalancer.counts)

    def training_step_args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Before ``training_step``: this rank's share of the micro-batch for the split in force now (rebuilt if the
        loader made it for another), its loss weight, and the start of its timing."""
        assert self.batches is not None
        j = batch_index(trainer_of(self._owner.lightning_module))
        place, entries = self._place(), self.batches.entries(j)
        if self.batches.is_stale(j, *place):  # dealt out only then: a prefetched batch is this share already
            args = (rebuild(self._loader, self._owner, share_of(entries, *place)), *args[1:])
        self.weight = weight_of(entries, *place)
        self._share = size_of(entries, *place)
        self._expected += len(entries)
        self._late = False
        self._started = (time.perf_counter(), self._blocked())
        return args

    # ------------------------------------------------------------------ measuring
    def _blocked(self) -> float:
        stats = self._owner.telemetry.stats()  # the context's statistics, read where the telemetry reads them
        return stats.blocked_seconds() if stats is not None else 0.0

    def _own_seconds(self) -> float:
        """This micro-batch's seconds since its start, less those blocked in collectives meanwhile."""
        assert self._started is not None
        started, blocked = self._started
        return (time.perf_counter() - started) - (self._blocked() - blocked)

    def backward_done(self) -> None:
        """After backward: this micro-batch's own compute seconds join the window's."""
        if self._started is None:
            return
        self._busy += self._own_seconds()
        self._started = None
        done = 0 if self._late else self._share
        self._window_drops += int(self._late)
        self._window_samples += done
        self.samples += done
        self._arrived += done

    # ------------------------------------------------------------------ the deadline
    def late(self) -> bool:
        """Before backward, with a ``deadline``: whether this micro-batch's forward alone already took longer than
        ``deadline`` x the median rank's predicted compute for its share (from the smoothed speeds). Such a
        micro-batch is dropped: its backward is skipped (:meth:`nothing`) and its samples do not count."""
        r = self.rebalancer
        if self.deadline is None or r is None or r.speeds is None or self._started is None:
            return False
        self._late = self._own_seconds() > self.deadline * statistics.median(n / s for n, s in zip(r.counts, r.speeds))
        if self._late:
            trainer = trainer_of(self._owner.lightning_module)
            self.dropped_here.append((trainer.current_epoch, batch_index(trainer)))
        return self._late

    def nothing(self, module: Any) -> torch.Tensor:
        """What a dropped micro-batch backpropagates instead of its loss: zero gradients for every trainable
        parameter at next to no cost, so that every gradient bucket is still all-reduced, with zeros from here."""
        params = [p for p in module.parameters() if p.requires_grad]
        return torch.stack([(p * 0).sum() for p in params]).sum()

    def reweighed(self, closure: Any) -> Any:
        """``closure`` (the window's last training step and backward) followed, with a ``deadline``, by
        :meth:`reweigh`, before clipping and the optimizer see the gradients; without one, ``closure`` itself."""
        if self.deadline is None:
            return closure

        def run(*args: Any, **kwargs: Any) -> Any:
            out = closure(*args, **kwargs)
            self.reweigh(self._owner.lightning_module.parameters())
            return out

        return run

    def reweigh(self, params: Any) -> None:
        """After the window's last backward, before the optimizer step (with a ``deadline``): the samples that arrived
        on every rank, all-reduced, and the gradients scaled from the mean over the whole global batch (every rank's
        loss was weighted for it) to the mean over what arrived. Nothing dropped: nothing changes, bit for bit."""
        mine = torch.tensor([float(self._arrived), float(self._window_drops)], dtype=torch.float64)
        arrived, dropped = (float(x) for x in self._owner.comm.all_reduce(mine, op="sum"))
        expected, self._arrived, self._expected, self._window_drops = self._expected, 0, 0, 0
        self.dropped += int(dropped)
        if arrived in (expected, 0.0):  # all arrived; or nothing did, and the gradients are zeros anyway
            return
        for p in params:
            if p.grad is not None:
                p.grad.mul_(expected / arrived)

    def step_done(self) -> None:
        """After an optimizer step: every ``every`` of them, the ranks exchange their measurements and move the split
        alike (the same decision from the same gathered numbers on every rank)."""
        if not self._warm:  # the same decision on every rank: each counts the same steps
            self._warm = True
            self._busy, self._window_samples, self._steps = 0.0, 0, 0
            return
        self._steps += 1
        if self._steps < self.every or self.rebalancer is None:
            return
        mine = torch.tensor([self._busy, float(self._window_samples)], dtype=torch.float64)
        self._busy, self._window_samples, self._steps = 0.0, 0, 0
        gathered = self._owner.comm.all_gather(mine)
        seconds = [float(g[0]) for g in gathered]
        samples = [int(g[1]) for g in gathered]
        if self.rebalancer.update(seconds, samples):
            speeds = ", ".join(f"{s:.0f}" for s in self.rebalancer.speeds or [])
            rank_zero_info(
                f"rebalance: each micro-batch of {self.rebalancer.micro} now split {self.rebalancer.counts} over the "
                f"ranks (measured samples/s: {speeds}); {self.rebalancer.seconds_saved:.2f} s of compute saved so far"
            )

    # ------------------------------------------------------------------ reporting and checkpoints
    def gauges(self) -> dict[str, float]:
        if self.rebalancer is None:
            return {}
        shares = {SHARE.format(r): s for r, s in enumerate(self.rebalancer.shares())}
        dropped = {DROPPED: float(self.dropped)} if self.deadline is not None else {}
        return {**shares, SAVED: self.rebalancer.seconds_saved, **dropped}

    def state_dict(self) -> dict[str, Any] | None:
        return None if self.rebalancer is None else self.rebalancer.state_dict()

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """A checkpoint's state, taken by the rebalancer the training loader's install makes (or has made)."""
        if state is None:
            return
        if self.rebalancer is not None and self.batches is not None:
            self.rebalancer.load_state_dict(state)
        else:
            self._saved = state
