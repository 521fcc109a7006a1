"""The collectives of equal-sized tensors, as methods of a :class:`~lightning_sync.comms.context.CommContext`.

Every byte a strategy sends goes through :meth:`Collectives._issue`, in this file; uneven tensors and picklable
objects are in :mod:`lightning_sync.comms.uneven`. Without call hooks (:mod:`lightning_sync.comms.hooks`),
``_issue`` takes no lock, reads no clock and builds no handle for a synchronous call: it costs what the raw
``torch.distributed`` call costs, plus a sequence number.

Each collective follows torch.distributed's semantics with four differences that make it safe to
build strategies on:

* **Uneven inputs work on every backend.** gloo has no uneven all-gather; we exchange sizes and
  shapes first (counted as ``metadata``), pad to the largest, and trim. Mismatched trailing shapes or
  dtypes raise a ``ValueError`` on *every* rank instead of hanging.
* **Objects are first-class.** ``broadcast``/``scatter``/``gather_object``/``all_gather_object``
  pickle into a uint8 tensor, so the object payload is counted in bytes and can run async.
* **Every call is accounted.** ``_issue`` gives each call a sequence number, shows it to the context's
  call hooks (statistics, the hang watchdog), and returns a :class:`Work` when ``async_op=True``.
* **Bad input says what is allowed.** Unknown ``op``, out-of-range ``src``/``dst``, wrong chunk
  counts and calls before ``init_process_group`` raise with the bad value and the allowed ones.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lightning_sync.comms.hooks import Call, CallHook, CountingHook
from lightning_sync.comms.payload import (
    REDUCE_OPS,
    REDUCE_SCATTER_SINGLE,
    check_rank,
    check_reduce,
    get_rank,
    get_world_size,
    handles_of,
    nbytes,
    padded,
    require_init,
)
from lightning_sync.comms.work import Work

__all__ = ["Collectives"]

T = TypeVar("T")


class Collectives:
    """The collectives of equal-sized tensors; each validates its arguments, then issues its backend calls
    through :meth:`~lightning_sync.comms.context.CommContext._issue`."""

    # the state a CommContext holds (comms/context.py)
    group: dist.ProcessGroup | None
    settings: Any
    _hooks: tuple[CallHook, ...]  # the call hooks, the one that waits (if any) first
    _hook_waits: bool  # whether one of them waits for the backend requests itself
    _counter: CountingHook | None  # the only hook, when it counts synchronous calls without a Call
    _scopes: dict[int, tuple[str, ...]]

    def _next_seq(
        self, group: dist.ProcessGroup | None, peer: int | None, world: dist.ProcessGroup | None = None
    ) -> tuple[int, str]:
        raise NotImplementedError  # CommContext._next_seq

    def _issue(
        self,
        op: str,
        nbytes: int,
        launch: Callable[[bool], Sequence[Any]],
        finish: Callable[[], T],
        async_op: bool,
        group: dist.ProcessGroup | None = None,
        peer: int | None = None,
        like: torch.Tensor | None = None,
        detail: str = "",
        label: str | None = None,
    ) -> Any:
        """The one place every collective goes through: sequence number, call hooks, async handle.

        ``peer`` marks a point-to-point op with that global rank (its sequence numbers count apart). ``like``,
        ``detail`` and ``label`` complete the call's signature (:class:`~lightning_sync.comms.hooks.Call`); they are
        read only by hooks.

        ``launch(blocking)`` issues the backend call(s) and returns their handles; with ``blocking`` (a synchronous
        call that no hook has to wait for) a single backend call may run synchronously and return none, which
        spares torch's asynchronous work object and its wait."""
        if self._scopes:
            names = self._scopes.get(threading.get_ident())
            if names:
                op = "/".join([*names, op])
        seq, name = self._next_seq(group, peer)
        hooks = self._hooks
        if not hooks:  # the bare path: what torch.distributed costs
            handles = launch(not async_op)
            if async_op:
                return Work(op, seq, handles, finish)
            for h in handles:
                h.wait()
            return finish()
        counter = self._counter
        if counter is not None and not async_op:  # its only hook counts: told the op and bytes, no Call built
            token = counter.begin(op, nbytes)
            try:
                for h in launch(True):
                    h.wait()
            except BaseException:
                counter.end(op, token, False)
                raise
            try:
                return finish()
            finally:  # the backend requests completed: that is what the hook hears, even if finish raises
                counter.end(op, token, True)
        call = Call(hooks, op, seq, name, group, peer, nbytes, like, detail, label, async_op)
        call.issue()
        try:
            handles = launch(not async_op and not self._hook_waits)
        except BaseException as error:  # nothing is in flight
            diagnosed = call.launch_failed(error)
            call.complete(ok=False)
            if diagnosed is not error:
                raise diagnosed from error
            raise
        if handles or async_op:  # else a synchronous call ran within its launch: its hooks hear of its end only
            call.launched(handles)
            if async_op:
                return Work(op, seq, handles, finish, call)
        return call.settle(handles, finish)

    def _g(self, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        return self.group if group is None else group

    def barrier(self, group: dist.ProcessGroup | None = None, async_op: bool = False) -> Work[None] | None:
        """Block until every rank of ``group`` has entered the barrier."""
        group = self._g(group)
        require_init()
        return self._issue(
            "barrier",
            0,
            lambda blocking: handles_of(dist.barrier(group=group, async_op=not blocking)),
            lambda: None,
            async_op,
            group=group,
        )

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: str = "sum",
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
        label: str | None = None,
    ) -> torch.Tensor | Work[torch.Tensor]:
        """Reduce ``tensor`` over all ranks with ``op`` in place; returns it (or a Work).

        ``label`` names what is reduced (Lightning's ``sync_dist`` passes the logged key): with the hang watchdog
        running, ranks that reduce different labels at the same call fail naming both, even when the tensors alike
        pair up without a hang."""
        if group is None:
            group = self.group
        world = dist.group.WORLD  # read once: whether a process group exists, and what sequence numbers count on
        if world is None:
            require_init()
        red = REDUCE_OPS.get(op) if op != "avg" or tensor.is_floating_point() else None
        if red is None:
            red = check_reduce(op, tensor)  # raises for a bad op or dtype, naming the allowed ones (complex avg: fine)
        counter = self._counter
        if not async_op and not self._scopes and (counter is not None or not self._hooks):
            # the hot path of _issue's synchronous case, written out: no handle, no closure, no Call
            self._next_seq(group, None, world)
            if counter is None:
                dist.all_reduce(tensor, op=red, group=group)
                return tensor
            token = counter.begin("all_reduce", nbytes(tensor))
            try:
                dist.all_reduce(tensor, op=red, group=group)
            except BaseException:
                counter.end("all_reduce", token, False)
                raise
            counter.end("all_reduce", token, True)
            return tensor
        return self._issue(
            "all_reduce",
            nbytes(tensor),
            lambda blocking: handles_of(dist.all_reduce(tensor, op=red, group=group, async_op=not blocking)),
            lambda: tensor,
            async_op,
            group=group,
            like=tensor,
            detail=op,
            label=label,
        )

    def reduce(
        self,
        tensor: torch.Tensor,
        dst: int,
        op: str = "sum",
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> torch.Tensor | Work[torch.Tensor]:
        """Reduce ``tensor`` over the ranks of ``group`` into global rank ``dst``, in place on ``dst`` (other
        ranks' tensors are left unspecified, as in torch); ``avg`` is not a backend reduce op here: sum and
        divide. Returns the tensor (or a Work)."""
        group = self._g(group)
        require_init()
        check_rank("dst", dst, group)
        if op == "avg":
            raise ValueError("reduce supports op in ['sum', 'max', 'min'] (for an average, sum then divide); got 'avg'")
        red = check_reduce(op, tensor)
        return self._issue(
            "reduce",
            nbytes(tensor),
            lambda blocking: handles_of(dist.reduce(tensor, dst=dst, op=red, group=group, async_op=not blocking)),
            lambda: tensor,
            async_op,
            group=group,
            like=tensor,
            detail=f"{op} to {dst}",
        )

    def broadcast(
        self, value: Any, src: int = 0, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        """Broadcast from ``src``; returns the value.

        A tensor is broadcast in place (every rank passes a tensor of the same shape and dtype). Any
        other value is pickled on ``src``; the other ranks' argument is ignored (pass ``None``).
        """
        group = self._g(group)
        require_init()
        check_rank("src", src, group)
        if isinstance(value, torch.Tensor):
            return self._issue(
                "broadcast",
                nbytes(value),
                lambda blocking: handles_of(dist.broadcast(value, src=src, group=group, async_op=not blocking)),
                lambda: value,
                async_op,
                group=group,
                like=value,
                detail=f"from {src}",
            )
        return self.broadcast_object(value, src=src, group=group, async_op=async_op)

    def reduce_scatter(
        self, tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> torch.Tensor | Work[torch.Tensor]:
        """Reduce ``tensor`` (same shape on every rank) and return this rank's shard of dim 0.

        Shards have ``ceil(n / K)`` rows; the input is zero-padded to ``K * ceil(n / K)`` rows and the
        last shard(s) are trimmed, so rank r gets rows ``[r*c, min(n, (r+1)*c))`` (possibly empty).
        """
        group = self._g(group)
        require_init()
        red = check_reduce(op, tensor)
        world, rank = get_world_size(group), get_rank(group)
        n = tensor.shape[0] if tensor.dim() else 1
        flat = tensor.reshape(1) if tensor.dim() == 0 else tensor
        chunk = -(-n // world)
        send = padded(flat, chunk * world)
        out = send.new_empty((chunk, *flat.shape[1:]))
        keep = max(0, min(n, (rank + 1) * chunk) - rank * chunk)
        return self._issue(
            "reduce_scatter",
            nbytes(send),
            lambda blocking: handles_of(REDUCE_SCATTER_SINGLE(out, send, op=red, group=group, async_op=not blocking)),
            lambda: out[:keep],
            async_op,
            group=group,
            like=send,
            detail=op,
        )

    def send(
        self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> torch.Tensor | Work[torch.Tensor]:
        """Point-to-point send of ``tensor`` to global rank ``dst`` (counted as ``send`` bytes)."""
        group = self._g(group)
        require_init()
        check_rank("dst", dst, group)
        return self._issue(
            "send",
            nbytes(tensor),
            lambda blocking: [dist.isend(tensor, dst=dst, group=group)],
            lambda: tensor,
            async_op,
            group=group,
            peer=dst,
            like=tensor,
        )

    def recv(
        self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> torch.Tensor | Work[torch.Tensor]:
        """Point-to-point receive into ``tensor`` from global rank ``src`` (counted as ``recv`` bytes)."""
        group = self._g(group)
        require_init()
        check_rank("src", src, group)
        return self._issue(
            "recv",
            nbytes(tensor),
            lambda blocking: [dist.irecv(tensor, src=src, group=group)],
            lambda: tensor,
            async_op,
            group=group,
            peer=src,
            like=tensor,
        )
