"""One job's communication state: :class:`CommContext`.

A strategy owns one context. It holds everything that used to be process-wide, so two Trainers in one process
(one after another, or a Hydra multirun's jobs) share nothing:

* the process group its collectives default to;
* the sequence numbers of its calls (per group, point-to-point apart), which the hang watchdog matches across
  ranks;
* its call hooks (:mod:`lightning_sync.comms.hooks`), shown every call: the optional observer
  (:class:`~lightning_sync.comms.stats.CommStats`) that measures them, and the hang watchdog, once started;
* the node sub-groups of the hierarchical all-reduce;
* :class:`CommSettings`, the machine-dependent choices, as data.

The collectives themselves are the methods of :class:`~lightning_sync.comms.collectives.Collectives`,
:class:`~lightning_sync.comms.even.EvenCollectives` and :class:`~lightning_sync.comms.uneven.UnevenCollectives`;
every one of them goes through ``Collectives._issue``.
"""

from __future__ import annotations

import itertools
import json
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from lightning_sync.comms.bound import BoundContext
from lightning_sync.comms.hooks import CallHook, CountingHook
from lightning_sync.comms.payload import group_ranks
from lightning_sync.comms.topology import NodeGroups, resolve_ranks_per_node
from lightning_sync.comms.uneven import UnevenCollectives

if TYPE_CHECKING:
    from lightning_sync.comms.watchdog import Watchdog

__all__ = ["CommContext", "CommSettings"]

T = TypeVar("T")


@dataclass(frozen=True)
class CommSettings:
    """Machine-dependent choices of the collectives, as data with defaults that are correct anywhere.

    Every value only picks between equivalent ways to move the same bytes; none changes a result. Measure
    yours and store them with :meth:`save`; load them with :meth:`load`."""

    gloo_exchange_min_chunk_bytes: int = 0
    """On gloo, ``all_gather_into`` and ``reduce_scatter_into`` run as one round of pairwise sends and receives
    (:mod:`lightning_sync.comms.pairwise`) when each rank's chunk has at least this many bytes, and as gloo's own
    ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` below it. 0, always: the exchange measured faster at
    every size from 4 KiB to 32 MiB at K = 2, 3 and 4 (``docs/comms.md``, "gloo fast paths"); a huge number,
    never. NCCL ignores it."""

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


def _no_group() -> None:
    """What the sequence numbers count on when no default group exists (a weak reference's ``None``)."""


