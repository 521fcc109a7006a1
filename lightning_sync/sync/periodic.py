"""Periodic synchronization: LocalSGD parameter averaging and DiLoCo's outer step.

Neither synchronizes gradients. Every rank trains its own replica with its own optimizer and the
replicas meet every ``sync_every`` (H) optimizer steps:

* :class:`PeriodicAverager` (LocalSGD; Lin et al., "Don't use large mini-batches, use local SGD",
  ICLR 2020; torch's ``PeriodicModelAverager``): all-reduce-average the parameters (and, optionally,
  the optimizer's per-parameter state), one flat message per dtype. ``warmup_steps`` steps first run
  as ordinary synchronous data parallelism (post-local SGD); :attr:`PeriodicAverager.in_warmup` tells
  the caller to keep averaging gradients until then. With H = 1 and plain SGD it is exactly DDP.
* :class:`~lightning_sync.sync.outer.DiLoCoOuter` (Douillard et al., "DiLoCo", 2023; torchft's ``DiLoCo``):
  keeps the global parameters of the last sync; every H steps the pseudo-gradient ``global - local`` is
  all-reduce-averaged, an outer SGD step (Nesterov momentum by default: lr 0.7, momentum 0.9) is
  applied to the global parameters, and the result is copied into the local ones. Its streaming form
  (fragments, overlapped syncs, outer gradients in fewer bits) is in :mod:`lightning_sync.sync.outer`.

Bytes per H steps: one all-reduce of the parameters (plus the optimizer state if averaged), against
H gradient all-reduces for DDP. A rank that fails blocks its peers in the next sync's all-reduce
until the process group's timeout.

Checkpoints: each ``state_dict`` holds what is the same on every rank (the step and sync counters;
DiLoCo's global parameters and outer optimizer). Between syncs each rank's replica and its optimizer
state are its own; a caller that resumes inside a period keeps those per rank (the Lightning strategies do).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lightning_sync._checks import check_int
from lightning_sync.sync.communicator import Communicator
from lightning_sync.sync.flat import FlatLayout
from lightning_sync.sync.outer import DiLoCoOuter, check_outer, distinct

__all__ = ["DiLoCoOuter", "PeriodicAverager", "average_tensors", "check_int", "check_outer"]


def average_tensors(tensors: list[torch.Tensor], comm: Communicator) -> None:
    """All-reduce-average ``tensors`` in place: one flat message per (dtype, device); empty ones are left out."""
    members = [t for t in tensors if t.numel()]
    layout = FlatLayout(members, by_device=True)
    flats = layout.flatten(members)
    for flat in flats:
        comm.all_reduce(flat, op="avg")
    layout.copy_into(flats, members)


class PeriodicAverager:
    """LocalSGD: average the replicas every ``sync_every`` optimizer steps (see the module docstring).

    Args:
        params: the parameters to average (each shared tensor once; frozen ones too, they stay equal).
        comm: the communicator.
        sync_every: H >= 1.
        warmup_steps: steps of synchronous data parallelism before local steps start (>= 0).
        optimizer: needed with ``average_optimizer_state``.
        average_optimizer_state: also average the optimizer's floating-point per-parameter state
            (momentum, Adam's moments) at every sync.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        comm: Communicator,
        sync_every: int,
        warmup_steps: int = 0,
        optimizer: torch.optim.Optimizer | None = None,
        average_optimizer_state: bool = False,
    ) -> None:
        self.sync_every = check_int("sync_every", sync_every, 1)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        if average_optimizer_state and optimizer is None:
            raise ValueError("average_optimizer_state=True needs the optimizer")
        self.params = distinct(params)
        self.comm, self.optimizer, self.average_optimizer_state = comm, optimizer, average_optimizer_state
        self.steps = 0
        self.syncs = 0

    @property
    def in_warmup(self) -> bool:
        """True while the next step is still a synchronous (gradient-averaged) one."""
        return self.steps < self.warmup_steps

    def step(self) -> bool:
        """Count one optimizer step; average when a period ends (after warm-up). Returns whether it did."""
        self.steps += 1
        local = self.steps - self.warmup_steps
        if local <= 0 or local % self.sync_every:
            return False
        self.sync()
        return True

    def period_ends_next(self) -> bool:
        """Whether the next step ends a period (a warm-up step is a period of its own)."""
        local = self.steps + 1 - self.warmup_steps
        return local <= 0 or local % self.sync_every == 0

    def sync(self) -> None:
        """Average the parameters (and the optimizer state if asked) now; a collective."""
        tensors = list(self.params)
        if self.average_optimizer_state and self.optimizer is not None:
            for p in self.params:
                for value in self.optimizer.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                        tensors.append(value)
        average_tensors(tensors, self.comm)
        self.syncs += 1

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "syncs": self.syncs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.syncs = int(state.get("steps", 0)), int(state.get("syncs", 0))
