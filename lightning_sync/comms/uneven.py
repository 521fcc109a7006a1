"""Collectives of uneven tensors and of picklable objects, as methods of a
:class:`~lightning_sync.comms.context.CommContext`.

gloo has no uneven all-gather: sizes and shapes are exchanged first (counted as ``metadata``), inputs padded to
the largest and trimmed after. Mismatched trailing shapes or dtypes raise a ``ValueError`` on *every* rank
instead of hanging. Objects are pickled into a uint8 tensor, so their payload is counted in bytes and can run
async.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_sync.comms.even import EvenCollectives
from lightning_sync.comms.payload import (
    check_rank,
    device_of,
    from_bytes,
    get_rank,
    get_world_size,
    handles_of,
    nbytes,
    padded,
    require_init,
    shape_row,
    to_bytes,
)
from lightning_sync.comms.work import Work

__all__ = ["UnevenCollectives"]


class UnevenCollectives(EvenCollectives):
    """Uneven and object collectives, on the even ones and the ``_issue`` of :class:`Collectives`."""

    def _metadata_all_gather(self, row: list[int], group: dist.ProcessGroup | None) -> list[list[int]]:
        """All-gather one small int64 row per rank (sizes, shapes); counted as ``metadata``."""
        mine = torch.tensor(row, dtype=torch.int64, device=device_of(group))
        out = [torch.empty_like(mine) for _ in range(get_world_size(group))]
        return self._issue(
            "metadata",
            nbytes(mine),
            lambda blocking: handles_of(dist.all_gather(out, mine, group=group, async_op=not blocking)),
            lambda: [r.tolist() for r in out],
            async_op=False,
            group=group,
            like=mine,
        )

    def _broadcast_size(self, n: int | None, src: int, group: dist.ProcessGroup | None) -> int:
        """Broadcast one int from ``src`` as an int64 tensor (counted as ``metadata``)."""
        box = torch.tensor([-1 if n is None else n], dtype=torch.int64, device=device_of(group))
        return self._issue(
            "metadata",
            nbytes(box),
            lambda blocking: handles_of(dist.broadcast(box, src=src, group=group, async_op=not blocking)),
            lambda: int(box.item()),
            async_op=False,
            group=group,
            detail=f"from {src}",
        )

    def _broadcast_pickled(self, value: Any, src: int, group: dist.ProcessGroup | None, op: str, async_op: bool) -> Any:
        """Broadcast any picklable ``value`` from ``src``: its length (``metadata``), then its bytes (``op``).

        Asynchronous backend calls, unlike ``broadcast_object_list``, so the hang watchdog can interrupt a wait."""
        device = device_of(group)
        payload = to_bytes(value, device) if get_rank() == src else None
        size = self._broadcast_size(None if payload is None else payload.numel(), src, group)
        buf = payload if payload is not None else torch.empty(size, dtype=torch.uint8, device=device)
        return self._issue(
            op,
            size,
            lambda blocking: handles_of(dist.broadcast(buf, src=src, group=group, async_op=not blocking)),
            lambda: value if payload is not None else from_bytes(buf),
            async_op,
            group=group,
            detail=f"object from {src}",
        )

    def _metadata_broadcast(self, obj: Any, src: int, group: dist.ProcessGroup | None) -> Any:
        """Broadcast a small picklable header from ``src`` (both its messages counted as ``metadata``)."""
        return self._broadcast_pickled(obj, src, group, "metadata", async_op=False)

    def _exchange_shapes(self, t: torch.Tensor, op: str, group: dist.ProcessGroup | None) -> list[torch.Size]:
        """Every rank's shape; raises on all ranks alike if dtype or trailing dims disagree."""
        rows = self._metadata_all_gather(shape_row(t), group)
        shapes = [torch.Size(r[2 : 2 + r[1]]) for r in rows]
        ref = rows[get_rank(group)]
        for rank, (row, shape) in enumerate(zip(rows, shapes)):
            if row[0] != ref[0] or row[1] != ref[1] or (ref[1] > 0 and shape[1:] != shapes[get_rank(group)][1:]):
                raise ValueError(
                    f"{op}: ranks disagree on dtype or trailing shape; only the first dimension may differ. "
                    f"Shapes by rank: {[tuple(s) for s in shapes]}, dtype codes: {[r[0] for r in rows]} "
                    f"(rank {rank} differs from this rank)"
                )
        return shapes

    def broadcast_object(
        self, value: Any, src: int = 0, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        """Broadcast any picklable value (tensors included, any shape) from ``src``; returns it.

        Unlike :func:`broadcast`, the path never depends on the local argument's type, so ranks may
        pass anything (``None``) on non-src ranks even when ``src`` sends a tensor.
        """
        group = self._g(group)
        require_init()
        check_rank("src", src, group)
        return self._broadcast_pickled(value, src, group, "broadcast", async_op)

    def all_gather(
        self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> list[torch.Tensor] | Work[list[torch.Tensor]]:
        """One tensor per rank, in rank order. First dimensions may differ between ranks."""
        group = self._g(group)
        require_init()
        flat = tensor.reshape(1) if tensor.dim() == 0 else tensor
        shapes = self._exchange_shapes(flat, "all_gather", group)
        rows = max(s[0] for s in shapes)
        send = padded(flat, rows)
        bufs = [torch.empty_like(send) for _ in shapes]

        def finish() -> list[torch.Tensor]:
            out = [b[: s[0]] for b, s in zip(bufs, shapes)]
            return [o.reshape(()) for o in out] if tensor.dim() == 0 else out

        return self._issue(
            "all_gather",
            nbytes(send),
            lambda blocking: handles_of(dist.all_gather(bufs, send, group=group, async_op=not blocking)),
            finish,
            async_op,
            group=group,
            like=send,
        )

    def gather(
        self,
        tensor: torch.Tensor,
        gather_list: list[torch.Tensor] | None = None,
        dst: int = 0,
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        """Gather every rank's ``tensor`` on ``dst`` (first dims may differ).

        On ``dst`` the result is ``gather_list`` filled in place (if given, its tensors must have the
        gathered shapes) or a new list; on other ranks it is ``None``.
        """
        group = self._g(group)
        require_init()
        check_rank("dst", dst, group)
        flat = tensor.reshape(1) if tensor.dim() == 0 else tensor
        shapes = self._exchange_shapes(flat, "gather", group)
        send = padded(flat, max(s[0] for s in shapes))
        on_dst = get_rank() == dst
        bufs = [torch.empty_like(send) for _ in shapes] if on_dst else None

        def finish() -> list[torch.Tensor] | None:
            # gather_list is checked only after the collective, so a bad one on dst never strands the others
            if bufs is None:
                return None
            out = [b[: s[0]].reshape(s if tensor.dim() else ()) for b, s in zip(bufs, shapes)]
            if gather_list is None:
                return out
            if len(gather_list) != len(out):
                raise ValueError(
                    f"gather: gather_list has {len(gather_list)} tensors but the group has {len(out)} ranks"
                )
            for r, (g, o) in enumerate(zip(gather_list, out)):
                if g.shape != o.shape:
                    raise ValueError(
                        f"gather: gather_list[{r}] has shape {tuple(g.shape)}, rank {r} sent {tuple(o.shape)}"
                    )
                g.copy_(o)
            return gather_list

        return self._issue(
            "gather",
            nbytes(send),
            lambda blocking: handles_of(
                dist.gather(send, gather_list=bufs, dst=dst, group=group, async_op=not blocking)
            ),
            finish,
            async_op,
            group=group,
            like=send,
            detail=f"to {dst}",
        )

    def scatter(
        self, chunks: Sequence[Any] | None, src: int = 0, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        """Send ``chunks[r]`` from ``src`` to rank r; returns this rank's chunk.

        Chunks are tensors (any shapes, one dtype) or any picklable objects. Only ``src``'s ``chunks``
        are read; other ranks pass ``None``. A wrong chunk count raises on every rank.
        """
        group = self._g(group)
        require_init()
        check_rank("src", src, group)
        world, device = get_world_size(group), device_of(group)
        meta: Any = None
        if get_rank() == src:
            if chunks is None or len(chunks) != world:
                got = "None" if chunks is None else f"{len(chunks)} chunks"
                meta = (
                    "error",
                    f"scatter: src rank {src} passed {got}, but the world size is {world}; "
                    "pass exactly one chunk per rank",
                )
            elif all(isinstance(c, torch.Tensor) for c in chunks):
                dtypes = {c.dtype for c in chunks}
                meta = ("tensor", [tuple(c.shape) for c in chunks], str(next(iter(dtypes))))
                if len(dtypes) > 1:
                    meta = ("error", f"scatter: tensor chunks must share one dtype, got {sorted(map(str, dtypes))}")
                flats = [c.reshape(-1) for c in chunks]
            else:
                flats = [to_bytes(c, device) for c in chunks]
                meta = ("object", [(f.numel(),) for f in flats], "torch.uint8")
        meta = self._metadata_broadcast(meta, src, group)
        if meta[0] == "error":
            raise ValueError(meta[1])
        kind, shapes, dtype_name = meta
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        numel = max((int(torch.Size(s).numel()) for s in shapes), default=0)
        mine = shapes[get_rank(group)]
        recv = torch.empty(numel, dtype=dtype, device=device)
        send = [padded(f.to(device), numel) for f in flats] if get_rank() == src else None

        def finish() -> Any:
            part = recv[: torch.Size(mine).numel()]
            return part.reshape(mine) if kind == "tensor" else from_bytes(part)

        return self._issue(
            "scatter",
            nbytes(recv),
            lambda blocking: handles_of(
                dist.scatter(recv, scatter_list=send, src=src, group=group, async_op=not blocking)
            ),
            finish,
            async_op,
            group=group,
            like=recv,
            detail=f"from {src}",
        )

    def all_gather_object(self, obj: Any, group: dist.ProcessGroup | None = None, async_op: bool = False) -> Any:
        """Every rank's picklable ``obj``, in rank order."""
        group = self._g(group)
        require_init()
        work = self.all_gather(to_bytes(obj, device_of(group)), group=group, async_op=True)
        chained = work.then(lambda parts: [from_bytes(p) for p in parts])
        return chained if async_op else chained.wait()

    def gather_object(
        self, obj: Any, dst: int = 0, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        """Every rank's picklable ``obj`` as a list on ``dst``; ``None`` elsewhere."""
        group = self._g(group)
        require_init()
        work = self.gather(to_bytes(obj, device_of(group)), dst=dst, group=group, async_op=True)
        chained = work.then(lambda parts: None if parts is None else [from_bytes(p) for p in parts])
        return chained if async_op else chained.wait()