class CommContext(UnevenCollectives):
    """The communication state of one job; its methods are the collectives (see the module docstring).

    Args:
        group: the process group a collective uses when it is given none (None: the default group).
        observer: the call hook that measures every call (e.g. a :class:`~lightning_sync.comms.stats.CommStats`);
            None measures nothing and costs nothing. More hooks: :meth:`add_hook`.
        settings: the machine-dependent choices (:class:`CommSettings`).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        observer: CallHook | None = None,
        settings: CommSettings | None = None,
    ) -> None:
        self.group = group
        self.settings = settings or CommSettings()
        self._hooks: tuple[CallHook, ...] = ()  # replaced, never changed in place: a call keeps the ones it saw
        self._hook_waits = False
        self._counter: CountingHook | None = None
        self._observer: CallHook | None = None
        self._watchdog: Watchdog | None = None
        self.observer = observer
        self._seq: dict[str, Iterator[int]] = {}
        self._seq_world: Any = None  # a weak reference to the default process group the sequence numbers count on
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
        """Start a job from clean state: what every hook keeps (statistics, calls in flight included; the
        watchdog's records), sequence numbers, and node groups (destroyed). Every rank calls it alike when a fit
        starts; a collective of the previous job still in flight must be waited for first."""
        for hook in self._hooks:
            hook.begin_job()
        self._seq.clear()
        self.release_node_groups()

    def close(self) -> None:
        """Stop the watchdog (a clean leave) and destroy the node groups; local, not collective."""
        self.stop_watchdog(clean=True)
        self.release_node_groups()

    # ------------------------------------------------------------------ call hooks
    @property
    def hooks(self) -> tuple[CallHook, ...]:
        """The call hooks every collective of this context is shown (:mod:`lightning_sync.comms.hooks`), the one
        that waits for backend requests (the hang watchdog) first, so that it may refuse a call before the others
        count it."""
        return self._hooks

    def add_hook(self, hook: CallHook) -> CallHook:
        """Show every later call to ``hook`` too; returns it. At most one hook may wait for backend requests."""
        if not isinstance(hook, CallHook):
            raise ValueError(f"a call hook must be a lightning_sync.comms.hooks.CallHook, got {hook!r}")
        if any(h is hook for h in self._hooks):
            raise ValueError(f"{hook!r} is already a hook of this context")
        if hook.waits and self._hook_waits:
            raise ValueError(f"{hook!r} waits for backend requests, and so does another hook of this context")
        self._set_hooks((hook, *self._hooks) if hook.waits else (*self._hooks, hook))
        return hook

    def remove_hook(self, hook: CallHook) -> None:
        """Stop showing calls to ``hook`` (calls already issued still tell it how they end)."""
        if not any(h is hook for h in self._hooks):
            raise ValueError(f"{hook!r} is not a hook of this context; its hooks: {list(self._hooks)}")
        self._set_hooks(tuple(h for h in self._hooks if h is not hook))

    def _set_hooks(self, hooks: tuple[CallHook, ...]) -> None:
        self._counter = None  # first: a call issued meanwhile shows itself to the hooks through a Call
        self._hooks = hooks
        self._hook_waits = any(h.waits for h in hooks)
        if len(hooks) == 1 and isinstance(hooks[0], CountingHook):
            self._counter = hooks[0]  # the only hook counts: told of synchronous calls directly

    @property
    def observer(self) -> CallHook | None:
        """The hook that measures this context's calls (a strategy's default: a
        :class:`~lightning_sync.comms.stats.CommStats`), or None; assigning replaces it among the hooks."""
        return self._observer

    @observer.setter
    def observer(self, observer: CallHook | None) -> None:
        if observer is self._observer:
            return
        if observer is not None:
            self.add_hook(observer)
        old, self._observer = self._observer, observer
        if old is not None:
            self.remove_hook(old)

    def record(self, op: str, nbytes: int, seconds: float = 0.0, calls: int = 1) -> None:
        """Tell every hook of ``calls`` entries of ``op`` that are not backend calls (a codec's arithmetic, a
        written-out algorithm's own entry, a remote call): ``nbytes`` counted, ``seconds`` of local work."""
        for hook in self._hooks:
            hook.record(op, nbytes, seconds, calls)

    # ------------------------------------------------------------------ hang watchdog
    @property
    def watchdog(self) -> Watchdog | None:
        """The running hang watchdog (:meth:`start_watchdog`), one of the hooks, or None."""
        return self._watchdog

    def start_watchdog(
        self, timeout: float, interval: float | None = None, exit_after: float | None = None
    ) -> Watchdog:
        """Start this context's hang watchdog (stopping a running one first); every rank starts its watchdogs
        alike, as it issues collectives: the n-th of each rank share a namespace in the rendezvous store."""
        from lightning_sync.comms.watchdog import Watchdog

        self.stop_watchdog(clean=True)
        wd = Watchdog(timeout, interval=interval, exit_after=exit_after)
        self.add_hook(wd)
        wd.start()
        self._watchdog = wd
        return wd

    def stop_watchdog(self, clean: bool = True) -> None:
        """Stop the watchdog, if one runs; ``clean`` tells the peers this rank left on purpose."""
        wd, self._watchdog = self._watchdog, None
        if wd is not None:
            self.remove_hook(wd)
            wd.stop(clean=clean)

    def verify(self) -> None:
        """Check that every rank issued the same collectives so far (collective over the default group); nothing
        without a running watchdog."""
        if self._watchdog is not None:
            self._watchdog.verify(self)

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

    def _next_seq(
        self, group: dist.ProcessGroup | None, peer: int | None, world: dist.ProcessGroup | None = None
    ) -> tuple[int, str]:
        """The next sequence number of a call on ``group`` (point-to-point apart: ``peer``) and the group's name;
        ``world``: the default group, when the caller has read it already."""
        if world is None:
            world = dist.group.WORLD
        if self._seq_world is None or world is not self._seq_world():  # a new default group: count from 1
            self._seq.clear()
            # weakly: a destroyed group must not stay alive through its counters (its sockets would stay open,
            # and a peer blocked in a collective with this process would wait out the group's timeout)
            self._seq_world = weakref.ref(world) if world is not None else _no_group
        name = "world" if group is None or group is world else f"group {group_ranks(group)}"
        key = name if peer is None else f"{name}/p2p"
        counter = self._seq.get(key)
        if counter is None:  # dict.setdefault and next() are atomic under the GIL: no lock
            counter = self._seq.setdefault(key, itertools.count(1))
        return next(counter), name
