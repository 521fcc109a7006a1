"""``LightningCollectives``: Lightning's own collectives (``reduce``, ``all_gather``, ``broadcast``, ``barrier``) of a
strategy on a process group, through the strategy's :class:`~lightning_sync.comms.CommContext`.

Synced metrics (``self.log(..., sync_dist=True)``, torchmetrics), ``self.all_gather`` and the checkpoint-path
broadcasts then go where every other byte goes: counted, timed and watched by the hang watchdog. Under live fault
tolerance each goes through the membership's guard (:meth:`~lightning_sync.strategies._live.LiveTraining.guarded`),
which gives this rank's own value when no collective may run.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from lightning_sync import comms
from lightning_sync._lightning import calling_metric_key

__all__ = ["LightningCollectives"]

_REDUCE_OPS = {"mean": "avg", "avg": "avg", "sum": "sum", "max": "max", "min": "min"}
_TORCH_OPS = {
    torch.distributed.ReduceOp.SUM: "sum",
    torch.distributed.ReduceOp.MAX: "max",
    torch.distributed.ReduceOp.MIN: "min",
    torch.distributed.ReduceOp.AVG: "avg",
}


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


class LightningCollectives:
    """Lightning's collectives through ``self.comm`` (module docstring); a base placed before Lightning's
    ``DDPStrategy``, whose methods these replace."""

    comm: comms.CommContext
    live: Any

    @override
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
        if self.live is not None:
            return self.live.guarded(lambda: self.comm.all_reduce(out, op=op, group=group, label=label), lambda: out)
        return self.comm.all_reduce(out, op=op, group=group, label=label)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        if not torch.distributed.is_initialized():
            return tensor
        if self.live is not None:
            return self.live.guarded(lambda: self._all_gather(tensor, group, sync_grads), lambda: tensor.unsqueeze(0))
        return self._all_gather(tensor, group, sync_grads)

    def _all_gather(self, tensor: torch.Tensor, group: Any | None, sync_grads: bool) -> torch.Tensor:
        if sync_grads:
            return _AllGatherWithGrad.apply(tensor, self.comm)
        return torch.stack(self.comm.all_gather(tensor.detach().contiguous(), group=group))

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not torch.distributed.is_initialized():
            return obj
        if self.live is not None:
            return self.live.guarded(lambda: self.comm.broadcast_object(obj, src=src), lambda: obj)
        return self.comm.broadcast_object(obj, src=src)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not torch.distributed.is_initialized():
            return
        if self.live is not None:
            self.live.guarded(self.comm.barrier, lambda: None)
        else:
            self.comm.barrier()
