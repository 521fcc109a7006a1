"""The one backward engine: grad-ready hook -> bucket -> asynchronous launch -> wait before the step.

Data-parallel training hides communication behind backward by reducing gradients in buckets as soon
as every gradient of a bucket is ready (Li et al., "PyTorch Distributed", VLDB 2020). The skeleton
is the same whatever the collective is, so it is written once here and an engine plugs in only what
differs:

* :class:`~lightning_sync.sync.bucketing.GradBucketer` (DDP) launches an all-reduce per bucket (or its
  compressor's scheme) and leaves each ``param.grad`` as the averaged bucket view;
* :class:`~lightning_sync.sync.zero.engine.ZeroEngine` (ZeRO) launches a reduce-scatter per unit into
  the fp32 master shards, and frees a stage-3 unit's full parameters once its gradients are in.

The skeleton, per backward:

1. a post-accumulate-grad hook on each parameter hands its gradient to the engine
   (:meth:`BackwardEngine._store`) and marks it ready; the first hook of a backward queues an autograd
   callback that runs when backward ends;
2. when a bucket's last parameter is ready the bucket is complete, and every complete bucket at the
   head of the launch order is launched (buckets launch in one fixed order on every rank, which is
   what matches the collectives across ranks);
3. the end-of-backward callback lets the engine fill what never got a gradient (so no peer waits
   forever in a collective), completes and launches the rest, and waits for every bucket, so the
   gradients are reduced before the optimizer step.

Inside :meth:`SyncSwitch.no_sync` nothing is launched and gradients accumulate locally; the next
synchronized backward reduces the sums. When a rank fails mid-step its peers block in that bucket's
collective until the process group times out or notices the dead peer; nothing here retries.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

__all__ = ["UNUSED_PARAMETERS", "BackwardEngine", "SyncSwitch"]

UNUSED_PARAMETERS = (
    "It looks like your LightningModule has parameters that were not used in producing the loss "
    "returned by training_step."
)
"""The first sentence of an engine's error for trainable parameters without a gradient: Lightning's own for
this failure under ``strategy="ddp"`` (``DDPStrategy.on_exception``), verbatim, since it is what users search for."""


class SyncSwitch:
    """``no_sync()``: backward passes inside it accumulate locally and issue no collective."""

    _sync: bool = True

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally and issue no collective."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous


class BackwardEngine(SyncSwitch):
    """The hook/bucket/launch/wait state machine; subclasses plug in the collective (module docstring).

    A subclass calls :meth:`_init_backward` once with the parameters it synchronizes, and
    :meth:`_set_buckets` whenever it (re)plans its buckets; it implements :meth:`_store`,
    :meth:`_launch` and :meth:`_wait`, and may override the other ``_on_*`` / ``_fill_late`` /
    ``_after_backward`` steps, which do nothing here.
    """

    _engage_in_no_sync = False
    """Whether the hooks run inside ``no_sync`` too: an engine whose parameters cannot hold their own
    gradients (ZeRO moves them into flat buffers) must see every gradient; DDP leaves them in place."""
    _overlap = True
    """Launch buckets during backward; False launches them all when backward ends (ZeRO stage 1)."""

    def _init_backward(self, params: Sequence[torch.Tensor]) -> None:
        """Register the grad-ready hooks on ``params`` (each once); their order defines parameter indices."""
        n = len(params)
        self._index = {id(p): i for i, p in enumerate(params)}
        self._sync = True
        self._in_backward = False
        self._used = [False] * n  # got a gradient in this accumulation window
        self._ready = [False] * n  # got its gradient in this backward
        self._ready_order: list[int] = []
        self._order_known = False  # the first synchronized backward's ready order is recorded
        self._bucket_of = [0] * n
        self._bucket_sizes: list[int] = []
        self._pending: list[int] = []
        self._complete: list[bool] = []
        self._launch_order: list[int] = []
        self._next_launch = 0
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def _set_buckets(self, bucket_of: Sequence[int], num_buckets: int, launch_order: Sequence[int]) -> None:
        """Parameter index -> bucket index, and the order buckets launch in (every bucket once)."""
        self._bucket_of = list(bucket_of)
        sizes = [0] * num_buckets
        for b in self._bucket_of:
            sizes[b] += 1
        self._bucket_sizes = sizes
        self._pending = list(sizes)
        self._complete = [False] * num_buckets
        self._launch_order = list(launch_order)

    def abort_backward(self) -> None:
        """Forget a backward that failed part way (a peer lost mid-collective): the next one starts afresh."""
        self._in_backward = False
        self._used = [False] * len(self._used)

    def _remove_grad_hooks(self) -> None:
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []

    def _is_complete(self, bucket: int) -> bool:
        """Every parameter of ``bucket`` has its gradient in this backward (or backward ended)."""
        return self._complete[bucket]

    # ------------------------------------------------------------------ the skeleton
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        i = self._index[id(p)]
        self._used[i] = True
        if not (self._sync or self._engage_in_no_sync):
            return
        if not self._in_backward:
            self._begin_backward()
        self._store(i, p)
        if not self._ready[i]:
            self._ready[i] = True
            if self._sync and not self._order_known:
                self._ready_order.append(i)
            b = self._bucket_of[i]
            self._pending[b] -= 1
            if self._pending[b] == 0:
                self._bucket_done(b)

    def _begin_backward(self) -> None:
        self._in_backward = True
        self._next_launch = 0
        self._ready = [False] * len(self._ready)
        self._pending = list(self._bucket_sizes)
        self._complete = [False] * len(self._bucket_sizes)
        self._on_begin_backward()
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _bucket_done(self, b: int) -> None:
        self._complete[b] = True
        self._on_bucket_complete(b)
        if self._sync and self._overlap:
            self._launch_in_order()

    def _launch_in_order(self) -> None:
        order = self._launch_order
        while self._next_launch < len(order) and self._complete[order[self._next_launch]]:
            self._launch(order[self._next_launch])
            self._next_launch += 1

    def _finalize(self) -> None:
        self._in_backward = False
        self._on_backward_end()
        self._fill_late([i for i, r in enumerate(self._ready) if not r])
        for b, done in enumerate(self._complete):
            if not done:  # parameters without a gradient this backward count as zero gradients
                self._bucket_done(b)
        synced = self._sync
        if synced:
            self._launch_in_order()
            for b in self._launch_order:
                self._wait(b)
            self._order_known = True
        self._complete = [False] * len(self._bucket_sizes)  # the next backward's pre-hooks read it
        try:
            self._after_backward(synced)
        finally:
            if synced:
                self._used = [False] * len(self._used)

    # ------------------------------------------------------------------ what an engine plugs in
    def _store(self, index: int, p: torch.Tensor) -> None:
        """Take parameter ``index``'s gradient (``p.grad``) into its bucket."""
        raise NotImplementedError

    def _launch(self, bucket: int) -> None:
        """Issue ``bucket``'s asynchronous collective."""
        raise NotImplementedError

    def _wait(self, bucket: int) -> None:
        """Wait for ``bucket``'s collective and put its result where the optimizer reads it."""
        raise NotImplementedError

    def _on_begin_backward(self) -> None:
        """The first gradient of a backward arrived."""

    def _on_bucket_complete(self, bucket: int) -> None:
        """Every parameter of ``bucket`` is ready, before it is launched."""

    def _on_backward_end(self) -> None:
        """Autograd finished; nothing is filled, launched or waited for yet."""

    def _fill_late(self, late: list[int]) -> None:
        """Parameters that got no gradient in this backward (so their buckets can still be reduced)."""

    def _after_backward(self, synced: bool) -> None:
        """Every bucket is reduced (``synced``) or the window goes on (inside ``no_sync``)."""
