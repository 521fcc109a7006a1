"""What of the parameter server a checkpoint holds, and how it comes back, with another number of workers too.

:class:`~lightning_sync.sync.ps.server.ParameterServer` decides *when* its state may be read or written (under
its lock, never after its own update failed half-way); this module is *what* that state is.

Snapshot
    The whole server at one version V (:func:`snapshot_of`): the global model's parameters and buffers, the
    optimizer's and LR schedulers' states, and the counters (:func:`counters_of`): V, the pushes applied and
    discarded, the global clock (pushes // K), the staleness histogram, the pushes per worker and K itself.

Restoring the counters
    :func:`restore_counters` puts V, the clock and the histogram back as they were; the server then restarts
    every worker on V, so the staleness bound holds from the first push on. The model and optimizer are
    restored by the server's host, in stages (the server's *Restoring*).

Another number of workers
    The global clock ``pushes // K`` continues where it stood: the saved pushes of K workers count as pushes of
    K' (:func:`rescaled_pushes`), the same global steps' worth and the same part of the global step in
    progress, rounded down. Pushes per worker cannot be mapped one to one onto other workers, so they start
    again from 0.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any, Protocol

import torch

__all__ = ["ServerState", "counters_of", "rescaled_pushes", "restore_counters", "snapshot_of"]


class ServerState(Protocol):
    """The attributes of a :class:`~lightning_sync.sync.ps.server.ParameterServer` its checkpoint reads and
    restores (module docstring)."""

    params: list[torch.nn.Parameter]
    buffers: list[torch.Tensor]
    optimizer: torch.optim.Optimizer | None
    schedulers: list[Any]
    num_workers: int
    version: int
    pushes: int
    discarded: int
    global_step: int
    staleness: Counter[int]
    pushes_by_worker: list[int]


def snapshot_of(server: ServerState) -> dict[str, Any]:
    """A copy of the whole state of ``server`` (the caller holds its lock): the model, optimizer and
    schedulers, and the counters under ``"state"``."""
    return {
        "params": [p.detach().clone() for p in server.params],
        "buffers": [b.clone() for b in server.buffers],
        "optimizer": copy.deepcopy(server.optimizer.state_dict()) if server.optimizer is not None else None,
        "schedulers": [copy.deepcopy(s.state_dict()) for s in server.schedulers],
        "state": counters_of(server),
    }


def counters_of(server: ServerState) -> dict[str, Any]:
    """The counters of ``server``: version, pushes, global step, staleness histogram, pushes per worker."""
    return {
        "version": server.version,
        "pushes": server.pushes,
        "discarded": server.discarded,
        "global_step": server.global_step,
        "staleness": dict(server.staleness),
        "pushes_by_worker": list(server.pushes_by_worker),
        "num_workers": server.num_workers,
    }


def rescaled_pushes(pushes: int, saved_workers: int, workers: int) -> int:
    """``pushes`` of ``saved_workers`` as pushes of ``workers``: the same global steps' worth, rounded down
    (the global clock ``pushes // K`` is kept, and the part of a global step done since its last tick)."""
    return pushes * workers // saved_workers


def restore_counters(server: ServerState, state: dict[str, Any]) -> None:
    """Set the counters of ``server`` from ``state`` (of :func:`counters_of`; the caller holds its lock). With
    another number of workers the pushes are rescaled (:func:`rescaled_pushes`) and the pushes per worker kept
    as they are (from 0 on a new server)."""
    server.version = int(state["version"])
    server.global_step = int(state["global_step"])
    saved_workers = int(state.get("num_workers", server.num_workers))
    server.pushes = rescaled_pushes(int(state["pushes"]), saved_workers, server.num_workers)
    server.discarded = int(state.get("discarded", 0))
    server.staleness = Counter({int(k): int(v) for k, v in state.get("staleness", {}).items()})
    if saved_workers == server.num_workers:
        server.pushes_by_worker = [int(x) for x in state.get("pushes_by_worker", server.pushes_by_worker)]
