"""Gradient compression for bucketed all-reduce: fp16/bf16 casts and PowerSGD.

A compressor reduces one bucket: ``launch(bucket, bucketer, comm)`` starts the communication and
returns a handle whose ``wait()`` leaves the *average* gradient in ``bucket.buffer``.

* :class:`CastCompression` (fp16, bf16): divide by K in fp32, cast, all-reduce (sum) in the low
  precision, cast back. Half the bytes. Works on gloo and NCCL alike (torch's own
  ``bf16_compress_hook`` refuses gloo).
* :class:`PowerSGD` (Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for
  Distributed Optimization", NeurIPS 2019): each gradient matrix M (n x m, the parameter reshaped to
  its first dim x the rest) is approximated with rank r by one power-iteration step:
  ``P = M Q``; all-reduce P; orthonormalize P; ``Q = M^T P``; all-reduce Q; ``M ~ P Q^T / K``.
  It sends ``r (n + m)`` values instead of ``n m``. With error feedback the part of M the
  approximation missed is added to the next step's gradient; with warm start Q is reused from the
  previous step instead of drawn afresh. Vectors and matrices that would not shrink by
  ``min_compression_rate`` are all-reduced uncompressed, packed into the same message as P. The
  first ``warmup_steps`` synchronized steps are uncompressed (Vogels et al. and torch's
  ``start_powerSGD_iter``). State (Q and the error) is kept per parameter, so re-planning the
  buckets keeps it. Q is identical on every rank; the error is each rank's own.

Codec time. The arithmetic of compressing and decompressing (casts, the products and the
orthonormalization, error feedback) is recorded through the communicator (``comm.record``) as op :data:`CODEC_OP`, with
its seconds and zero bytes, one call per bucket; the time spent waiting for communication is not in it.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from lightning_sync.sync.communicator import Communicator, WorkLike
from lightning_sync.sync.flat import FlatLayout

__all__ = ["CODEC_OP", "COMPRESSIONS", "CastCompression", "PowerSGD", "make_compressor"]

CODEC_OP = "codec"
"""The statistics' entry of compression arithmetic: seconds, no bytes, a call per bucket."""


def _codec(comm: Communicator, seconds: float, calls: int = 0) -> None:
    comm.record(CODEC_OP, 0, seconds, calls=calls)  # to the communicator's context's hooks


class _Deferred:
    """A handle whose ``wait()`` waits for ``work`` and then runs ``then()``."""

    def __init__(self, work: WorkLike, then: Any) -> None:
        self._work, self._then, self._done = work, then, False

    def wait(self) -> None:
        if not self._done:
            self._work.wait()
            self._then()
            self._done = True


