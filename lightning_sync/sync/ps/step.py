"""How the parameter server turns pending gradients into one optimizer step (:func:`apply_step`).

:class:`~lightning_sync.sync.ps.server.ParameterServer` decides *when* a step happens (the staleness
bound, the budget, failures); this module decides *what* the step is, and knows nothing of versions or workers
beyond the order it sums them in.

Step rule (s is the server's staleness bound)
    A step carries a share |S| / K of the global batch (|S| pending gradients, K workers). It applies
    the *mean* of its gradients with the optimizer's learning rate scaled by that share (the linear
    scaling rule, per step), so K pushes are worth one synchronous step whatever the timing and the
    optimizer: for plain SGD the update is ``lr * sum / K``, each gradient weighted as in a synchronous
    all-reduce average; for an optimizer that normalizes the gradient's scale away (Adam, AdamW) one
    push moves the model by 1/K of a synchronous step instead of a whole one (decoupled weight decay
    scales with it). At s = 0 every step carries all K gradients: exactly synchronous SGD. Gradient
    clipping applies to the mean, with the user's threshold. A parameter that no pushed gradient
    touched keeps ``grad = None`` for the step, so the optimizer skips it, as in one process. A step
    sums its gradients in a fixed order (by the version they were computed on, then by worker), not in
    the order they arrived: at s = 0 a run is the same bit for bit however the pushes are timed.

    ``lr_scaling="sqrt"`` scales the learning rate by sqrt(|S| / K) instead: the square-root rule for
    adaptive optimizers (Malladi et al., "On the SDEs and Scaling Rules for Adaptive Gradient
    Algorithms", NeurIPS 2022). Adam normalizes each step by the gradient's second moment, which grows
    as the batch shrinks, so a push of 1/K of the batch at lr / K moves the model by less than 1/K of a
    synchronous step; at lr / sqrt(K) it moves it by about that. At s = 0 (|S| = K) both rules are 1:
    still exactly synchronous.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_sync._checks import check_choice
from lightning_sync.sync.ps.wire import FlatLayout

__all__ = ["LR_SCALINGS", "Push", "apply_step", "check_lr_scaling", "clip_gradients"]

LR_SCALINGS = ("linear", "sqrt")
"""How a step's learning rate scales with the share of the global batch it carries (see the module docstring)."""


def check_lr_scaling(value: Any) -> str:
    """``lr_scaling`` checked and returned: one of :data:`LR_SCALINGS`."""
    return check_choice("lr_scaling", value, LR_SCALINGS)


@dataclass
class Push:
    """One worker's gradient, waiting for a step: computed on ``read_version``; ``grads`` are flat (one tensor
    per dtype, the server's layout), ``present`` says which parameters had a gradient; ``future`` completes
    with the server's reply."""

    worker: int
    read_version: int
    grads: list[torch.Tensor]
    present: list[bool]
    buffers: list[torch.Tensor]
    clip: tuple[str, float] | None
    future: torch.futures.Future = field(default_factory=torch.futures.Future)


def clip_gradients(params: Sequence[nn.Parameter], clip: tuple[str, float]) -> None:
    """Clip the gradients of ``params`` in place: ``("norm", max_norm)`` or ``("value", max_value)``."""
    algorithm, value = clip
    grads = [p for p in params if p.grad is not None]
    if algorithm == "norm":
        torch.nn.utils.clip_grad_norm_(grads, value)
    elif algorithm == "value":
        torch.nn.utils.clip_grad_value_(grads, value)
    else:
        raise ValueError(f"gradient clipping algorithm must be one of ['norm', 'value'], got {algorithm!r}")


def apply_step(
    take: list[Push],
    params: Sequence[nn.Parameter],
    layout: FlatLayout,
    optimizer: torch.optim.Optimizer,
    num_workers: int,
    lr_scaling: str,
) -> list[Push]:
    """Step ``optimizer`` (over ``params``) once with the mean of the gradients in ``take`` (see the module
    docstring); the learning rates are as they were afterwards, the gradients are cleared. Returns ``take`` in
    the order it was summed (its last push is the newest model's, from the highest worker among equals)."""
    # oldest model first, then by worker: the sums and the buffers kept do not depend on arrival order
    take = sorted(take, key=lambda p: (p.read_version, p.worker))
    n, k = len(take), num_workers
    total = [torch.zeros_like(f) for f in take[0].grads]
    for p in take:
        for t, g in zip(total, p.grads):
            t.add_(g)
    touched = [any(p.present[i] for p in take) for i in range(len(params))]
    for param, grad, used in zip(params, layout.views(total), touched):
        param.grad = (grad / n).to(param.device) if used else None
    clip = take[-1].clip
    if clip is not None:
        clip_gradients(params, clip)
    lrs = [g["lr"] for g in optimizer.param_groups]
    share = n / k if lr_scaling == "linear" else math.sqrt(n / k)
    for g in optimizer.param_groups:  # this step carries n / k of the global batch
        g["lr"] = g["lr"] * share
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    return take
