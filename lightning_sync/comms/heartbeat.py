"""The hang watchdog's side channel: each rank's record in the job's rendezvous store, written and read without a
collective (a hung group could not carry one).

Every rank's watchdog thread publishes a small JSON record (:class:`Heartbeats`) every ``interval`` seconds: a
heartbeat counter, the last sequence number it issued on each group with the last few ops, and the collective it
is waiting in. Diagnosis reads the records of the group's ranks twice, ``2 * interval`` apart
(:meth:`Heartbeats.survey`): a rank whose counter did not move is lost. Nothing is parsed from logs. The store
also carries the first abort a rank posts, which every other rank's watchdog picks up.

The records go through a separate TCPStore client connected to the default process group's store, so they never
queue behind a blocking store call of the main thread; the store sees one small write per rank per ``interval``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["Heartbeats"]


class Heartbeats:
    """This rank's side channel to its peers' watchdogs: the records (``hb/<rank>``) and the abort key.

    Args:
        rank: this process's global rank.
        world_size: the default group's size (the namespace of this watchdog is shared with the peers' n-th).
        interval: the publishing period in seconds, which :meth:`survey` waits twice for.
        record: this rank's record now, given its state (``"running"``; ``"done"`` once it left on purpose).
    """

    def __init__(self, rank: int, world_size: int, interval: float, record: Callable[[str], dict[str, Any]]) -> None:
        self.rank, self.interval, self._record = rank, interval, record
        self._store, self.address, self.generation = _client_store(world_size)

    def publish(self, state: str = "running") -> None:
        """Write this rank's record."""
        self._store.set(f"hb/{self.rank}", json.dumps(self._record(state)))

    def read(self, ranks: Sequence[int]) -> dict[int, dict[str, Any] | None]:
        """The records of ``ranks`` as last published (None: never published)."""
        out: dict[int, dict[str, Any] | None] = {}
        for r in ranks:
            key = f"hb/{r}"
            out[r] = json.loads(self._store.get(key)) if self._store.check([key]) else None
        return out

    def survey(self, ranks: Sequence[int]) -> tuple[dict[int, dict[str, Any] | None], list[int]]:
        """The ranks' records, read twice ``2 * interval`` apart, and the lost ones: no record, or a
        running rank whose heartbeat did not move (every live rank publishes at least once meanwhile)."""
        first = self.read(ranks)
        self._pause(2 * self.interval + 0.1)
        now = self.read(ranks)
        lost = [
            r
            for r in ranks
            if now[r] is None
            or (now[r]["state"] == "running" and first[r] is not None and now[r]["beat"] == first[r]["beat"])
        ]
        return now, lost

    def _pause(self, seconds: float) -> None:
        """Sleep, still publishing this rank's record (peers may be surveying at the same time)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, self.interval / 2))
            self.publish()

    def post_abort(self, kind: str, message: str) -> None:
        """Post this rank's abort, unless another rank posted first (everyone raises the first message)."""
        self._store.compare_set("abort", "", json.dumps({"rank": self.rank, "kind": kind, "message": message}))

    def posted_abort(self) -> dict[str, Any] | None:
        """The abort a rank posted (``rank``, ``kind``, ``message``), or None."""
        return json.loads(self._store.get("abort")) if self._store.check(["abort"]) else None

    def lost(self, err: BaseException) -> str:
        """What to say when the store cannot be reached: its host is gone."""
        return (
            f"the rendezvous store at {self.address} is unreachable ({err}): its host (under Lightning: "
            f"global rank 0) is lost"
        )


def _client_store(world_size: int) -> tuple[dist.Store, str, int]:
    """A store client of our own, its address, and the generation whose namespace it writes in.

    The generation counts the watchdogs started on this store, not in this process: each rank adds one to a
    counter in the store, and every rank starts its n-th watchdog before any rank starts its (n+1)-th
    (collectives run in between), so the n-th of every rank share a namespace whatever each process ran before
    (a multirun's rank 0 keeps its process from job to job, the relaunched ranks do not), and a later job on the
    same store never reads an earlier one's records."""
    base = dist.distributed_c10d._get_default_store()
    under = base
    while isinstance(under, dist.PrefixStore):
        under = under.underlying_store
    if isinstance(under, dist.TCPStore):
        store: dist.Store = dist.TCPStore(
            under.host, under.port, is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False
        )
        address = f"{under.host}:{under.port}"
    else:  # a FileStore or HashStore: share the default one
        store, address = base, type(under).__name__
    generation = (store.add("lightning_sync/watchdog/started", 1) - 1) // world_size + 1
    return dist.PrefixStore(f"lightning_sync/watchdog/{generation}", store), address, generation
