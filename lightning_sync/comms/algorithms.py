"""Collective algorithms built from point-to-point ``send``/``recv``: ring and binary tree.

These exist so that the algorithm behind an all-reduce is visible, selectable and measurable
rather than hidden inside the backend. Every message goes through
:meth:`CommContext.send <lightning_sync.comms.context.CommContext.send>` / ``recv``, so an observer counts the exact
wire bytes under ``send`` and ``recv``; the algorithm's own entry (``ring_all_reduce``, ...) counts
calls and seconds with 0 bytes, so no byte is counted twice.

* **Ring reduce-scatter** (Patarasuk & Yuan 2009): the flat tensor is cut into K chunks of
  ``c = ceil(n/K)`` elements (zero-padded). In step s = 0..K-2 rank r sends chunk ``(r-s-1) mod K``
  to rank r+1 and adds the chunk ``(r-s-2) mod K`` it receives from rank r-1. After K-1 steps rank
  r holds the fully reduced chunk r. Each rank sends ``(K-1) * c`` elements.
* **Ring all-gather**: rank r starts with chunk r; in step s it forwards chunk ``(r-s) mod K`` and
  receives chunk ``(r-s-1) mod K``. Each rank sends ``(K-1) * c`` elements.
* **Ring all-reduce** = reduce-scatter then all-gather: ``2(K-1)/K * S`` bytes per rank, which
  :func:`~lightning_sync.bench.formulas.ring_allreduce_bytes` and the cost model
  ``T_ring = 2(K-1)*alpha + 2(K-1)*S/(K*BW)`` (:func:`~lightning_sync.bench.formulas.ring_allreduce_time`)
  describe.
* **Tree all-reduce**: reduce up a binary tree (children of r are 2r+1, 2r+2) to rank 0, then
  broadcast back down: ``2*ceil(log2 K)`` latency steps, each moving the whole tensor
  (:func:`~lightning_sync.bench.formulas.tree_allreduce_time`). Better than the ring for small,
  latency-bound messages.
* **Hierarchical all-reduce** (multi-node): reduce within each node to its leader (local rank 0),
  all-reduce among the node leaders, broadcast within each node. Only the leaders' step crosses
  nodes: with N nodes of L ranks, the inter-node traffic is one all-reduce among N ranks instead of
  among N*L. Ranks are laid out node by node (global rank = node * L + local rank, as Lightning and
  SLURM number them); the sub-groups come from
  :class:`~lightning_sync.comms.topology.NodeGroups`, which the context holds. Its traffic is recorded under
  ``intra_node/reduce``, ``inter_node/all_reduce`` and ``intra_node/broadcast``
  (:meth:`~lightning_sync.comms.context.CommContext.scope`), so intra- and inter-node bytes are separate.

All ranks in ``group`` must call the same function with tensors of the same shape and dtype.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from lightning_sync.comms import payload as P

if TYPE_CHECKING:
    from lightning_sync.comms.topology import NodeGroups

__all__ = [
    "ALGORITHMS",
    "AlgorithmContext",
    "all_reduce_with",
    "hierarchical_all_reduce",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "tree_all_reduce",
]


class AlgorithmContext(Protocol):
    """What an algorithm uses of its :class:`~lightning_sync.comms.context.CommContext` (which satisfies this as it
    is): the calls it builds on, where its own entry is recorded, the scopes that name its steps, and the node
    groups the context holds. Named here as a protocol so that this module does not import the context."""

    def record(self, op: str, nbytes: int, seconds: float = 0.0, calls: int = 1) -> None: ...

    def send(
        self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any: ...

    def recv(
        self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any: ...

    def reduce(
        self,
        tensor: torch.Tensor,
        dst: int,
        op: str = "sum",
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any: ...

    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any: ...

    def broadcast(
        self, value: Any, src: int = 0, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any: ...

    def scope(self, name: str) -> AbstractContextManager[None]: ...

    def node_groups(self, ranks_per_node: int | None = None) -> NodeGroups: ...


_COMBINE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sum": torch.Tensor.add_,
    "avg": torch.Tensor.add_,
    "max": lambda a, b: torch.maximum(a, b, out=a),
    "min": lambda a, b: torch.minimum(a, b, out=a),
}


def _combine(op: str, tensor: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    P.check_reduce(op, tensor)  # same allowed ops and dtype rules as the backend path
    return _COMBINE[op]


def _exchange(
    ctx: AlgorithmContext,
    send_buf: torch.Tensor,
    dst: int,
    recv_buf: torch.Tensor,
    src: int,
    group: dist.ProcessGroup | None,
) -> None:
    """Send to ``dst`` and receive from ``src`` at the same time (no ordering deadlock)."""
    works = [ctx.send(send_buf, dst, group=group, async_op=True), ctx.recv(recv_buf, src, group=group, async_op=True)]
    for w in works:
        w.wait()


def _account(ctx: AlgorithmContext, op: str, start: float) -> None:
    ctx.record(op, 0, time.perf_counter() - start)  # the algorithm's own entry: its bytes are in send/recv


def _ring_setup(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[list[int], int, int, int]:
    ranks = P.group_ranks(group)
    world = len(ranks)
    me = ranks.index(P.get_rank())
    chunk = -(-tensor.numel() // world)
    return ranks, world, me, chunk


def _chunks(tensor: torch.Tensor, world: int, chunk: int) -> torch.Tensor:
    flat = tensor.new_zeros(world * chunk)
    flat[: tensor.numel()] = tensor.reshape(-1)
    return flat.view(world, chunk)


def _reduce_scatter_steps(
    ctx: AlgorithmContext, buf: torch.Tensor, ranks: list[int], me: int, op: str, group: dist.ProcessGroup | None
) -> None:
    world, combine = len(ranks), _COMBINE[op]
    nxt, prv = ranks[(me + 1) % world], ranks[(me - 1) % world]
    incoming = torch.empty_like(buf[0])
    for s in range(world - 1):
        _exchange(ctx, buf[(me - s - 1) % world], nxt, incoming, prv, group)
        combine(buf[(me - s - 2) % world], incoming)


def _all_gather_steps(
    ctx: AlgorithmContext, buf: torch.Tensor, ranks: list[int], me: int, group: dist.ProcessGroup | None
) -> None:
    world = len(ranks)
    nxt, prv = ranks[(me + 1) % world], ranks[(me - 1) % world]
    for s in range(world - 1):
        _exchange(ctx, buf[(me - s) % world], nxt, buf[(me - s - 1) % world], prv, group)


def ring_reduce_scatter(
    ctx: AlgorithmContext, tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Ring reduce-scatter of the flattened ``tensor``; returns this rank's chunk (``ceil(n/K)``
    elements, trimmed of padding at the end)."""
    _combine(op, tensor)
    start = time.perf_counter()
    ranks, world, me, chunk = _ring_setup(tensor, group)
    buf = _chunks(tensor, world, chunk)
    _reduce_scatter_steps(ctx, buf, ranks, me, op, group)
    mine = buf[me].clone()
    if op == "avg":
        mine /= world
    keep = max(0, min(tensor.numel(), (me + 1) * chunk) - me * chunk)
    _account(ctx, "ring_reduce_scatter", start)
    return mine[:keep]


