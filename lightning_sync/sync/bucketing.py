"""Gradient bucketing with backward overlap: torch DDP's Reducer, written out.

What is synchronized, and when (Li et al., "PyTorch Distributed", VLDB 2020):

1. **Plan.** Parameters that require grad (each tied/shared tensor once) are walked in *reverse*
   registration order, roughly the order backward produces their gradients, and packed into
   buckets that close once they hold ``bucket_cap_mb`` (the first ``first_bucket_mb``, so
   communication starts early). A bucket holds one dtype on one device and is one flat buffer; a
   parameter is never split, so the one that closes a bucket may take it past the cap (as in torch).
   With ``gradient_as_bucket_view`` every ``param.grad`` *is*
   a view into its bucket, so gradients are never copied into or out of a bucket.
2. **Overlap.** A post-accumulate-grad hook marks each parameter ready once its gradient for this
   backward is complete. When a bucket's last parameter is ready, its asynchronous all-reduce
   (average, or a compressor's scheme) starts at once, while backward continues. Buckets launch in
   index order. The first hook of a backward queues an autograd callback that runs when backward
   ends; it launches what is left and waits for every bucket, so gradients are averaged before the
   optimizer step. That skeleton is :class:`~lightning_sync.sync.backward.BackwardEngine`, shared with
   ZeRO; a bucket's buffer and views are a :class:`~lightning_sync.sync.flat.FlatShard` of one shard.
3. **Rebuild.** The first synchronized backward records the order in which gradients became ready.
   Before the next backward the buckets are re-planned in that order; rank 0's order is broadcast so
   every rank builds the same buckets. :meth:`GradBucketer.state_dict` carries the order, so a run
   resumed from a checkpoint re-plans the same buckets before its first backward.
4. **Unused parameters.** A parameter that got no gradient is zero-filled so the bucket can still
   be reduced (no peer is left waiting in a collective). With ``find_unused_parameters=True`` that
   is the intended behaviour, and one extra all-reduce of a "used" bitmap finds the parameters no
   rank used, whose ``.grad`` is left ``None`` as in a single process. With it False, the step
   completes its collectives and then raises, naming the parameters that received no gradient.
5. **Accumulation.** Inside :meth:`GradBucketer.no_sync` hooks only note which parameters were
   used: gradients accumulate locally and no collective is issued. The next synchronized backward
   reduces the accumulated sums, one collective per bucket.

When a rank fails mid-step its peers block in that bucket's collective until the process group
times out or notices the dead peer ("connection closed"); nothing here retries.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_sync.sync.backward import UNUSED_PARAMETERS, BackwardEngine, SyncSwitch
from lightning_sync.sync.communicator import Communicator, WorkLike
from lightning_sync.sync.flat import FlatShard

__all__ = ["Bucket", "GradBucketer", "StepTrace", "SyncSwitch", "check_mib", "plan_buckets"]

_MB = 2**20


def check_mib(name: str, value: Any, zero: bool = False) -> float:
    """``value`` if it is a finite number of MiB > 0 (>= 0 with ``zero``), else a ValueError naming it."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not ((value >= 0 if zero else value > 0) and value < math.inf):
        raise ValueError(f"{name} must be a finite number {'>=' if zero else '>'} 0 (MiB), got {value!r}")
    return value


def plan_buckets(
    sizes: list[int], keys: list[Any], order: Iterable[int], cap_bytes: int, first_cap_bytes: int
) -> list[list[int]]:
    """Greedy bucket plan (torch DDP's ``_compute_bucket_assignment_by_size``).

    Walk ``order``; each (dtype, device) ``key`` has one open bucket; a bucket closes once it holds
    at least its limit in bytes (``first_cap_bytes`` for the first bucket closed, then
    ``cap_bytes``). A parameter is never split: one that reaches the limit on its own joins the open
    bucket of its key (alone if none is open) and closes it. Buckets are returned in the order they
    closed, so index 0 fills first.
    """
    if cap_bytes <= 0 or first_cap_bytes <= 0:
        raise ValueError(f"bucket caps must be > 0 bytes, got cap={cap_bytes}, first={first_cap_bytes}")
    open_buckets: dict[Any, tuple[list[int], int]] = {}
    closed: list[list[int]] = []
    for i in order:
        members, size = open_buckets.get(keys[i], ([], 0))
        members.append(i)
        size += sizes[i]
        limit = first_cap_bytes if not closed else cap_bytes
        if size >= limit:
            closed.append(members)
            open_buckets.pop(keys[i], None)
        else:
            open_buckets[keys[i]] = (members, size)
    closed.extend(members for members, _ in open_buckets.values())
    return closed


@dataclass
class Bucket:
    """One flat buffer holding the gradients of ``members`` (indices into the bucketer's params)."""

    index: int
    members: list[int]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    work: WorkLike | None = None
    layout: FlatShard | None = None
    """How ``buffer`` is cut into ``views`` (one shard: buckets are all-reduced, never split)."""


