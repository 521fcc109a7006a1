"""Buddy copies of a ZeRO engine's shards: what lets its ranks keep training when one of them is lost.

A rank's shard of the parameters and of the optimizer state exists nowhere else, so a lost rank takes its slice of
the model with it. A :class:`BuddySnapshot` keeps, in host memory, this rank's own shards and those of one other
rank, which that rank sent it (its *buddy* holds them), all taken at the same step boundary. This is Gemini's
redundant in-memory copy (Wang et al., SOSP 2023): the buddy is the rank a fixed shift away in the membership,
chosen so that as many ranks as possible send to another node (:func:`buddy_shift`), which a lost node then
leaves recoverable.

After a loss the survivors rebuild the state of the snapshot's step for their new number of ranks
(:func:`relayout`), one collective per flat parameter and per-element optimizer state: each survivor contributes
the old slices it holds (its own, and the copy of a lost rank it holds), the sum of those zero-padded slices is the
full flat tensor, exactly (every element is one rank's value plus zeros), and each rank keeps its new slice. A
rank lost together with the rank that holds its copy cannot be rebuilt: :class:`ShardsLost` names both.

Nothing here imports Lightning: the strategy decides when to take a snapshot and when to go back to it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_sync.sync.communicator import Communicator
from lightning_sync.sync.flat import FlatLayout, FlatShard

if TYPE_CHECKING:
    from lightning_sync.sync.zero.engine import ZeroEngine

__all__ = [
    "BuddySnapshot",
    "FlatCopy",
    "PendingSnapshot",
    "ShardsLost",
    "buddy_shift",
    "contributors",
    "relayout",
    "take_snapshot",
]


class ShardsLost(Exception):
    """A lost rank's shards are nowhere: the rank that held its copy was lost too. Not a ``RuntimeError``, which the
    live membership takes for a lost member to train past: this ends the job."""


@dataclass
class FlatCopy:
    """One flat parameter's shard as one rank held it: the master values and the optimizer's state of them."""

    master: torch.Tensor
    #: optimizer states with one value per shard element (``exp_avg``, ``momentum_buffer``), sorted by name
    elementwise: dict[str, torch.Tensor] = field(default_factory=dict)
    #: the other optimizer states (``step``): the same on every rank, which steps its shard with the others
    scalars: dict[str, Any] = field(default_factory=dict)

    def tensors(self) -> list[torch.Tensor]:
        """What a buddy receives of it, in a fixed order."""
        return [self.master, *self.elementwise.values()]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _copies(engine: ZeroEngine) -> list[FlatCopy]:
    """This rank's shards now, copied to host memory."""
    out = []
    for f in engine.flats:
        optimizer = engine.optimizer_of(f)
        state = optimizer.state.get(f.master, {}) if optimizer is not None else {}
        per_element = {
            k: v.detach().to("cpu", copy=True)
            for k, v in sorted(state.items())
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == f.layout.shard_numel
        }
        scalars = {
            k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in state.items()
            if k not in per_element
        }
        out.append(FlatCopy(f.master.detach().to("cpu", copy=True), per_element, scalars))
    return out


def buddy_shift(nodes: Sequence[str]) -> int:
    """The shift ``s`` such that rank ``r`` sends its copy to rank ``(r + s) % K`` (``nodes``: each rank's node, in
    rank order): the one that sends the most copies to another node, the smallest of those; 0 for one rank. A shift
    makes every rank hold exactly one copy."""
    k = len(nodes)
    if k < 2:
        return 0
    return max(range(1, k), key=lambda s: (sum(nodes[r] != nodes[(r + s) % k] for r in range(k)), -s))


@dataclass
class BuddySnapshot:
    """The state of every rank's shards at one step, spread over the ranks (module docstring).

    ``members`` are the ranks of the epoch it was taken in, in rank order; this process was ``members[rank]``.
    It holds its own shards (``own``) and those of ``members[(rank - shift) % K]`` (``held``); every rank holds
    exactly one other rank's. ``extra`` is the strategy's own per-rank state taken with it (module buffers).
    """

    members: list[str]
    rank: int
    shift: int
    own: list[FlatCopy]
    held: list[FlatCopy] | None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def empty(cls, members: Sequence[str], shift: int) -> BuddySnapshot:
        """A snapshot's layout without its copies: what a rank that joined after it was taken knows of it."""
        return cls(list(members), -1, shift, [], None)

    def nbytes(self) -> int:
        """Host bytes it holds: the two copies of the shards (parameters and per-element optimizer state)."""
        return sum(c.nbytes() for c in self.own) + sum(c.nbytes() for c in self.held or [])


