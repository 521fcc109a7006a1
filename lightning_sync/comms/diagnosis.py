"""What the hang watchdog says: why a collective hung or failed (:func:`explain`), and where the ranks' collectives
paired up across different calls (:func:`mismatch`).

Both are pure functions of what the ranks recorded, so they are tested in one process;
:mod:`lightning_sync.comms.watchdog` gathers the records. A collective is named by its *signature*: op name,
payload size, and what tells calls apart without reading their data: dtype and shape of its tensor, the reduce op,
the root rank, and, for Lightning's ``sync_dist`` reductions, the logged key (:func:`describe`), e.g.
``all_reduce (4 B, float32[], avg, 'training_step.loss')``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CollectiveError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "Pending",
    "RankLost",
    "describe",
    "explain",
    "mismatch",
    "sequence_key",
    "signature",
    "size",
]


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the op, its sequence number and the culprits."""


class CollectiveTimeout(CollectiveError):
    """A collective did not complete within the watchdog's timeout (or another rank's watchdog aborted)."""


class RankLost(CollectiveError):
    """A collective failed because a peer rank is gone (its heartbeat stopped)."""


class CollectiveMismatch(CollectiveError):
    """Ranks issued different collectives that paired up without a hang (found by ``Watchdog.verify``)."""


def sequence_key(group: str, peer: int | None) -> str:
    """The name sequence numbers count under: the group's, or ``"<group>/p2p"`` for point-to-point ops."""
    return group if peer is None else f"{group}/p2p"


def size(nbytes: int) -> str:
    """``nbytes`` for a message: ``"4 B"``, ``"4.0 kB"``, ``"1.2 MB"``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def describe(op: str, nbytes: int, detail: str = "") -> str:
    """A collective's signature for a message: ``"all_reduce (12 B, float32[3], sum)"``, ``"barrier (0 B)"``."""
    return f"{op} ({size(nbytes)}{', ' + detail if detail else ''})"


def signature(like: Any, detail: str = "", label: str | None = None) -> str:
    """The ``detail`` of a call's signature for :func:`describe`: the dtype and shape of ``like`` (the tensor every
    rank passes alike, if any), the reduce op or root rank, and the logged key: ``"float32[], avg, 'loss'"``."""
    parts = [] if like is None else [f"{str(like.dtype).removeprefix('torch.')}{list(like.shape)}"]
    return ", ".join([*parts, *([detail] if detail else []), *([repr(label)] if label is not None else [])])


@dataclass
class Pending:
    """One issued collective as the watchdog tracks it (returned by ``Watchdog.issued``)."""

    op: str
    seq: int
    group: str
    ranks: list[int]
    nbytes: int
    peer: int | None = None  # point-to-point: the other rank (sequence numbers do not pair up)
    on_cpu: bool = False  # its tensors are in host memory (see lightning_sync.comms.waiting)
    detail: str = ""  # the rest of its signature (see describe)
    start: float = field(default_factory=time.monotonic)
    handles: list[Any] | None = None  # None while the backend call is still being launched

    @property
    def key(self) -> str:
        return sequence_key(self.group, self.peer)

    def label(self) -> str:
        where = f"with rank {self.peer}" if self.peer is not None else f"on {self.group}"
        return f"{self.op} #{self.seq} ({size(self.nbytes)}) {where}"

    def completed(self) -> bool:
        return self.handles is not None and all(h.is_completed() for h in self.handles)


def _minority_first(by_signature: Mapping[str, list[int]]) -> str:
    """``"<signature> on ranks [..]; ..."``, the smallest group first: with three or more ranks the odd one out is
    the culprit."""
    ranked = sorted(by_signature.items(), key=lambda kv: (len(kv[1]), kv[1]))
    return "; ".join(f"{signature} on ranks {ranks}" for signature, ranks in ranked)


