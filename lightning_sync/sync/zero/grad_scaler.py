"""Loss scaling for sharded gradients: one skip-or-step decision, shared by every rank.

fp16 training multiplies the loss by a scale so small gradients survive in fp16, then divides the gradients
by it before the step; a step whose gradients hold an inf or a NaN (the scale was too large) is skipped and
the scale shrinks (Micikevicius et al., ICLR 2018; torch's ``GradScaler``). A plain ``GradScaler`` decides
from the gradients *this* process holds. Under ZeRO a rank holds only its shard of the averaged gradient, so
an overflow lands in one rank's shard only: that rank would skip the step and its peers would take it, their
parameters would part, and at stages 1/2 the peers would wait in the post-step all-gather for a rank that
never issues it. :class:`ShardedGradScaler` all-reduces the found-inf flag (MAX) through the communicator
before anyone reads it, so every rank skips the same steps and updates its scale identically (torch's
``ShardedGradScaler`` for FSDP is the anchor).

Cost: one all-reduce of one float per ``unscale_`` (per optimizer and step), issued on every rank, also when
no rank has a gradient for that optimizer (a rank's flag is then zero).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_sync.sync.communicator import Communicator

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` whose inf/NaN check is agreed by all ranks of ``comm``.

    Everything else is torch's (``scale``, ``unscale_``, ``step``, ``update``, ``state_dict``): the scale and
    growth tracker stay identical on every rank because every rank updates them from the same agreed flag.
    An optimizer that unscales inside its own step (``fused=True``) also reads the agreed flag: torch computes
    it for such an optimizer through the same :meth:`_unscale_grads_`.

    Args:
        comm: the ranks that share the decision (the sharding engine's communicator).
        device, init_scale, growth_factor, backoff_factor, growth_interval, enabled: as ``torch.amp.GradScaler``.
    """

    def __init__(
        self,
        comm: Communicator,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.comm = comm

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler, comm: Communicator) -> ShardedGradScaler:
        """A sharded scaler with ``scaler``'s device, settings and current state (scale, growth tracker)."""
        new = cls(comm, device=scaler._device, enabled=scaler.is_enabled())
        if scaler.is_enabled():
            new.load_state_dict(scaler.state_dict())  # init_scale or the current scale, the factors, the tracker
        return new

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale this rank's gradients (torch's), then agree on one flag: 1 when any rank found an inf or a
        NaN. Returned as the one entry on the scale's device, which ``step`` and ``update`` read."""
        per_device: dict[Any, torch.Tensor] = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        flag = torch.zeros(1, dtype=torch.float32, device=found_inf.device)
        for found in per_device.values():
            flag = torch.maximum(flag, found.reshape(1).to(flag.device, torch.float32))
        self.comm.all_reduce(flag, op="max")
        return {found_inf.device: flag.reshape(found_inf.shape)}