class PendingSnapshot:
    """A snapshot whose copies are on their way to the buddies: this rank's own copy is taken, the exchange is in
    flight (point to point, asynchronous) and :meth:`wait` completes it. Until then the training goes on; the copy
    a rank receives is what it holds of its buddy once :meth:`wait` returned on every rank."""

    def __init__(
        self,
        snapshot: BuddySnapshot,
        works: Sequence[Any] = (),
        layout: FlatLayout | None = None,
        sent: Sequence[torch.Tensor] = (),
        received: Sequence[torch.Tensor] = (),
    ) -> None:
        self.snapshot, self._works, self._layout = snapshot, list(works), layout
        self._sent, self._received = list(sent), list(received)  # the send buffers live until the sends complete

    def wait(self) -> BuddySnapshot:
        """Wait for this rank's send and receive (raises ``RuntimeError`` if a peer was lost meanwhile)."""
        for work in self._works:
            work.wait()
        if self._layout is not None:
            # the buddy's shards are as large as this rank's and its optimizer holds the same states: they unpack in
            # this rank's own layout, as views of the received buffers moved to the host
            views = iter(self._layout.views([buffer.to("cpu") for buffer in self._received]))
            own = self.snapshot.own
            self.snapshot.held = [FlatCopy(next(views), {k: next(views) for k in c.elementwise}) for c in own]
        self._works, self._layout, self._sent, self._received = [], None, [], []
        return self.snapshot


def take_snapshot(
    engine: ZeroEngine,
    comm: Communicator,
    members: Sequence[str],
    nodes: Sequence[str],
    host_group: dist.ProcessGroup | None = None,
) -> PendingSnapshot:
    """Copy this rank's shards to host memory and start exchanging copies with the buddies (every rank sends one and
    receives one, point to point); :meth:`PendingSnapshot.wait` completes it. The copies travel host to host over
    ``host_group`` (a gloo group of the same ranks, beside an NCCL one), else on the device ``comm`` runs on."""
    own = _copies(engine)
    k, rank = comm.world_size, comm.rank
    shift = buddy_shift(nodes)
    snapshot = BuddySnapshot(list(members), rank, shift, own, None)
    if k < 2:
        return PendingSnapshot(snapshot)
    on_host = host_group is not None or not engine.flats
    tensors = [t for c in own for t in c.tensors()]
    layout = FlatLayout(tensors, device=torch.device("cpu") if on_host else engine.flats[0].device)
    sent = layout.flatten(tensors)
    received = [torch.empty_like(buffer) for buffer in sent]
    works = []
    dst, src = _global(comm, (rank + shift) % k), _global(comm, (rank - shift) % k)
    for out, into in zip(
        sent, received
    ):  # every rank posts both before it waits for either: no pair waits on the other
        works.extend(_exchange(comm, out, dst, into, src, host_group))
    return PendingSnapshot(snapshot, works, layout, sent, received)


def _exchange(
    comm: Communicator,
    send: torch.Tensor,
    dst: int,
    receive: torch.Tensor,
    src: int,
    group: dist.ProcessGroup | None,
) -> list[Any]:
    """Send ``send`` to ``dst`` and receive ``receive`` from ``src`` (global ranks) on ``group`` (None: ``comm``'s),
    both in flight; the handles. NCCL runs a send and a receive with one peer (two ranks: ``dst == src``) on one
    stream, where each rank's send would wait for the other's receive queued behind its own: there they are posted
    as one batch."""
    group = group if group is not None else getattr(comm, "group", None)
    if dist.get_backend(group) == "nccl":
        ops = [dist.P2POp(dist.isend, send, dst, group), dist.P2POp(dist.irecv, receive, src, group)]
        return list(dist.batch_isend_irecv(ops))
    return [comm.send(send, dst, group=group, async_op=True), comm.recv(receive, src, group=group, async_op=True)]