@dataclass
class StepTrace:
    """Timestamps (``time.perf_counter``) of the last synchronized backward."""

    launched_at: list[float | None] = field(default_factory=list)
    """When each bucket's collective was issued (index = bucket index)."""
    backward_end: float = 0.0
    """When autograd finished (the end-of-backward callback started)."""
    synced_at: float = 0.0
    """When every bucket's collective had completed."""

    @property
    def exposed_seconds(self) -> float:
        """Communication not hidden behind backward: waiting after backward ended."""
        return max(0.0, self.synced_at - self.backward_end)

    @property
    def launched_during_backward(self) -> int:
        """How many buckets were issued before backward ended."""
        return sum(1 for t in self.launched_at if t is not None and t < self.backward_end)


class GradBucketer(BackwardEngine):
    """Average gradients across ranks in buckets, overlapped with backward. See the module docstring.

    Args:
        named_params: the model's ``named_parameters()``; frozen ones are skipped, shared ones kept once.
        comm: the :class:`~lightning_sync.sync.communicator.Communicator` to reduce over.
        bucket_cap_mb: bucket size limit in MiB (finite, > 0).
        first_bucket_mb: limit of the first bucket in MiB (finite, > 0; capped at bucket_cap_mb).
        gradient_as_bucket_view: make each ``param.grad`` a view into its bucket (no copies).
        find_unused_parameters: zero-fill parameters without a gradient instead of raising.
        compressor: how a bucket is reduced (``None``: plain average); see ``sync.compression``.
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, nn.Parameter]],
        comm: Communicator,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        gradient_as_bucket_view: bool = True,
        find_unused_parameters: bool = False,
        compressor: Any | None = None,
    ) -> None:
        check_mib("bucket_cap_mb", bucket_cap_mb)
        check_mib("first_bucket_mb", first_bucket_mb)
        seen: set[int] = set()
        self._params: list[nn.Parameter] = []
        self.names: list[str] = []
        for name, p in named_params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self._params.append(p)
                self.names.append(name)
        self._comm = comm
        # at least one byte, so a tiny cap means "one parameter a bucket"; the first bucket is never
        # larger than the cap (torch's 1 MiB first bucket only ever shrinks the first bucket)
        self._cap = max(1, int(bucket_cap_mb * _MB))
        self._first_cap = max(1, int(min(first_bucket_mb, bucket_cap_mb) * _MB))
        self._as_view = gradient_as_bucket_view
        self._find_unused = find_unused_parameters
        self._compressor = compressor
        self._rebuilt = False
        self._missing: set[int] = set()
        self.step = 0
        self.trace = StepTrace()
        self.buckets: list[Bucket] = []
        self._where: list[tuple[int, int]] = []  # param index -> (bucket index, position in bucket)
        self._init_backward(self._params)
        self._build(list(reversed(range(len(self._params)))))

    # ------------------------------------------------------------------ planning
    def _build(self, order: list[int]) -> None:
        sizes = [p.numel() * p.element_size() for p in self._params]
        keys = [(p.dtype, p.device) for p in self._params]
        plan = plan_buckets(sizes, keys, order, self._cap, self._first_cap)
        self.buckets, self._where = [], [(0, 0)] * len(self._params)
        for b, members in enumerate(plan):
            ref = self._params[members[0]]
            layout = FlatShard([self._params[i].shape for i in members])
            buffer = layout.new_buffer(ref.dtype, ref.device)
            views = layout.views(buffer)
            for pos, (i, view) in enumerate(zip(members, views)):
                p = self._params[i]
                if p.grad is not None:  # keep gradients accumulated so far (rebuild mid-accumulation)
                    view.copy_(p.grad)
                    if self._as_view:
                        p.grad = view
                self._where[i] = (b, pos)
            self.buckets.append(Bucket(b, list(members), buffer, views, layout=layout))
        self._set_buckets([b for b, _ in self._where], len(self.buckets), range(len(self.buckets)))
        if self._compressor is not None and hasattr(self._compressor, "on_rebuild"):
            self._compressor.on_rebuild(self)

    def rebuild(self) -> None:
        """Re-plan the buckets in the order gradients became ready (rank 0's order, broadcast)."""
        order = self._ready_order + [i for i in range(len(self._params)) if i not in set(self._ready_order)]
        order = self._comm.broadcast_object(order if self._comm.rank == 0 else None, src=0)
        self._ready_order = list(order)  # the layout every rank now has (what a replacement adopts)
        self._build(list(order))
        self._rebuilt = True

    def prepare_for_backward(self) -> None:
        """Call before each backward: rebuild once after the first synchronized step (or at once
        after :meth:`load_state_dict` restored a ready order), and point ``None`` gradients at their
        (zeroed) bucket views so autograd accumulates in place."""
        if self._order_known and not self._rebuilt and self._sync:
            self.rebuild()
        if self._as_view:
            for i, p in enumerate(self._params):
                if p.grad is None:
                    b, pos = self._where[i]
                    p.grad = self.buckets[b].views[pos].zero_()

    @property
    def params(self) -> list[nn.Parameter]:
        """The synchronized parameters, each once, in registration order."""
        return list(self._params)

    # ------------------------------------------------------------------ the backward engine's steps
    def _view(self, i: int) -> torch.Tensor:
        b, pos = self._where[i]
        return self.buckets[b].views[pos]

    def _store(self, i: int, p: torch.Tensor) -> None:
        view = self._view(i)
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            if self._as_view:
                p.grad = view

    def _on_begin_backward(self) -> None:
        self.trace = StepTrace(launched_at=[None] * len(self.buckets))
        for bucket in self.buckets:
            bucket.work = None

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        self.trace.launched_at[b] = time.perf_counter()
        if self._compressor is None:
            bucket.work = self._comm.all_reduce(bucket.buffer, op="avg", async_op=True)
        else:
            bucket.work = self._compressor.launch(bucket, self, self._comm)

    def _wait(self, b: int) -> None:
        self.buckets[b].work.wait()  # type: ignore[union-attr]

    def _on_backward_end(self) -> None:
        self.trace.backward_end = time.perf_counter()

    def _fill_late(self, late: list[int]) -> None:
        """Zeros for a parameter with no gradient in this window, its earlier gradient for one used in an
        earlier micro-step only: every bucket is then reduced and no peer waits on us."""
        self._missing = {i for i in late if not self._used[i]}
        for i in late:
            view, grad = self._view(i), self._params[i].grad
            if i in self._missing or grad is None:
                view.zero_()
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)

    def _after_backward(self, synced: bool) -> None:
        unused_everywhere = self._globally_unused() if self._find_unused else set()
        for i, p in enumerate(self._params):
            view = self._view(i)
            if i in unused_everywhere:
                p.grad = None
            elif p.grad is None or self._as_view:
                p.grad = view if self._as_view else view.clone()
            elif p.grad.data_ptr() != view.data_ptr():
                p.grad.copy_(view)
        self.trace.synced_at = time.perf_counter()
        self.step += 1
        if self._missing and not self._find_unused:
            names = [self.names[i] for i in sorted(self._missing)]
            raise RuntimeError(
                f"{UNUSED_PARAMETERS} GradBucketer: parameters {names} received no gradient in this backward, so "
                f"their buckets could not complete (they were zero-filled so peers did not hang). If parameters are "
                f"unused on purpose, pass find_unused_parameters=True; otherwise check that the loss depends on them."
            )

    def _globally_unused(self) -> set[int]:
        used = torch.tensor(self._used, dtype=torch.int32, device=self._params[0].device)
        self._comm.all_reduce(used, op="max")
        return {i for i, u in enumerate(used.tolist()) if u == 0}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Step count, the recorded ready order and compressor state (this rank's)."""
        state: dict[str, Any] = {"step": self.step, "ready_order": list(self._ready_order)}
        if self._compressor is not None and hasattr(self._compressor, "state_dict"):
            state["compressor"] = self._compressor.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved. A saved ready order re-plans the buckets before the next
        synchronized backward (as the saving run had them); without one, the next backward records it.
        Every rank must load a state with or without an order alike (the re-plan is a collective)."""
        self.step = int(state.get("step", 0))
        order = [int(i) for i in state.get("ready_order", [])]
        if order and len(set(order)) == len(order) and all(0 <= i < len(self._params) for i in order):
            self._ready_order, self._order_known, self._rebuilt = order, True, False
        if "compressor" in state and self._compressor is not None:
            self._compressor.load_state_dict(state["compressor"])

    def adopt(self, state: dict[str, Any]) -> None:
        """Take a live peer's :meth:`live_state` (a replacement joining a running job). Buckets the peers have
        re-planned are re-planned here at once, with no collective; a re-plan still to come is made with them."""
        order = [int(i) for i in state.get("ready_order", [])]
        if not state.get("rebuilt") or sorted(order) != list(range(len(self._params))):
            self.load_state_dict(state)
            return
        self.step = int(state.get("step", 0))
        self._ready_order, self._order_known, self._rebuilt = order, True, True
        self._build(order)

    def live_state(self) -> dict[str, Any]:
        """What a replacement adopts: the step count and the bucket layout (no compressor state: it is per rank)."""
        return {"step": self.step, "ready_order": list(self._ready_order), "rebuilt": self._rebuilt}

    def abort_backward(self) -> None:
        """A backward failed part way: drop the buckets' handles of collectives on the lost group."""
        super().abort_backward()
        for bucket in self.buckets:
            bucket.work = None

    def close(self) -> None:
        """Remove the hooks; gradients stay where they are."""
        self._remove_grad_hooks()
