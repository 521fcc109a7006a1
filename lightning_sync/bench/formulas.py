"""Closed-form communication costs (Patarasuk & Yuan 2009; Thakur et al. 2005) for K ranks, S payload bytes,
bandwidth BW (bytes/s) and per-message latency alpha (s), which :mod:`lightning_sync.bench.model` prices with.
"""

from __future__ import annotations

import math

__all__ = ["overlapped_step_time", "ring_allreduce_bytes", "ring_allreduce_time", "ring_shard_bytes"]
__all__ += ["tree_allreduce_time", "tree_depth"]


def _check(world_size: int, nbytes: float) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    if nbytes < 0:
        raise ValueError(f"payload bytes must be >= 0, got {nbytes!r}")


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``: ``2(K-1)/K * S``."""
    _check(world_size, nbytes)
    return 2.0 * (world_size - 1) / world_size * nbytes


def ring_shard_bytes(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring reduce-scatter or all-gather of ``nbytes``: ``(K-1)/K * S``."""
    _check(world_size, nbytes)
    return (world_size - 1) / world_size * nbytes


def ring_allreduce_time(nbytes: float, world_size: int, bandwidth: float, latency: float = 0.0) -> float:
    """``T_ring = 2(K-1)*alpha + 2(K-1)*S/(K*BW)`` in seconds (bandwidth in bytes/s)."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth!r}")
    steps = 2 * (world_size - 1)
    return steps * latency + ring_allreduce_bytes(nbytes, world_size) / bandwidth


def tree_depth(world_size: int) -> int:
    """``ceil(log2 K)``: the rounds of a binary tree over K ranks (0 for one rank)."""
    return math.ceil(math.log2(world_size)) if world_size > 1 else 0


def tree_allreduce_time(nbytes: float, world_size: int, bandwidth: float, latency: float = 0.0) -> float:
    """``T_tree = 2*ceil(log2 K)*(alpha + S/BW)``: reduce up a binary tree, broadcast back down."""
    _check(world_size, nbytes)
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth!r}")
    return 2 * tree_depth(world_size) * (latency + nbytes / bandwidth)


def overlapped_step_time(compute_s: float, comm_s: float, exposed_s: float = 0.0) -> float:
    """``T_step = max(T_comp, T_comm) + T_exposed`` for communication overlapped with backward."""
    return max(compute_s, comm_s) + exposed_s