def contributors(then: Sequence[str], shift: int, now: Sequence[str]) -> dict[int, str]:
    """Old rank -> the member of ``now`` that holds its shards: itself if it is still a member, else its buddy.
    Raises :class:`ShardsLost` naming a lost rank whose buddy was lost too."""
    k = len(then)
    out: dict[int, str] = {}
    for q, owner in enumerate(then):
        holder = then[(q + shift) % k] if shift else owner
        if owner in now:
            out[q] = owner
        elif holder in now and holder != owner:
            out[q] = holder
        else:
            raise ShardsLost(
                f"the shards of {owner} (rank {q} of {k} when they were last copied) are lost: {owner} was lost "
                f"and so was {holder}, which held their copy. A ZeRO job survives any loss that leaves every rank "
                f"or the rank holding its copy; this one ends here (resume from the newest checkpoint)"
            )
    return out


def relayout(engine: ZeroEngine, snapshot: BuddySnapshot, member: str, members: Sequence[str]) -> None:
    """Put the snapshot's state back into ``engine``, sharded over the current ranks ``members`` (``member`` is this
    process): a collective every current rank calls. A rank that holds nothing of it (a replacement, whose snapshot
    is :meth:`BuddySnapshot.empty`) contributes nothing and gets its slices. Nothing of the engine changes until every
    collective has completed, so a failure leaves it as it was."""
    comm = engine.comm
    contrib = contributors(snapshot.members, snapshot.shift, members)
    # every rank runs the same collectives: the states' names and the scalars come from the member holding old rank
    # 0's shards (its own copies have them all), which every rank can name
    meta = None
    if member == contrib[0]:
        meta = [([(k, v.dtype) for k, v in c.elementwise.items()], c.scalars) for c in snapshot.own]
    meta = comm.broadcast_object(meta, src=_global(comm, list(members).index(contrib[0])))
    mine: dict[int, list[FlatCopy]] = {}
    for q, who in contrib.items():
        if who == member:  # its own shards, or those of the lost rank whose copy it holds
            held = snapshot.own if q == snapshot.rank else snapshot.held
            assert held is not None
            mine[q] = held
    layouts, rebuilt = [], []
    for i, f in enumerate(engine.flats):
        old = FlatShard(f.layout.shapes, len(snapshot.members), 0)
        new = FlatShard(f.layout.shapes, comm.world_size, comm.rank)
        keys, scalars = meta[i]
        master = _whole(comm, {q: c[i].master for q, c in mine.items()}, old, new, f.master_dtype, f.device)
        states = {
            key: new.shard(_whole(comm, {q: c[i].elementwise[key] for q, c in mine.items()}, old, new, dtype, f.device))
            for key, dtype in keys
        }
        layouts.append(new)
        rebuilt.append((master, states, scalars))
    for f, new, (master, states, scalars) in zip(engine.flats, layouts, rebuilt):
        f.relayout(new, master)
        optimizer = engine.optimizer_of(f)
        if optimizer is None:
            continue
        where = f.master.device
        state = {k: v.to(where, copy=True) for k, v in states.items()}
        state.update({k: v.to(where) if isinstance(v, torch.Tensor) else v for k, v in scalars.items()})
        optimizer.state.pop(f.master, None)
        if state:
            optimizer.state[f.master] = state
    engine.abort()  # nothing in flight, no gradient: the next step starts afresh


def _whole(
    comm: Communicator,
    slices: dict[int, torch.Tensor],
    old: FlatShard,
    new: FlatShard,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The whole flat tensor, padded for ``new``, from the ``old`` rank -> slice pieces every rank holds (each old
    rank's held by exactly one): their zero-padded sum over the ranks, exact."""
    values = torch.zeros(old.padded, dtype=dtype, device=device)
    n = old.shard_numel
    for q, piece in slices.items():
        values[q * n : (q + 1) * n] = piece.to(device)
    comm.all_reduce(values, op="sum")
    padded = torch.zeros(new.padded, dtype=dtype, device=device)
    padded[: new.total] = values[: old.total]
    return padded


def _global(comm: Communicator, rank: int) -> int:
    """The global rank of ``comm``'s group rank ``rank`` (what point-to-point calls and a broadcast's source name)."""
    group = getattr(comm, "group", None)
    return rank if group is None else dist.get_global_rank(group, rank)