def ring_all_gather(ctx: AlgorithmContext, shard: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Ring all-gather of equal-sized flat shards; returns a ``(K, shard.numel())`` tensor."""
    start = time.perf_counter()
    ranks = P.group_ranks(group)
    world, me = len(ranks), ranks.index(P.get_rank())
    buf = shard.new_empty((world, shard.numel()))
    buf[me] = shard.reshape(-1)
    _all_gather_steps(ctx, buf, ranks, me, group)
    _account(ctx, "ring_all_gather", start)
    return buf


def ring_all_reduce(
    ctx: AlgorithmContext, tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Ring all-reduce of ``tensor`` in place (reduce-scatter, then all-gather); returns it."""
    _combine(op, tensor)
    start = time.perf_counter()
    ranks, world, me, chunk = _ring_setup(tensor, group)
    if world > 1:
        buf = _chunks(tensor, world, chunk)
        _reduce_scatter_steps(ctx, buf, ranks, me, op, group)
        _all_gather_steps(ctx, buf, ranks, me, group)
        tensor.copy_(buf.view(-1)[: tensor.numel()].view_as(tensor))
    if op == "avg":
        tensor /= world
    _account(ctx, "ring_all_reduce", start)
    return tensor


def tree_all_reduce(
    ctx: AlgorithmContext, tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Binary-tree all-reduce of ``tensor`` in place (reduce to group rank 0, broadcast down)."""
    combine = _combine(op, tensor)
    start = time.perf_counter()
    ranks = P.group_ranks(group)
    world, me = len(ranks), ranks.index(P.get_rank())
    children = [c for c in (2 * me + 1, 2 * me + 2) if c < world]
    incoming = torch.empty_like(tensor)
    for c in children:  # reduce phase: fold the children's subtrees in, then pass up
        ctx.recv(incoming, ranks[c], group=group)
        combine(tensor, incoming)
    if me != 0:
        ctx.send(tensor, ranks[(me - 1) // 2], group=group)
        ctx.recv(tensor, ranks[(me - 1) // 2], group=group)
    for c in children:  # broadcast phase
        ctx.send(tensor, ranks[c], group=group)
    if op == "avg":
        tensor /= world
    _account(ctx, "tree_all_reduce", start)
    return tensor


def hierarchical_all_reduce(
    ctx: AlgorithmContext,
    tensor: torch.Tensor,
    op: str = "sum",
    group: dist.ProcessGroup | None = None,
    ranks_per_node: int | None = None,
) -> torch.Tensor:
    """Hierarchical all-reduce of ``tensor`` in place over the default group (see the module docstring)."""
    if group is not None and group is not dist.group.WORLD:
        raise ValueError("hierarchical all-reduce runs over the default group (its node layout), got a sub-group")
    _combine(op, tensor)  # the allowed ops and dtypes
    start = time.perf_counter()
    g = ctx.node_groups(ranks_per_node)  # built once per context, released by its begin_job/close
    step_op = "sum" if op == "avg" else op
    with ctx.scope("intra_node"):
        ctx.reduce(tensor, dst=g.leader, op=step_op, group=g.node_group)
    if P.get_rank() == g.leader and len(g.leaders) > 1:
        with ctx.scope("inter_node"):
            ctx.all_reduce(tensor, op=step_op, group=g.leader_group)
    with ctx.scope("intra_node"):
        ctx.broadcast(tensor, src=g.leader, group=g.node_group)
    if op == "avg":
        tensor /= P.get_world_size()
    _account(ctx, "hierarchical_all_reduce", start)
    return tensor


ALGORITHMS: dict[str, Callable[..., torch.Tensor]] = {
    "backend": lambda ctx, t, op="sum", group=None: ctx.all_reduce(t, op=op, group=group),
    "ring": ring_all_reduce,
    "tree": tree_all_reduce,
    "hierarchical": hierarchical_all_reduce,
}


def all_reduce_with(
    ctx: AlgorithmContext, algorithm: str, tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-reduce with a named algorithm: one of :data:`ALGORITHMS` (``backend``, ``ring``, ``tree``,
    ``hierarchical``)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; allowed: {sorted(ALGORITHMS)}")
    return ALGORITHMS[algorithm](ctx, tensor, op=op, group=group)
