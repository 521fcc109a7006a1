"""One ZeRO flat parameter: a group of parameters flattened, sharded, gathered and reduced together.

The layout is a :class:`~lightning_sync.sync.flat.FlatShard` over the ranks; this class holds the
buffers that live in that layout during training and issues the two collectives of sharded training
on them (all-gather of the parameters, reduce-scatter of the gradients).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_sync.sync.communicator import Communicator
from lightning_sync.sync.flat import FlatShard

if TYPE_CHECKING:
    from lightning_sync.sync.zero.offload import HostOffload, OffloadedShard

__all__ = ["FlatParam", "gather_full_params", "launch_reduces", "start_gathers"]


class FlatParam:
    """The parameters of one unit that share an optimizer group and a dtype, flattened and sharded.

    Holds the fp32 *master shard* (an ``nn.Parameter`` the optimizer steps), the full flat buffer in
    ``compute_dtype`` while it is gathered (always in stages 1 and 2, where the module's parameters
    are views into it), and the full flat gradient in ``reduce_dtype`` while one is being accumulated.
    With ``compute_dtype == master dtype`` in stages 1/2 the master shard *is* this rank's slice of the
    full buffer (no second copy); in stage 1 the master's gradient is likewise this rank's slice of
    the full gradient buffer.

    ``packed``, when given, is the padded flat buffer the parameters already are views of (deferred
    initialization materializes them there, :mod:`~lightning_sync.sync.zero.materialize`): it is used as it
    is, where otherwise the parameters are copied into a new one.

    With ``offload`` (:mod:`~lightning_sync.sync.zero.offload`) the master shard and its gradient live on the
    host instead, never aliased: the all-gathers read a device copy of the shard in ``compute_dtype``, and
    each averaged gradient shard is copied to the host.
    """

    def __init__(
        self,
        names: list[str],
        params: list[nn.Parameter],
        group: int,
        comm: Communicator,
        compute_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        stage: int,
        packed: torch.Tensor | None = None,
        offload: HostOffload | None = None,
    ) -> None:
        self.names, self.params, self.group, self.comm, self.stage = names, params, group, comm, stage
        self.layout = FlatShard([p.shape for p in params], comm.world_size, comm.rank)
        self.orig_dtype = params[0].dtype
        self.compute_dtype = compute_dtype or self.orig_dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        self.master_dtype = torch.float64 if self.orig_dtype == torch.float64 else torch.float32
        self.device = params[0].device
        self.full: torch.Tensor | None = None
        self.grad_full: torch.Tensor | None = None
        self._gather_work: Any = None
        self._gather_src: torch.Tensor | None = None
        self._reduce: tuple[torch.Tensor, Any] | None = None
        self._touched: set[int] = set()  # parameters whose gradient is in grad_full this window
        # stage 3: the full buffer last gathered into. While resharded its storage is freed (resized to 0), not
        # dropped: autograd keeps views of the parameters saved in forward (a Linear saves its weight's
        # transpose), which would otherwise keep every unit's full parameters alive until backward; the gather
        # before backward refills the same storage, so those views read the parameters again
        self._storage: torch.Tensor | None = None
        self.host = offload  # the engine's offload (its side stream), or None: the master stays on the device
        self._offloaded: OffloadedShard | None = None
        self._reduced: Any = None  # offload on a side stream: CUDA event, the reduce-scatter has completed
        self._orphans: list[Any] = []  # what aborted collectives had in flight, until their group is gone
        with torch.no_grad():
            flat = packed if packed is not None else self.layout.flatten([p.detach() for p in params])
            if stage < 3:
                self.full = flat.to(self.compute_dtype)
                self._point_params(self.full)
            aliased = stage < 3 and offload is None and self.compute_dtype == self.master_dtype
            shard = self.layout.shard(self.full if aliased else flat)
            if offload is not None:
                self._offloaded = offload.shard(shard.to(self.master_dtype), self.compute_dtype)
                self.master = self._offloaded.master
            else:
                self.master = nn.Parameter(shard if aliased else shard.to(self.master_dtype).clone())
            if stage == 3:
                self.free()

    # ------------------------------------------------------------------ parameters
    @property
    def aliased(self) -> bool:
        """The master shard shares storage with the full buffer (stages 1/2, compute dtype = master's, no offload)."""
        return (
            self.full is not None
            and self.stage < 3
            and self._offloaded is None
            and self.compute_dtype == self.master_dtype
        )

    def _gather_source(self) -> torch.Tensor:
        """This rank's shard in the compute dtype, on the device: what the all-gathers send."""
        if self._offloaded is not None:
            return self._offloaded.gather_source()
        src = self.master.detach()
        if self.aliased:
            return src.clone()  # the all-gather writes the full buffer this shard is a slice of
        return src if src.dtype == self.compute_dtype else src.to(self.compute_dtype)

    def _point_params(self, full: torch.Tensor) -> None:
        for p, view in zip(self.params, self.layout.views(full)):
            p.data = view

    def free(self) -> None:
        """Drop the full parameters (stage 3); the module's parameters become empty tensors."""
        if self.full is not None and self.stage == 3:
            self._storage = self.full
            self.full.untyped_storage().resize_(0)
        self.full = None
        with torch.inference_mode(False):  # never an inference tensor, even when freed during validation
            empty = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        for p in self.params:
            p.data = empty

    def start_gather(self) -> None:
        """Issue the all-gather of the master shards into the full buffer (stage 3, async)."""
        start_gathers([self], self.comm)

    def _prepare_gather(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Give the full buffer its storage back; ``(buffer, shard to send)``, or None when this flat is gathered
        or its gather is in flight."""
        if self.full is not None or self._gather_work is not None:
            return None
        with torch.inference_mode(False), torch.no_grad():
            self._gather_src = self._gather_source()
            buffer = self._storage
            if buffer is None:
                buffer = torch.empty(self.layout.padded, dtype=self.compute_dtype, device=self.device)
            else:
                buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
        return buffer, self._gather_src

    def finish_gather(self) -> None:
        """Wait for the all-gather and point the parameters at the full buffer."""
        if self._gather_work is None:
            return
        buffer, work = self._gather_work
        work.wait()
        self._gather_work, self._gather_src = None, None
        with torch.inference_mode(False):
            self.full = buffer
            self._point_params(buffer)

    def refresh_full(self) -> Any:
        """Stages 1/2 after a step: all-gather the updated master shards into the full buffer (async)."""
        assert self.full is not None
        with torch.no_grad():
            self._gather_src = self._gather_source()
        return self.comm.all_gather_into(self.full, self._gather_src, async_op=True)

    def abort(self) -> None:
        """Forget what a failed step left in flight (nothing is waited for): gathers, reduce-scatters and the window's
        gradients; stage 3 frees the full parameters. Until its group is torn down, the backend may still write what
        peers send into the buffers in flight, or read the ones it sends: they stay referenced until
        :meth:`relayout`, which runs once that group is gone."""
        held = (self._gather_work, self._gather_src, self._reduce, self.grad_full, self._storage)
        self._orphans.extend(t for t in held if t is not None)
        self._gather_work = self._gather_src = self._reduce = self._reduced = None
        self.grad_full, self._touched = None, set()
        self.master.grad = None
        if self.stage == 3:
            self._storage = None  # kept among the orphans: a new buffer for the next gather
            self.free()

    def relayout(self, layout: FlatShard, full: torch.Tensor) -> None:
        """Take ``layout`` (another number of ranks, or another rank) with ``full`` as the values: the padded flat
        tensor in the master dtype, on the device. The master keeps its identity (the optimizer's groups and state
        are keyed by it); its data becomes this rank's new shard. Nothing may be in flight on a live group (a
        gathered flat is waited for and resharded first, :meth:`ZeroEngine.reshard`): what a failed step left in
        flight belonged to a group torn down since, so its buffers go now."""
        self.abort()
        self._orphans.clear()
        self.layout, self._storage = layout, None
        with torch.no_grad():
            if self.stage < 3:
                self.full = full.to(self.compute_dtype, copy=True)
                self._point_params(self.full)
            shard = layout.shard(full)
            if self._offloaded is not None:
                self._offloaded.reset(shard)
            elif self.aliased:
                assert self.full is not None
                self.master.data = layout.shard(self.full)
            else:
                self.master.data = shard.to(self.master_dtype, copy=True)

    # ------------------------------------------------------------------ gradients
    def _grad_buffer(self) -> torch.Tensor:
        if self.grad_full is None:  # uninitialised: each parameter's first gradient is copied in
            self.grad_full = torch.empty(self.layout.padded, dtype=self.reduce_dtype, device=self.device)
            self._touched = set()
        return self.grad_full

    def accumulate(self, index: int, grad: torch.Tensor) -> None:
        """Add parameter ``index``'s gradient into the full flat gradient (copy on its first gradient
        of the accumulation window, so the buffer is never cleared as a whole)."""
        view = self.layout.view(self._grad_buffer(), index)
        if index in self._touched:
            view.add_(grad.reshape(-1))
        else:
            view.copy_(grad.reshape(-1))
            self._touched.add(index)

    def complete_grad(self) -> torch.Tensor:
        """The full gradient, with zeros where no gradient arrived this window and in the padding."""
        buffer = self._grad_buffer()
        for i, (off, n) in enumerate(zip(self.layout.offsets, self.layout.numels)):
            if i not in self._touched:
                buffer[off : off + n].zero_()
                self._touched.add(i)
        buffer[self.layout.total :].zero_()
        return buffer

    def _reduce_issued(self, out: torch.Tensor, work: Any) -> None:
        self._reduce = (out, work)
        if self.host is not None and self.host.streamed:
            self.finish_reduce()  # the side stream waits for it and copies it out; the CPU and compute go on

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter; add the averaged shard to the master's gradient. Stage 1 keeps
        the full gradient buffer (the master's gradient is its slice); stages 2/3 free it. With offload
        on a side stream this ran when the reduce-scatter was issued; here the calling (compute) stream only
        waits for the reduce-scatter, as it does without offload, so its input's memory is free for reuse."""
        if self._reduce is None and self.host is not None:
            self.host.wait(self._reduced)
            self._reduced = None
            return
        assert self._reduce is not None and self.grad_full is not None
        out, work = self._reduce
        self._reduce = None
        if self.host is not None:
            self.host.keep(out, self.grad_full)  # read on the side stream, allocated on the compute stream
        with torch.no_grad(), self.host.side() if self.host is not None else nullcontext():
            work.wait()
            if self.host is not None:
                self._reduced = self.host.record()
            if self.stage == 1:
                own = self.layout.shard(self.grad_full)
                own.copy_(out)
                shard = own if own.dtype == self.master_dtype else own.to(self.master_dtype)
            else:
                shard = out if out.dtype == self.master_dtype else out.to(self.master_dtype)
                self.grad_full = None
            if self._offloaded is not None:
                self._offloaded.take_grad(shard)
                return
            master_grad = self.master.grad
            if master_grad is None or master_grad.data_ptr() == shard.data_ptr():
                self.master.grad = shard
            else:
                master_grad.add_(shard)

    def start_window(self) -> None:
        """A new accumulation window: every parameter's next gradient is copied, not added (stage 1
        keeps its full gradient buffer between steps). A stage-1 master gradient still in that buffer (two
        synchronized backwards before a step, as manual optimization may run) moves out of it first, so the
        window's reduce-scatter adds to it instead of overwriting it."""
        self._touched = set()
        grad = self.master.grad
        if (
            self.stage == 1
            and grad is not None
            and self.grad_full is not None
            and _shares_storage(grad, self.grad_full)
        ):
            self.master.grad = grad.clone()


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def start_gathers(flats: Sequence[FlatParam], comm: Communicator) -> None:
    """Stage 3: issue the all-gathers of those of ``flats`` not gathered and not in flight, as one call (a rank
    then waits once for all of them)."""
    todo = [(f, args) for f in flats if (args := f._prepare_gather()) is not None]
    if not todo:
        return
    buffers = [buffer for _, (buffer, _) in todo]
    with torch.inference_mode(False), torch.no_grad(), ExitStack() as stack:
        for buffer in buffers:
            # autograd's saved views must not see this write as an in-place change: their values are the same
            stack.enter_context(torch.autograd._unsafe_preserve_version_counter(buffer))
        work = comm.all_gather_into_coalesced(buffers, [src for _, (_, src) in todo], async_op=True)
    for f, (buffer, _) in todo:
        f._gather_work = (buffer, work)


