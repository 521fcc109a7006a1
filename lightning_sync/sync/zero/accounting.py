"""What a ZeRO engine's state adds up to across its shards: the bytes it holds, and the global gradient norm.

Both read the engine's flat parameters, offload and optimizers and change nothing but the gradients a clip
scales; the norm is a collective (every rank's shard counts), the bytes are this rank's.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from lightning_sync.sync.communicator import Communicator
from lightning_sync.sync.zero.flat_param import FlatParam
from lightning_sync.sync.zero.options import storage_bytes


class _Engine(Protocol):
    """What these read of a :class:`~lightning_sync.sync.zero.engine.ZeroEngine` (which imports this module)."""

    module: nn.Module
    flats: list[FlatParam]
    optimizers: list[torch.optim.Optimizer]
    comm: Communicator
    _offload: Any


__all__ = ["clip_grad_norm_", "memory_report"]


def memory_report(engine: _Engine) -> dict[str, dict[str, int]]:
    """What :meth:`~lightning_sync.sync.zero.engine.ZeroEngine.memory_bytes` counts (parameter, gradient and
    optimizer-state storage this rank holds now, each storage once), by where the bytes live: ``"device"`` (where
    the module computes) and ``"host"`` (with ``offload``: the master shards, their gradients, the optimizer state
    and the pinned buffers of the copies; else nothing). Placed by role: on a CPU-only machine, where both are host
    memory, the report still says which bytes an accelerator would hold."""
    seen: set[int] = set()
    offloaded = [] if engine._offload is None else engine._offload.shards
    module = list(engine.module.parameters())
    computed = {
        "params": storage_bytes([*module, *(s.device_shard for s in offloaded)], seen),
        "grads": storage_bytes([*(p.grad for p in module), *(f.grad_full for f in engine.flats)], seen),
        "optimizer": 0,
    }
    state = [v for opt in engine.optimizers for s in opt.state.values() for v in s.values()]
    buffers = [s.host_buffers() for s in offloaded]
    stepped = {
        "params": storage_bytes([*(f.master for f in engine.flats), *(t for b in buffers for t in b["params"])], seen),
        "grads": storage_bytes(
            [*(f.master.grad for f in engine.flats), *(t for b in buffers for t in b["grads"])], seen
        ),
        "optimizer": storage_bytes(state, seen),
    }
    if engine._offload is None:
        return {"device": {k: computed[k] + stepped[k] for k in stepped}, "host": dict.fromkeys(stepped, 0)}
    return {"device": computed, "host": stepped}


def clip_grad_norm_(engine: _Engine, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the masters' gradients by the *global* norm (all ranks' shards together); a collective.
    Padding gradients are zero, so they do not change the norm."""
    if norm_type != 2.0:
        raise ValueError(f"ZeroEngine.clip_grad_norm_ supports norm_type=2.0 only, got {norm_type!r}")
    if engine._offload is not None:
        engine._offload.synchronize()
    grads = [f.master.grad for f in engine.flats if f.master.grad is not None]
    device = engine.flats[0].device if engine.flats else torch.device("cpu")
    sq = torch.zeros(1, dtype=torch.float64, device=grads[0].device if grads else device)  # where the shards are
    for g in grads:
        sq += g.detach().double().pow(2).sum()
    sq = sq.to(device)  # the all-reduce runs where the backend's tensors live
    engine.comm.all_reduce(sq, op="sum")
    total = sq.sqrt().squeeze(0)
    coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total.float()
