"""Periodic synchronization: LocalSGD parameter averaging and DiLoCo's outer step.

Neither synchronizes gradients. Every rank trains its own replica with its own optimizer and the
replicas meet every ``sync_every`` (H) optimizer steps:

* :class:`PeriodicAverager` (LocalSGD; Lin et al., "Don't use large mini-batches, use local SGD",
  ICLR 2020; torch's ``PeriodicModelAverager``): all-reduce-average the parameters (and, optionally,
  the optimizer's per-parameter state), one flat message per dtype. ``warmup_steps`` steps first run
  as ordinary synchronous data parallelism (post-local SGD); :attr:`PeriodicAverager.in_warmup` tells
  the caller to keep averaging gradients until then. With H = 1 and plain SGD it is exactly DDP.
* :class:`DiLoCoOuter` (Douillard et al., "DiLoCo", 2023; torchft's ``DiLoCo``): keeps the global
  parameters of the last sync; every H steps the pseudo-gradient ``global - local`` is
  all-reduce-averaged, an outer SGD step (Nesterov momentum by default: lr 0.7, momentum 0.9) is
  applied to the global parameters, and the result is copied into the local ones.

Bytes per H steps: one all-reduce of the parameters (plus the optimizer state if averaged), against
H gradient all-reduces for DDP. A rank that fails blocks its peers in the next sync's all-reduce
until the process group's timeout.

Checkpoints: each ``state_dict`` holds what is the same on every rank (the step and sync counters;
DiLoCo's global parameters and outer optimizer). Between syncs each rank's replica and its optimizer
state are its own; a caller that resumes inside a period keeps those per rank (the Lightning strategies do).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_sync._checks import check_int
from lightning_sync.sync.communicator import Communicator
from lightning_sync.sync.flat import FlatLayout

__all__ = ["DiLoCoOuter", "PeriodicAverager", "average_tensors", "check_int", "check_outer"]


def check_outer(outer_lr: Any, outer_momentum: Any, nesterov: Any) -> None:
    """DiLoCo's outer SGD settings, each checked; a ValueError names the bad one."""
    if isinstance(outer_lr, bool) or not isinstance(outer_lr, (int, float)) or not 0 < outer_lr < math.inf:
        raise ValueError(f"outer_lr must be a finite number > 0, got {outer_lr!r}")
    if isinstance(outer_momentum, bool) or not isinstance(outer_momentum, (int, float)) or not 0 <= outer_momentum < 1:
        raise ValueError(f"outer_momentum must be a number in [0, 1), got {outer_momentum!r}")
    if not isinstance(nesterov, bool) or (nesterov and outer_momentum == 0):
        raise ValueError(
            f"nesterov must be True or False (True needs outer_momentum > 0), got {nesterov!r} "
            f"with outer_momentum={outer_momentum!r}"
        )


def _distinct(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


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
        self.params = _distinct(params)
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


class DiLoCoOuter:
    """DiLoCo's outer loop over the local ``params`` (see the module docstring).

    Args:
        params: the trainable parameters the inner optimizer steps (each shared tensor once).
        comm: the communicator.
        sync_every: H >= 1 inner steps per outer step.
        outer_lr: outer SGD learning rate (> 0; the paper's 0.7).
        outer_momentum: outer momentum in [0, 1) (the paper's 0.9).
        nesterov: Nesterov momentum (needs ``outer_momentum > 0``).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        comm: Communicator,
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
    ) -> None:
        self.sync_every = check_int("sync_every", sync_every, 1)
        check_outer(outer_lr, outer_momentum, nesterov)
        self.params = _distinct(params)
        self.comm = comm
        self.global_params = [nn.Parameter(p.detach().clone()) for p in self.params]
        self.outer_optimizer = torch.optim.SGD(
            self.global_params, lr=float(outer_lr), momentum=float(outer_momentum), nesterov=bool(nesterov)
        )
        self.steps = 0
        self.syncs = 0

    def step(self) -> bool:
        """Count one inner step; run the outer step when a period ends. Returns whether it did."""
        self.steps += 1
        if self.steps % self.sync_every:
            return False
        self.sync()
        return True

    def period_ends_next(self) -> bool:
        """Whether the next inner step ends a period (an outer step follows it)."""
        return (self.steps + 1) % self.sync_every == 0

    def sync(self) -> None:
        """Outer step now: average the pseudo-gradients, step the global parameters, copy them back."""
        with torch.no_grad():
            for g, p in zip(self.global_params, self.params):
                g.grad = g.detach() - p.detach()
            average_tensors([g.grad for g in self.global_params if g.grad is not None], self.comm)
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for g, p in zip(self.global_params, self.params):
                p.copy_(g)
        self.syncs += 1

    def state_dict(self) -> dict[str, Any]:
        """Global parameters, outer optimizer state and counters (identical on every rank)."""
        return {
            "steps": self.steps,
            "syncs": self.syncs,
            "global_params": [g.detach().clone() for g in self.global_params],
            "outer_optimizer": self.outer_optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["global_params"]
        if len(saved) != len(self.global_params) or any(s.shape != g.shape for s, g in zip(saved, self.global_params)):
            raise ValueError(
                f"DiLoCo state holds {len(saved)} global parameters that do not match this model's "
                f"{len(self.global_params)}"
            )
        with torch.no_grad():
            for g, s in zip(self.global_params, saved):
                g.copy_(s)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.steps, self.syncs = int(state.get("steps", 0)), int(state.get("syncs", 0))