class CastCompression:
    """Average in a lower precision: ``fp16`` or ``bf16``.

    Args:
        dtype: ``torch.float16`` or ``torch.bfloat16``.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"CastCompression dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
        self.dtype = dtype

    def launch(self, bucket: Any, bucketer: Any, comm: Communicator) -> WorkLike:
        # divide first (in fp32), so the fp16 sum of K values cannot overflow where the average would not
        t0 = time.perf_counter()
        low = (bucket.buffer / comm.world_size).to(self.dtype)
        _codec(comm, time.perf_counter() - t0, calls=1)
        work = comm.all_reduce(low, op="sum", async_op=True)

        def decode() -> None:
            t1 = time.perf_counter()
            bucket.buffer.copy_(low)
            _codec(comm, time.perf_counter() - t1)

        return _Deferred(work, decode)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def snapshot(self) -> dict[str, Any]:
        return {}

    def restore(self, snapshot: dict[str, Any]) -> None:
        return None


class PowerSGD:
    """Rank-``rank`` PowerSGD with error feedback and warm start (see the module docstring).

    Args:
        rank: rank r of the approximation (>= 1).
        warmup_steps: synchronized steps reduced uncompressed before compression starts (>= 0).
        min_compression_rate: compress a matrix only if ``n*m >= rate * r*(n+m)`` (>= 1).
        error_feedback: add the previous step's approximation error to the gradient.
        warm_start: reuse Q from the previous step.
        seed: seed of the initial Q (the same on every rank).
    """

    def __init__(
        self,
        rank: int = 2,
        warmup_steps: int = 10,
        min_compression_rate: float = 2.0,
        error_feedback: bool = True,
        warm_start: bool = True,
        seed: int = 0,
    ) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"PowerSGD rank must be an int >= 1, got {rank!r}")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"PowerSGD warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if not min_compression_rate >= 1:
            raise ValueError(f"PowerSGD min_compression_rate must be >= 1, got {min_compression_rate!r}")
        self.rank, self.warmup_steps, self.min_compression_rate = rank, warmup_steps, min_compression_rate
        self.error_feedback, self.warm_start, self.seed = error_feedback, warm_start, seed
        self._q: dict[int, torch.Tensor] = {}  # param index -> Q (m x r)
        self._error: dict[int, torch.Tensor] = {}  # param index -> error (n x m), this rank's

    def _matrix_shape(self, p: torch.Tensor) -> tuple[int, int] | None:
        if p.dim() < 2:
            return None
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(self.rank, n, m)
        return (n, m) if n * m >= self.min_compression_rate * r * (n + m) else None

    def launch(self, bucket: Any, bucketer: Any, comm: Communicator) -> WorkLike:
        if bucketer.step < self.warmup_steps:
            return comm.all_reduce(bucket.buffer, op="avg", async_op=True)
        world = comm.world_size
        t0 = time.perf_counter()
        mats: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (param index, M view, Q)
        rest: list[torch.Tensor] = []
        for i, view in zip(bucket.members, bucket.views):
            shape = self._matrix_shape(view)
            if shape is None:
                rest.append(view)
                continue
            m = view.view(shape)
            if self.error_feedback and i in self._error:
                m.add_(self._state_like(self._error, i, m))
            mats.append((i, m, self._initial_q(i, shape, m)))
        # message 1: every P = M Q, plus the uncompressed tensors, in one flat all-reduce
        ps = [m @ q for _, m, q in mats]
        layout1 = FlatLayout(ps + rest)  # one group: every tensor is of the bucket's dtype
        (msg1,) = layout1.flatten(ps + rest) if ps or rest else [bucket.buffer.new_zeros(0)]
        if self.error_feedback:  # keep this step's input; the buffers persist, so no allocation per step
            for i, m, _ in mats:
                if i in self._error and self._error[i].shape == m.shape:
                    self._error[i].copy_(m)
                else:
                    self._error[i] = m.clone()
        _codec(comm, time.perf_counter() - t0, calls=1)
        work1 = comm.all_reduce(msg1, op="sum", async_op=True)

        def finish() -> None:
            work1.wait()
            t1 = time.perf_counter()
            layout1.copy_into([msg1], ps + rest)
            for t in rest:
                t.div_(world)
            ps_orth = [_orthonormalize(p) for p in ps]
            # Q = M^T P computed as (P^T M)^T: the same numbers, but the product reads row-major M along its rows
            qs = [(p.t() @ m).t().contiguous() for (_, m, _), p in zip(mats, ps_orth)]
            if qs:  # message 2: every Q = M^T P
                layout2 = FlatLayout(qs)
                (msg2,) = layout2.flatten(qs)
                _codec(comm, time.perf_counter() - t1)
                comm.all_reduce(msg2, op="sum")
                t1 = time.perf_counter()
                layout2.copy_into([msg2], qs)
            for (i, m, _), p, q in zip(mats, ps_orth, qs):
                torch.matmul(p, q.t() / world, out=m)  # the average of the approximations
                self._q[i] = q
                if self.error_feedback:
                    self._error[i].sub_(m)  # error = input - approximation
            _codec(comm, time.perf_counter() - t1)

        return _Deferred(_Done(), finish)

    def _initial_q(self, i: int, shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
        r = min(self.rank, *shape)
        if self.warm_start and i in self._q and self._q[i].shape == (shape[1], r):
            return self._state_like(self._q, i, like)
        g = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + i)
        return torch.randn(shape[1], r, generator=g, dtype=like.dtype).to(like.device)

    @staticmethod
    def _state_like(store: dict[int, torch.Tensor], i: int, like: torch.Tensor) -> torch.Tensor:
        """``store[i]`` on ``like``'s device and in its dtype. A state loaded from a checkpoint is CPU tensors
        (:meth:`state_dict` saves portable copies); it moves once, in its first step, to the gradients it meets."""
        t = store[i]
        if t.device != like.device or t.dtype != like.dtype:
            t = store[i] = t.to(device=like.device, dtype=like.dtype)
        return t

    def wire_values(self, numel_shapes: list[torch.Size]) -> int:
        """Values sent per step for parameters of these shapes (for the byte model)."""
        total = 0
        for s in numel_shapes:
            shape = self._matrix_shape(torch.empty(s, device="meta"))
            total += math.prod(s) if shape is None else min(self.rank, *shape) * (shape[0] + shape[1])
        return total

    def state_dict(self) -> dict[str, Any]:
        return {
            "q": {i: q.detach().cpu().clone() for i, q in self._q.items()},
            "error": {i: e.detach().cpu().clone() for i, e in self._error.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a :meth:`state_dict` as it is (CPU tensors); each tensor moves to its gradient's device and
        dtype when a step first uses it (:meth:`_state_like`), so loading needs no device."""
        self._q = {int(i): q for i, q in state.get("q", {}).items()}
        self._error = {int(i): e for i, e in state.get("error", {}).items()}

    def snapshot(self) -> dict[str, Any]:
        """A copy of the state where it lives (no trip to the host, unlike :meth:`state_dict`), for
        :meth:`restore` within this process: the state a replayed step starts from again."""
        return {"q": _copies(self._q), "error": _copies(self._error)}

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Go back to a :meth:`snapshot`, which stays as it was (a step writes into its state in place)."""
        self._q, self._error = _copies(snapshot["q"]), _copies(snapshot["error"])


def _copies(tensors: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    return {i: t.clone() for i, t in tensors.items()}


def _orthonormalize(p: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Gram-Schmidt on the r columns of the tall matrix ``p``, in place: for the few columns of a low rank it is
    a handful of vector operations, where LAPACK's QR pays a general factorization's set-up on every call. ``eps``
    keeps an all-zero column (an unused parameter) finite."""
    for i in range(p.shape[1]):
        col = p[:, i : i + 1]
        col.div_(col.norm() + eps)
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1 :]
            rest.sub_(col @ (col.t() @ rest))
    return p


class _Done:
    def wait(self) -> None:
        return None


COMPRESSIONS = ("fp16", "bf16", "powersgd")


def make_compressor(name: str | None, powersgd_rank: int = 2, powersgd_warmup_steps: int = 10) -> Any | None:
    """The compressor called ``name`` (None: no compression). Allowed: :data:`COMPRESSIONS`."""
    if name is None or name == "none":
        return None
    if name == "fp16":
        return CastCompression(torch.float16)
    if name == "bf16":
        return CastCompression(torch.bfloat16)
    if name == "powersgd":
        return PowerSGD(rank=powersgd_rank, warmup_steps=powersgd_warmup_steps)
    raise ValueError(f"unknown compression {name!r}; allowed: {[None, 'none', *COMPRESSIONS]}")
