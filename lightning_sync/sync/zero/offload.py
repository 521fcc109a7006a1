"""CPU offload of ZeRO's optimizer side (ZeRO-Offload: Ren et al., USENIX ATC 2021).

What lives where, for each flat parameter of a rank (Ψ/K elements in its shard):

* **host**: the fp32 master shard, its gradient and the optimizer state; the optimizer steps there, on the
  CPU. Every step the gradient arrives from the device into a buffer that becomes the master's ``.grad``, and
  the updated master leaves for the device through a staging copy in the compute dtype: those two buffers are
  pinned (page-locked) when CUDA is available, which makes the copies asynchronous DMA. The master and the
  optimizer state are never read or written by a copy, so they stay in ordinary host memory (locking their
  pages would only take them from the rest of the host).
* **device**: what is gathered and computed (a stage-3 unit's full parameters while it runs, the full
  parameters in stages 1/2), the full gradient until its reduce-scatter, the reduce-scatter's output, and
  this rank's shard in the compute dtype: the all-gather's source, refreshed once per step (DeepSpeed's
  ZeRO-Offload keeps the fp16 partition on the GPU the same way).

The copies, and what orders them on CUDA (one side stream per engine; :class:`HostOffload`):

* **gradient, device to host.** When a unit's reduce-scatter is issued, the side stream (not the CPU, not the
  compute stream) waits for it, converts the averaged shard to the master dtype and copies it into the flat's
  pinned gradient buffer: each unit's copy overlaps the next units' backward. Where the engine finishes a
  unit's reduce-scatter (before it issues the next one, or when backward ends), the compute stream waits for
  that reduce-scatter, as it does without offload, but not for the copy. When backward ends the CPU waits for
  the side stream, so norm clipping and the optimizer step read complete gradients.
* **shard, host to device.** Right after the optimizer step, every flat's updated master is copied (and cast
  to the compute dtype) into its pinned staging buffer, and from there into its device shard on the side
  stream, in flat order, each copy recording an event. The compute stream waits for a flat's event only where
  it issues that flat's all-gather: in stage 3 the prefetch during the previous unit's compute, long after
  the copy was issued.

What keeps this correct, by construction: every pinned buffer is allocated once per flat and reused; the
CPU writes a staging buffer only right after synchronizing the side stream, and never writes a buffer an
asynchronous copy reads otherwise (the optimizer writes the master, which no copy reads); the host reads
gradients only after the end-of-backward synchronization; the device tensors a side-stream copy reads (the
reduce-scatter's input and output) are recorded on the side stream, so the caching allocator does not hand
their memory to the compute stream before the copy has run; and a device shard is overwritten only after
the side stream waited for the compute stream, whose all-gathers from it have all been waited for by then
(stage 3 reshards after every backward, stages 1/2 wait for their all-gathers in the step).

On the CPU there is no stream: the same copies run synchronously, between tensors in the same memory, so every
value takes the same operations in the same order as without offload and training is bit-identical; what
changes is where the engine's accounting puts each byte (:meth:`~lightning_sync.sync.zero.engine.ZeroEngine.
memory_report`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["HostOffload", "OffloadedShard"]


class HostOffload:
    """One engine's offload: the side stream the copies run on, and the waits every flat shares.

    Args:
        device: the device the module computes on (its parameters' device).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.pin = torch.cuda.is_available()
        self.stream: Any = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._adds: list[tuple[torch.Tensor, torch.Tensor]] = []  # (master gradient, its addend), after the copies
        self.shards: list[OffloadedShard] = []

    @property
    def streamed(self) -> bool:
        """The copies are asynchronous, on a side stream (CUDA); else they run in place, synchronously."""
        return self.stream is not None

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat host buffer for the copies, pinned when CUDA is available."""
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=self.pin)

    def shard(self, shard: torch.Tensor, compute_dtype: torch.dtype) -> OffloadedShard:
        """Offload one flat's shard (on the device, in the master dtype): its master moves to the host."""
        out = OffloadedShard(self, shard, compute_dtype)
        self.shards.append(out)
        return out

    @contextmanager
    def side(self) -> Iterator[None]:
        """Run the block on the side stream (CUDA), else where it is."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def keep(self, *tensors: torch.Tensor | None) -> None:
        """Device tensors the side stream is about to read: their memory is not reused before it has."""
        if self.stream is not None:
            for t in tensors:
                if t is not None:
                    t.record_stream(self.stream)

    def record(self) -> Any:
        """A CUDA event at this point of the side stream (None without one)."""
        return None if self.stream is None else self.stream.record_event()

    def wait(self, event: Any) -> None:
        """The current stream waits for ``event`` (from :meth:`record`; None: nothing to wait for)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def add_later(self, target: torch.Tensor, addend: torch.Tensor) -> None:
        """Add ``addend`` (a copy still in flight) into ``target`` at the next :meth:`synchronize`."""
        self._adds.append((target, addend))

    def synchronize(self) -> None:
        """Wait for every copy issued so far, then add the gradients that arrived into existing ones."""
        if self.stream is not None:
            self.stream.synchronize()
        for target, addend in self._adds:
            target.add_(addend)
        self._adds.clear()

    def forget(self) -> None:
        """Drop the gradients still to be added (a failed step's): nothing waits for its copies."""
        self._adds.clear()

    def upload(self) -> None:
        """Copy every updated master shard to its device shard (after an optimizer step or a load)."""
        self.synchronize()  # no copy in flight still reads a master or staging buffer the CPU is about to write
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # gathers issued so far read the shards
        for s in self.shards:
            s.upload()


class OffloadedShard:
    """One flat parameter's offloaded state: the host master (an ``nn.Parameter`` the optimizer steps), its
    pinned gradient buffer, and the device shard in the compute dtype that the all-gathers read."""

    def __init__(self, owner: HostOffload, shard: torch.Tensor, compute_dtype: torch.dtype) -> None:
        self.owner = owner
        with torch.no_grad():
            self.master = nn.Parameter(shard.to("cpu", copy=True))
            self.device_shard = shard.to(compute_dtype, copy=True)
        self.staging = owner.host_empty(shard.numel(), compute_dtype)  # what the host-to-device copy reads
        self._grad: torch.Tensor | None = None  # the pinned gradient buffer, reused every step
        self._addend: torch.Tensor | None = None  # where a gradient lands that adds to an existing one
        self._ready: Any = None  # CUDA event: the device shard holds the latest master

    def _host_buffer(self, which: str) -> torch.Tensor:
        buffer = getattr(self, which)
        if buffer is None:
            buffer = self.owner.host_empty(self.master.numel(), self.master.dtype)
            setattr(self, which, buffer)
        return buffer

    def host_buffers(self) -> dict[str, list[torch.Tensor]]:
        """The host buffers besides the master, by what they hold (for the memory accounting): the compute-dtype
        staging copy of the master (``"params"``), the gradient buffers (``"grads"``; allocated once, they stay
        when the optimizer sets the master's gradient to None)."""
        return {
            "params": [self.staging],
            "grads": [t for t in (self._grad, self._addend) if t is not None],
        }

    def upload(self) -> None:
        """Copy the master into the device shard; on CUDA asynchronously, on the side stream (see module)."""
        with torch.no_grad():
            self.staging.copy_(self.master.detach())  # cast on the host: the copy moves compute-dtype bytes
            with self.owner.side():
                self.device_shard.copy_(self.staging, non_blocking=True)
            self._ready = self.owner.record()

    def reset(self, shard: torch.Tensor) -> None:
        """Another layout's shard (on the device, in the master dtype): the master and every buffer take its size."""
        with torch.no_grad():
            self.master.data = shard.to("cpu", copy=True)
            self.device_shard = shard.to(self.device_shard.dtype, copy=True)
        self.staging = self.owner.host_empty(shard.numel(), self.device_shard.dtype)
        self._grad = self._addend = None
        self._ready = None

    def gather_source(self) -> torch.Tensor:
        """The device shard, once its latest copy has landed (for the stream that issues the all-gather)."""
        self.owner.wait(self._ready)
        return self.device_shard

    def take_grad(self, shard: torch.Tensor) -> None:
        """Move an averaged gradient shard (device, master dtype) into the master's gradient on the host.

        Called on the side stream (CUDA), ``shard`` kept for it (:meth:`HostOffload.keep`): the copy is
        asynchronous; :meth:`HostOffload.synchronize` makes it visible. A gradient that adds to an existing one
        lands in a second buffer and is added then."""
        with torch.no_grad():
            if self.master.grad is None:
                grad = self._host_buffer("_grad")
                grad.copy_(shard, non_blocking=True)
                self.master.grad = grad
                return
            addend = self._host_buffer("_addend").copy_(shard, non_blocking=True)
            if not self.owner.streamed:
                self.master.grad.add_(addend)
            else:
                self.owner.add_later(self.master.grad, addend)
