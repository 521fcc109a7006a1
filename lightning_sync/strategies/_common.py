"""What the lightning_sync strategies share: argument checks, the communication context, and Lightning's
collectives routed through it, so that metric syncing is counted and watched like everything else."""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch

from lightning_sync import comms
from lightning_sync._checks import check_bool
from lightning_sync._lightning import calling_metric_key, explicit_checkpoint_io, set_checkpoint_io, trainer_of
from lightning_sync.strategies._checkpoint_io import AtomicCheckpointIO
from lightning_sync.strategies._exact_data import ExactDataHooks
from lightning_sync.strategies._telemetry import CommTelemetryHooks

__all__ = [
    "AtomicCheckpoints",
    "CommsCollectivesMixin",
    "OwnsCommContext",
    "as_timedelta",
    "check_bool",
    "check_launch_args",
    "no_sync_of",
    "PASSTHROUGH",
]

_REDUCE_OPS = {"mean": "avg", "avg": "avg", "sum": "sum", "max": "max", "min": "min"}
_TORCH_OPS = {
    torch.distributed.ReduceOp.SUM: "sum",
    torch.distributed.ReduceOp.MAX: "max",
    torch.distributed.ReduceOp.MIN: "min",
    torch.distributed.ReduceOp.AVG: "avg",
}
# Lightning components a user may pass explicitly; anything else is a typo and raises.
PASSTHROUGH = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")


def as_timedelta(timeout: float | timedelta) -> timedelta:
    """A collective timeout given in seconds (or already a ``timedelta``), checked."""
    if isinstance(timeout, timedelta) and timeout > timedelta(0):
        return timeout
    if (
        isinstance(timeout, timedelta)
        or not isinstance(timeout, (int, float))
        or isinstance(timeout, bool)
        or not 0 < timeout < math.inf
    ):
        raise ValueError(f"timeout must be a finite number of seconds > 0 or a timedelta > 0, got {timeout!r}")
    return timedelta(seconds=timeout)


class _AllGatherWithGrad(torch.autograd.Function):
    """``CommContext.all_gather`` whose backward sends each rank the gradient of its own slice."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, comm: comms.CommContext) -> torch.Tensor:
        ctx.comm = comm
        return torch.stack(comm.all_gather(tensor.contiguous()))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        ctx.comm.all_reduce(grad, op="sum")
        return grad[comms.get_rank()], None


def no_sync_of(switch: Any | None) -> AbstractContextManager[Any]:
    """``switch.no_sync()`` (a ``SyncSwitch``: the bucketer or the ZeRO engine), or nothing before setup."""
    return switch.no_sync() if switch is not None else nullcontext()


def check_launch_args(owner: str, process_group_backend: Any, start_method: Any, kwargs: dict[str, Any]) -> None:
    """Validate the launch arguments every strategy takes; unknown keyword arguments are typos."""
    if start_method not in ("popen", "spawn", "fork", "forkserver"):
        raise ValueError(f"start_method must be one of ['popen', 'spawn', 'fork', 'forkserver'], got {start_method!r}")
    if process_group_backend not in (None, "gloo", "nccl"):
        raise ValueError(f"process_group_backend must be one of [None, 'gloo', 'nccl'], got {process_group_backend!r}")
    unknown = sorted(set(kwargs) - set(PASSTHROUGH))
    if unknown:
        raise ValueError(f"{owner} got unknown arguments {unknown}; besides its own it accepts {list(PASSTHROUGH)}")


class AtomicCheckpoints:
    """Strategies whose checkpoint files are written atomically (:class:`~lightning_sync.launch.AtomicCheckpointIO`)
    unless the user passes another ``checkpoint_io``."""

    @property
    def checkpoint_io(self) -> Any:
        if explicit_checkpoint_io(self) is None:
            set_checkpoint_io(self, AtomicCheckpointIO())
        return super().checkpoint_io  # type: ignore[misc]

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        set_checkpoint_io(self, io)


class OwnsCommContext(CommTelemetryHooks):
    """A strategy's own :class:`~lightning_sync.comms.CommContext` (:attr:`comm`), created on first use, and the
    per-step communication telemetry read from it (:mod:`lightning_sync.strategies._telemetry`)."""

    @property
    def comm(self) -> comms.CommContext:
        """This strategy's :class:`~lightning_sync.comms.CommContext`: its collectives, sequence numbers, hang
        watchdog and node groups, and a :class:`~lightning_sync.comms.CommStats` observer that measures them
        (set ``comm.observer = None`` to measure nothing). Nothing of it is shared with another strategy."""
        ctx = self.__dict__.get("_comm")
        if ctx is None:
            ctx = self.__dict__["_comm"] = comms.CommContext(observer=comms.CommStats())
        return ctx

    @comm.setter
    def comm(self, ctx: comms.CommContext) -> None:
        self.__dict__["_comm"] = ctx


class CommsCollectivesMixin(OwnsCommContext, ExactDataHooks, AtomicCheckpoints):
    """The strategy's communication context (:attr:`comm`), and ``reduce``/``all_gather``/``broadcast``/``barrier``
    for Lightning (torchmetrics ``sync_dist``, ``self.all_gather``, checkpoint-path broadcasts) through it; every
    fit starts from clean communication state (:meth:`~lightning_sync.comms.CommContext.begin_job`)."""

    def setup_environment(self) -> None:
        trainer = trainer_of(self.lightning_module)  # type: ignore[attr-defined]
        if trainer is not None and trainer.state.fn == "fit":  # a second fit of this strategy
            self.comm.begin_job()
        super().setup_environment()  # type: ignore[misc]

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor) or not torch.distributed.is_initialized():
            return tensor
        name = _TORCH_OPS.get(reduce_op, reduce_op) if reduce_op is not None else "mean"
        if not isinstance(name, str) or name.lower() not in _REDUCE_OPS:
            raise ValueError(f"reduce_op {reduce_op!r} is not supported; allowed: {sorted(_REDUCE_OPS)}")
        op = _REDUCE_OPS[name.lower()]
        out = tensor.detach().clone()
        if op == "avg" and not out.is_floating_point():
            out = out.float()
        # Lightning's result collection passes the tensor alone; the key it syncs is on the caller's metadata. As
        # the all-reduce's label, it lets the hang watchdog tell apart ranks that sync different keys of one shape.
        label = calling_metric_key()
        return self.comm.all_reduce(out, op=op, group=group, label=label)

    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        if not torch.distributed.is_initialized():
            return tensor
        if sync_grads:
            return _AllGatherWithGrad.apply(tensor, self.comm)
        return torch.stack(self.comm.all_gather(tensor.detach().contiguous(), group=group))

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not torch.distributed.is_initialized():
            return obj
        return self.comm.broadcast_object(obj, src=src)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if torch.distributed.is_initialized():
            self.comm.barrier()
