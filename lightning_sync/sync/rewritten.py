"""What an algorithm that rewrites an optimizer's ``param_groups`` in place needs of that optimizer.

ZeRO (:mod:`lightning_sync.sync.zero`) points a user's optimizer at the fp32 master shards, and the parameter
server (:mod:`lightning_sync.sync.ps`) at its own copies of the parameters. Both keep the optimizer object, its
groups and hyperparameters (so LR schedulers keep working) and change only the tensors the groups hold, which
works for an optimizer that reads ``param_groups`` when it steps and has not stepped yet.
"""

from __future__ import annotations

import torch

__all__ = ["check_rewritable"]


def check_rewritable(optimizer: torch.optim.Optimizer, builder: str) -> None:
    """Refuse (``ValueError``) an optimizer that keeps a parameter list of its own, which a rewrite of its groups
    would not reach, or that already has per-parameter state for the tensors being replaced; ``builder`` names
    what must be built before the first step."""
    if hasattr(optimizer, "_params"):
        raise ValueError(
            f"{type(optimizer).__name__} keeps its own parameter list, which {builder} cannot point at the "
            f"tensors it steps; use an optimizer that reads param_groups (SGD, Adam, AdamW, ...)"
        )
    if any(len(s) for s in optimizer.state.values()):
        raise ValueError(f"the optimizer already has state; build the {builder} before the first step")
