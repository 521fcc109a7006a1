"""Re-splitting each global batch by measured speed: the decision, without Lightning or a process group.

In synchronous data parallelism every step waits for the slowest rank, so one rank at half speed halves the job.
Giving each rank a share of the global batch in proportion to its speed keeps the step synchronous and its result
exact (the global batch and its gradient mean are unchanged, :mod:`lightning_sync.shares`), and lets every rank
finish its share at about the same time.

Every window of optimizer steps each rank reports the seconds it spent computing (forward and backward, its waits
in collectives taken out) and the samples it computed; the ranks gather these, and each runs :meth:`Rebalancer.update`
on the same numbers, so all reach the same split without another message:

* **speed**: samples per second of each rank over the window, smoothed, ``s <- (1 - smoothing) s + smoothing x
  speed``: a noisy window moves it only part of the way;
* **target**: a micro-batch of M samples split in proportion to the speeds, whole samples, at least one each and
  none more than :data:`MOST` (1.5) times its even share (:func:`proportional`): a rank given more samples needs
  more activation memory, and a slow rank whose time is mostly a step's fixed costs would otherwise hand the
  others all but one sample;
* **dead band**: the split moves only when the target's predicted compute time per micro-batch, ``max_r n_r /
  s_r``, is below the current split's by more than ``tolerance`` of it: equal speeds, measured with noise, leave it
  put.

A rank's compute time is not exactly proportional to its samples (a step has fixed costs), so the speeds measured
at one split are slightly off at the next. Iterated, the update's fixed point is the split at which every rank's
compute time per micro-batch is the same, which is the fastest a synchronous step can be.

The seconds saved are estimated from the same model: per micro-batch, the predicted time of the even split minus
that of the split in use, with the speeds as they are measured.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MOST", "Rebalancer", "proportional"]

#: the largest share of a micro-batch one rank may get, as a multiple of its even share: the activation memory a rank
#: was sized for grows by half at most, however much faster it is than the others
MOST = 1.5


def proportional(weights: Sequence[float], total: int, cap: int | None = None) -> list[int]:
    """``total`` whole samples in proportion to ``weights`` (largest remainder; ties to the lower rank), none above
    ``cap`` (what a capped rank would get beyond it goes to the others, in proportion), and at least one each where
    ``total`` allows it (a rank with no sample would run no backward, and its collectives none)."""
    whole = sum(weights)
    if not weights or whole <= 0 or any(w < 0 for w in weights):
        raise ValueError(f"weights must be non-negative with a positive sum, got {list(weights)}")
    if cap is not None and cap * len(weights) < total:
        raise ValueError(f"{len(weights)} ranks of at most {cap} samples cannot take {total}")
    exact = [w * total / whole for w in weights]
    capped: set[int] = set()
    while cap is not None and (over := {r for r, x in enumerate(exact) if x > cap} - capped):
        capped |= over
        free = [r for r in range(len(weights)) if r not in capped]
        rest, share = total - cap * len(capped), sum(weights[r] for r in free)
        exact = [
            cap if r in capped else rest * (weights[r] / share if share else 1 / len(free)) for r in range(len(exact))
        ]
    counts = [int(x) for x in exact]
    for r in sorted(range(len(exact)), key=lambda r: (counts[r] - exact[r], r))[: total - sum(counts)]:
        counts[r] += 1
    while min(counts) < 1 <= total // len(counts):  # the largest gives one to a rank left without any
        counts[counts.index(max(counts))] -= 1
        counts[counts.index(0)] += 1
    return counts


class Rebalancer:
    """The split of a micro-batch of ``micro`` samples over ``world`` ranks, moved by measured speed.

    Args:
        world: the number of ranks.
        micro: the samples of one whole micro-batch (per-rank batch x ``world``).
        smoothing: the weight of a new window's speed against the smoothed one (0 < smoothing <= 1).
        tolerance: the fraction of the current split's predicted time the target must save to be taken (>= 0).

    Attributes:
        counts: each rank's samples of a whole micro-batch (they sum to ``micro``; even at first).
        speeds: each rank's smoothed samples per second (None before the first window).
        seconds_saved: the estimated compute seconds saved so far against the even split.
        moves: how many times the split moved.
    """

    def __init__(self, world: int, micro: int, smoothing: float = 0.5, tolerance: float = 0.05) -> None:
        if not isinstance(world, int) or world < 1 or not isinstance(micro, int) or micro < world:
            raise ValueError(f"need 1 <= world <= micro, got world={world!r}, micro={micro!r}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        if not tolerance >= 0:
            raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")
        self.world, self.micro, self.smoothing, self.tolerance = world, micro, smoothing, tolerance
        #: the most samples one rank may get: 1.5 x its even share, so that its activation memory grows by half at most
        self.cap = int(MOST * micro / world)
        self.counts: list[int] = self.even()
        self.speeds: list[float] | None = None
        self.seconds_saved = 0.0
        self.moves = 0

    def even(self) -> list[int]:
        """The even split: what a plain run's strided shares give each rank."""
        return [len(range(r, self.micro, self.world)) for r in range(self.world)]

    def predicted(self, counts: Sequence[int]) -> float:
        """Seconds of compute per micro-batch with ``counts``, at the smoothed speeds: the slowest rank's."""
        assert self.speeds is not None
        return max(n / s for n, s in zip(counts, self.speeds))

    def update(self, seconds: Sequence[float], samples: Sequence[int]) -> bool:
        """Take one window's measurement (each rank's compute seconds and samples computed) and move the split if the
        target is worth it; returns whether it moved. A window in which some rank measured nothing is skipped."""
        if len(seconds) != self.world or len(samples) != self.world:
            raise ValueError(f"need one measurement per rank ({self.world}), got {len(seconds)} and {len(samples)}")
        if min(seconds) <= 0 or min(samples) <= 0:
            return False
        speeds = [n / t for n, t in zip(samples, seconds)]
        a = self.smoothing
        self.speeds = speeds if self.speeds is None else [(1 - a) * s + a * x for s, x in zip(self.speeds, speeds)]
        micro_batches = sum(samples) / self.micro
        self.seconds_saved += micro_batches * max(0.0, self.predicted(self.even()) - self.predicted(self.counts))
        target = proportional(self.speeds, self.micro, cap=self.cap)
        now, then = self.predicted(self.counts), self.predicted(target)
        if target == self.counts or then >= now * (1 - self.tolerance):
            return False
        self.counts = target
        self.moves += 1
        return True

    def shares(self) -> list[float]:
        """Each rank's fraction of a micro-batch."""
        return [n / self.micro for n in self.counts]

    def state_dict(self) -> dict[str, Any]:
        return {
            "world": self.world,
            "micro": self.micro,
            "counts": list(self.counts),
            "speeds": None if self.speeds is None else list(self.speeds),
            "seconds_saved": self.seconds_saved,
            "moves": self.moves,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> bool:
        """Continue from ``state`` when it was saved for this world and micro-batch (returns True); otherwise keep
        the even split and return False (a resume at another world size measures afresh)."""
        if (state.get("world"), state.get("micro")) != (self.world, self.micro):
            return False
        counts, speeds = state.get("counts"), state.get("speeds")
        if (
            not isinstance(counts, list)
            or len(counts) != self.world
            or sum(counts) != self.micro
            or any(not isinstance(n, int) or not 1 <= n <= self.cap for n in counts)
        ):
            raise ValueError(
                f"a rebalancing state's counts must be {self.world} ints in 1..{self.cap} summing to {self.micro}"
            )
        if speeds is not None and (len(speeds) != self.world or any(not float(s) > 0 for s in speeds)):
            raise ValueError(f"a rebalancing state's speeds must be {self.world} positive numbers, got {speeds!r}")
        self.counts = list(counts)
        self.speeds = None if speeds is None else [float(s) for s in speeds]
        self.seconds_saved = float(state.get("seconds_saved", 0.0))
        self.moves = int(state.get("moves", 0))
        return True