def explain(
    p: Pending,
    what: str,
    rank: int,
    records: Mapping[int, dict[str, Any] | None],
    lost: Sequence[int],
    silent_for: float,
) -> str:
    """The diagnosis of ``p`` (pending on ``rank``) from its peers' published records.

    Per peer: lost (in ``lost``: no heartbeat for ``silent_for`` s), left (stopped its watchdog), never
    joined (its last sequence number on the group is below ``p.seq``), or issued something at ``p.seq``
    whose signature differs (different code paths; the ranks are grouped by what they issued, the
    smallest group first, since with three or more ranks the odd one out is the culprit). A record's
    ``hist`` holds its last few ``[seq, op, nbytes, detail]`` per sequence key.
    """
    key = p.key
    left, never, details = [], [], []
    sig_by_rank = {rank: describe(p.op, p.nbytes, p.detail)}
    for r in sorted(records):
        rec = records.get(r)
        where = (
            "never published a heartbeat"
            if rec is None
            else (f"waiting in {rec['waiting']}" if rec["waiting"] else "not in a collective")
        )
        if r in lost:
            details.append(f"rank {r}: no heartbeat for {silent_for:.1f} s; last seen {where}")
            continue
        details.append(
            f"rank {r} ({rec['host']} pid {rec['pid']}): last issued #{rec['last'].get(key, 0)} here, {where}"
        )
        if rec["state"] == "done":
            left.append(r)
        elif p.peer is not None:
            continue  # point-to-point: where the peer is (above) is the diagnosis
        elif rec["last"].get(key, 0) < p.seq:
            never.append(r)
        else:
            at = {h[0]: describe(*h[1:4]) for h in rec["hist"].get(key, [])}
            if p.seq in at:
                sig_by_rank[r] = at[p.seq]
    parts = []
    sigs: dict[str, list[int]] = {}
    for r, sig in sorted(sig_by_rank.items()):
        sigs.setdefault(sig, []).append(r)
    if len(sigs) > 1:
        parts.append(f"ranks took different code paths at #{p.seq}: {_minority_first(sigs)}")
    if never:
        parts.append(f"ranks {never} never joined")
    if left:
        parts.append(f"ranks {left} already left (stopped their watchdog)")
    if lost:
        parts.append(f"ranks {lost} lost")
    if not parts:
        parts.append("every peer issued it; the transport did not complete it")
    return f"{p.label()} {what}: " + "; ".join(parts) + "\n  " + "\n  ".join(details)


def mismatch(key: str, issued: Mapping[int, Sequence[Sequence[Any]]]) -> str:
    """Where the ranks' collectives on ``key`` stopped being the same calls, for ranks whose running hashes differ.

    ``issued[r]`` holds rank ``r``'s ``[seq, op, nbytes, detail, running hash]`` entries since the last
    sequence number all ranks agreed on (the oldest may have been dropped). At the first sequence number whose
    running hashes differ, the ranks are grouped by signature, the smallest group first. Where every kept
    signature there is the same, the calls that differed are older than the kept entries, and the message says so.
    """
    by_rank = {r: {e[0]: e for e in entries} for r, entries in issued.items()}
    for seq in sorted(set().union(*by_rank.values())):
        if len({m[seq][4] if seq in m else None for m in by_rank.values()}) == 1:
            continue
        sigs: dict[str, list[int]] = {}
        for r, m in sorted(by_rank.items()):
            sig = describe(*m[seq][1:4]) if seq in m else f"nothing (its last was #{max(m, default=seq - 1)})"
            sigs.setdefault(sig, []).append(r)
        if len(sigs) > 1:
            return (
                f"ranks issued different collectives on {key} at #{seq} that paired up: {_minority_first(sigs)} "
                f"(nothing hung, so the backend combined different tensors: every result since is suspect)"
            )
        return (
            f"ranks issued different collectives on {key} before #{seq} that paired up (the calls that differed "
            f"are older than the last {len(by_rank[min(by_rank)])} kept); nothing hung, so the backend combined "
            f"different tensors: every result since is suspect"
        )
    return f"ranks disagree on what was issued on {key}, but their kept collectives are the same"
