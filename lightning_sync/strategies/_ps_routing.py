"""Where Lightning's optimizer, LR schedulers and gradient clipping go under the asynchronous parameter
server (:class:`~lightning_sync.strategies.async_ps.AsyncParameterServerStrategy`): to the server.

Lightning steps an optimizer, steps its schedulers and clips gradients on every rank. Under the parameter
server none of that may happen on a worker: the server owns the one optimizer (and its schedulers), and
clips the mean gradient of each step. These adapters keep Lightning's calls and send them there.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from lightning_sync.sync.ps.server import ParameterServer

__all__ = ["GlobalClockScheduler", "PushingOptimizer", "lr_targets", "route_clipping", "route_schedulers"]


class PushingOptimizer(torch.optim.Optimizer):
    """What Lightning steps on every worker: the user's optimizer's param groups over this replica's
    parameters. ``step`` runs the closure (forward, backward, hooks) and then ``push``; the server steps
    the real optimizer. ``zero_grad`` clears this replica's gradients."""

    def __init__(self, real: torch.optim.Optimizer, push: Callable[[], None]) -> None:
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])} for g in real.param_groups
        ]
        super().__init__(groups, dict(real.defaults))
        self._push = push

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        self._push()
        return loss


class GlobalClockScheduler:
    """An LR scheduler Lightning holds but does not step: the server steps it (step-interval ones on
    the global clock; the others, under the server's lock, when Lightning steps them on the server rank)."""

    def __init__(self, scheduler: Any, server: ParameterServer | None, lightning_steps: bool) -> None:
        self._scheduler, self._server, self._lightning_steps = scheduler, server, lightning_steps

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self._server is not None and self._lightning_steps:
            with self._server.lock:
                self._scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self._scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)


def route_schedulers(configs: list[Any], server: ParameterServer | None) -> None:
    """Wrap every scheduler of Lightning's ``configs`` in a :class:`GlobalClockScheduler`. On the server's
    rank (``server`` given) the server saves them in its snapshots and steps the step-interval ones on the
    global clock, every ``frequency`` global steps."""
    clocked = []
    for config in configs:
        on_clock = config.interval == "step" and not config.reduce_on_plateau
        if on_clock:
            clocked.append((config.scheduler, max(int(config.frequency), 1)))
        config.scheduler = GlobalClockScheduler(config.scheduler, server, lightning_steps=not on_clock)
    if server is None:
        return
    server.schedulers = [c.scheduler._scheduler for c in configs]

    def step_schedulers(global_step: int) -> None:
        for scheduler, every in clocked:
            if global_step % every == 0:
                scheduler.step()

    server.on_global_step = step_schedulers


def route_clipping(plugin: Any, set_clip: Callable[[tuple[str, float]], None]) -> None:
    """Lightning's clipping on ``plugin`` (the precision plugin) hands ``set_clip`` the algorithm and
    threshold instead of clipping: the server clips the mean gradient of each step (see the parameter
    server)."""

    def clip_by_norm(optimizer: Any, clip_val: float) -> None:
        set_clip(("norm", float(clip_val)))

    def clip_by_value(optimizer: Any, clip_val: float) -> None:
        set_clip(("value", float(clip_val)))

    plugin.clip_grad_by_norm = clip_by_norm
    plugin.clip_grad_by_value = clip_by_value


def lr_targets(
    server: ParameterServer | None, schedulers: list[Any]
) -> tuple[list[torch.optim.Optimizer], list[Any], Callable[[], int], AbstractContextManager[Any]]:
    """Where an LR rule (:class:`~lightning_sync.lr_rules.ScaledWarmup`) scales and warms up: the server's
    optimizer and the ``schedulers`` Lightning holds, out of their :class:`GlobalClockScheduler`, on the global
    clock, under the server's lock. Nothing on a worker without the server: its LR comes with each reply."""
    if server is None or server.optimizer is None:
        return [], [], lambda: 0, nullcontext()
    unwrapped = [getattr(s, "_scheduler", s) for s in schedulers]
    return [server.optimizer], unwrapped, lambda: server.global_step, server.lock
