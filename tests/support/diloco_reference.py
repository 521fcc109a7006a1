"""DiLoCo's outer loop as it was before its streaming form (fragments, overlap, outer dtypes) existed, kept verbatim
as the oracle the streaming class must equal, value for value, with one fragment, no overlap and fp32."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_sync.sync.communicator import Communicator
from lightning_sync.sync.periodic import average_tensors


class TodaysDiLoCo:
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
        self.sync_every = sync_every
        self.params = list(dict.fromkeys(params))
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