def launch_reduces(flats: Sequence[FlatParam], comm: Communicator) -> None:
    """Issue the averaging reduce-scatters of ``flats``' full gradients into their shards, as one call (async)."""
    outs = [torch.empty(f.layout.shard_numel, dtype=f.reduce_dtype, device=f.device) for f in flats]
    work = comm.reduce_scatter_into_coalesced(outs, [f.complete_grad() for f in flats], op="avg", async_op=True)
    for f, out in zip(flats, outs):
        f._reduce_issued(out, work)


def gather_full_params(flats: Sequence[FlatParam], comm: Communicator) -> dict[str, torch.Tensor]:
    """Canonical name -> full parameter in its original dtype, all-gathered from ``flats``' master shards (full
    precision whatever the compute dtype is); a collective, one all-gather a flat, all in flight together."""
    issued = []
    for f in flats:
        buffer = torch.empty(f.layout.padded, dtype=f.master_dtype, device=f.device)
        source = f.master.detach().to(f.device)  # an offloaded master is on the host
        issued.append((f, buffer, comm.all_gather_into(buffer, source, async_op=True)))
    out: dict[str, torch.Tensor] = {}
    for f, buffer, work in issued:
        work.wait()
        for name, view in zip(f.names, f.layout.views(buffer)):
            out[name] = view.to(f.orig_dtype, copy=True)
    return out
