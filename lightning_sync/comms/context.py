"""One job's communication state: :class:`CommContext`.

A strategy owns one context. It holds everything that used to be process-wide, so two Trainers in one process
(one after another, or a Hydra multirun's jobs) share nothing:

* the process group its collectives default to;
* the sequence numbers of its calls (per group, point-to-point apart), which the hang watchdog matches across
  ranks;
* an optional observer (:class:`~lightning_sync.comms.stats.CommStats`) that measures every call;
* its hang watchdog, once started;
* the node sub-groups of the hierarchical all-reduce;
* :class:`CommSettings`, the machine-dependent choices, as data.

The collectives themselves are the methods of :class:`~lightning_sync.comms.collectives.Collectives` and
:class:`~lightning_sync.comms.uneven.UnevenCollectives`; every one of them goes through ``Collectives._issue``.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from lightning_sync.comms.bound import BoundContext
from lightning_sync.comms.payload import group_ranks
from lightning_sync.comms.topology import NodeGroups, resolve_ranks_per_node
from lightning_sync.comms.uneven import UnevenCollectives
from lightning_sync.comms.work import Observer

if TYPE_CHECKING:
    from lightning_sync.comms.watchdog import Watchdog

__all__ = ["CommContext", "CommSettings"]

T = TypeVar("T")


@dataclass(frozen=True)
class CommSettings:
    """Machine-dependent choices of the collectives, as data with defaults that are correct anywhere.

    Every value only picks between equivalent ways to move the same bytes; none changes a result. Measure
    yours and store them with :meth:`save`; load them with :meth:`load`."""

    scratch_reduces_min_chunk_bytes: int = 2 * 2**20
    """On gloo, ``reduce_scatter_into(..., scratch=True)`` issues K reduces, one to each chunk's owner, when each
    rank's chunk has at least this many bytes, and gloo's own ``reduce_scatter_tensor`` below it. K reduces
    measured 1.5x faster than gloo's op at 32 MiB on 2 ranks (2.4x on 3); each costs several latency-bound steps,
    so below about 1-8 MiB (by world size) gloo's single op wins. Set it to 0 for always, or a huge number for
    never; NCCL ignores it."""

    def save(self, path: str | Path) -> None:
        """Write these settings as JSON."""
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CommSettings:
        """Read settings written by :meth:`save`; an unknown key or a wrong type is refused, naming it."""
        data = json.loads(Path(path).read_text())
        known = {f.name: f.type for f in fields(cls)}
        if not isinstance(data, dict) or set(data) - set(known):
            extra = sorted(set(data) - set(known)) if isinstance(data, dict) else data
            raise ValueError(f"{path}: unknown communication settings {extra!r}; allowed: {sorted(known)}")
        for key, value in data.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{path}: {key} must be an int >= 0, got {value!r}")
        return cls(**data)


class CommContext(UnevenCollectives):
    """The communication state of one job; its methods are the collectives (see the module docstring).

    Args:
        group: the process group a collective uses when it is given none (None: the default group).
        observer: measures every call (e.g. a :class:`~lightning_sync.comms.stats.CommStats`); None measures
            nothing and costs nothing.
        settings: the machine-dependent choices (:class:`CommSettings`).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        observer: Observer | None = None,
        settings: CommSettings | None = None,
    ) -> None:
        self.group = group
        self.observer = observer
        self.settings = settings or CommSettings()
        self.watchdog: Watchdog | None = None
        self._seq: dict[str, Iterator[int]] = {}
        self._seq_world: Any = None  # the default process group the sequence numbers belong to
        # op-name prefixes of the scopes each thread is in, by thread id (see scope()); empty, it costs one test
        self._scopes: dict[int, tuple[str, ...]] = {}
        self._node_groups: dict[int, NodeGroups] = {}

    # ------------------------------------------------------------------ as a lightning_sync.sync Communicator
    @property
    def rank(self) -> int:
        """This process's rank in the context's group (a context is a ``sync`` Communicator as it is)."""
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        """The number of ranks in the context's group."""
        return dist.get_world_size(self.group)

    def bound(
        self,
        group: dist.ProcessGroup | None = None,
        algorithm: str = "backend",
        ranks_per_node: int | None = None,
    ) -> BoundContext:
        """A view of this context whose collectives default to ``group`` and whose ``all_reduce`` runs
        ``algorithm`` (:class:`~lightning_sync.comms.bound.BoundContext`); its calls are this context's.
        ``"hierarchical"`` builds its node groups now, collectively."""
        return BoundContext(self, group=group, algorithm=algorithm, ranks_per_node=ranks_per_node)

    # ------------------------------------------------------------------ job lifecycle
    def begin_job(self) -> None:
        """Start a job from clean state: statistics (calls in flight included), sequence numbers, the watchdog's
        records, and node groups (destroyed). Every rank calls it alike when a fit starts; a collective of the
        previous job still in flight must be waited for first."""
        if self.observer is not None:
            self.observer.reset(in_flight=True)
        self._seq.clear()
        if self.watchdog is not None:
            self.watchdog.forget()
        self.release_node_groups()

    def close(self) -> None:
        """Stop the watchdog (a clean leave) and destroy the node groups; local, not collective."""
        self.stop_watchdog(clean=True)
        self.release_node_groups()

    # ------------------------------------------------------------------ hang watchdog
    def start_watchdog(
        self, timeout: float, interval: float | None = None, exit_after: float | None = None
    ) -> Watchdog:
        """Start this context's hang watchdog (stopping a running one first); every rank starts its watchdogs
        alike, as it issues collectives: the n-th of each rank share a namespace in the rendezvous store."""
        from lightning_sync.comms.watchdog import Watchdog

        self.stop_watchdog(clean=True)
        self.watchdog = Watchdog(timeout, interval=interval, exit_after=exit_after)
        self.watchdog.start()
        return self.watchdog

    def stop_watchdog(self, clean: bool = True) -> None:
        """Stop the watchdog, if one runs; ``clean`` tells the peers this rank left on purpose."""
        wd, self.watchdog = self.watchdog, None
        if wd is not None:
            wd.stop(clean=clean)

    def verify(self) -> None:
        """Check that every rank issued the same collectives so far (collective over the default group); nothing
        without a running watchdog."""
        if self.watchdog is not None:
            self.watchdog.verify(self)

    # ------------------------------------------------------------------ hierarchical all-reduce's sub-groups
    def node_groups(self, ranks_per_node: int | None = None) -> NodeGroups:
        """The node and leader sub-groups for ``ranks_per_node`` (built once, collectively, on first use)."""
        ranks_per_node = resolve_ranks_per_node(ranks_per_node)
        if ranks_per_node not in self._node_groups or self._node_groups[ranks_per_node].world is not dist.group.WORLD:
            self._node_groups[ranks_per_node] = NodeGroups(ranks_per_node)
        return self._node_groups[ranks_per_node]

    def release_node_groups(self) -> int:
        """Destroy the node sub-groups this context built and forget them (local); returns how many layouts."""
        n = len(self._node_groups)
        for groups in self._node_groups.values():
            groups.destroy()
        self._node_groups.clear()
        return n

    # ------------------------------------------------------------------ naming and issuing calls
    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Record every op this thread issues inside the block as ``"<name>/<op>"`` (scopes nest).

        Algorithms use it to split their traffic without counting a byte twice, e.g. hierarchical all-reduce's
        ``intra_node/reduce`` against ``inter_node/all_reduce``."""
        if not name or "/" in name:
            raise ValueError(f"scope name must be a non-empty string without '/', got {name!r}")
        thread = threading.get_ident()
        stack = self._scopes.get(thread, ())
        self._scopes[thread] = (*stack, name)
        try:
            yield
        finally:
            if stack:
                self._scopes[thread] = stack
            else:
                del self._scopes[thread]

    def _next_seq(self, group: dist.ProcessGroup | None, peer: int | None) -> tuple[int, str]:
        world = dist.group.WORLD
        if world is not self._seq_world:  # a new default group: count from 1
            self._seq.clear()
            self._seq_world = world
        name = "world" if group is None or group is world else f"group {group_ranks(group)}"
        key = name if peer is None else f"{name}/p2p"
        counter = self._seq.get(key)
        if counter is None:  # dict.setdefault and next() are atomic under the GIL: no lock
            counter = self._seq.setdefault(key, itertools.count(1))
        return next(counter), name
