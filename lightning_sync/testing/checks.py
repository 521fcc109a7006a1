"""Checks that run *inside* spawned ranks: exact inputs, plain-torch references, non-raising asserts.

A multi-process test spawns its ranks once (seconds each) and performs many checks per run. A check
that raised inside one rank would leave its peers blocked in the next collective until the harness
timeout, and would hide every later result, so checks here never raise on a mismatch: a
:class:`Checks` collects the failures, the worker returns them, and the parent asserts with
:func:`assert_all_ranks_passed`::

    def _worker(rank: int, k: int) -> tuple[list[str], int]:
        ck = Checks()
        t = exact_input(rank, (5, 3), torch.float32, seed=1)
        ctx.all_reduce(t)  # ctx = comms.CommContext(), the worker's communication context
        ref = reduce_reference([exact_input(r, (5, 3), torch.float32, seed=1) for r in range(k)], "sum")
        ck.close("all_reduce sum", t, ref)  # exact: see exact_input
        return ck.result()

    assert_all_ranks_passed(run_distributed(_worker, 3, timeout=60), min_checks=1)

Inputs are a deterministic function of ``(rank, seed)``, so every rank computes the reference for
the whole group locally.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["REDUCE_OPS", "Checks", "assert_all_ranks_passed", "exact_input", "mismatch", "reduce_reference"]

REDUCE_OPS = ("avg", "max", "min", "sum")
"""The reduction ops :func:`reduce_reference` knows (those of :meth:`lightning_sync.comms.CommContext.all_reduce`)."""

_SEED_STRIDE = 104729  # generator seed = stride * seed + rank: distinct for every (seed, rank < stride)


def exact_input(rank: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rank ``rank``'s deterministic input for check number ``seed``; the same on every process.

    * Floating dtypes: multiples of 1/4 in [-8, 8), i.e. at most 6 significant bits. These values and
      their sums over up to 4 ranks (multiples of 1/4 with ``|sum| <= 32``: at most 8 significant
      bits) are exact in fp32, fp16 *and* bf16, whatever the order of the additions, so ring, tree
      and backend reductions must agree bit for bit on ``sum``, ``max`` and ``min``.
    * int64: 41-bit values in [-2^40, 2^40), beyond what a path that went through fp32 or fp64
      (53-bit significand, after sums of a few ranks) could carry unchanged.

    Raises :class:`ValueError` for another integer or bool dtype, or for a rank outside
    ``[0, 104729)`` (where two ``(rank, seed)`` pairs could share a generator seed).
    """
    if not 0 <= rank < _SEED_STRIDE:
        raise ValueError(f"rank must be in [0, {_SEED_STRIDE}), got {rank}")
    if dtype != torch.int64 and not dtype.is_floating_point:
        raise ValueError(f"dtype must be floating point or torch.int64, got {dtype}")
    g = torch.Generator().manual_seed(_SEED_STRIDE * seed + rank)
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=torch.int64)
    return (torch.randint(-32, 32, shape, generator=g, dtype=torch.int64).to(torch.float64) / 4).to(dtype)


def reduce_reference(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Single-process reference for reducing ``tensors`` (one per rank, in rank order) with ``op``.

    Computed in float64 (exact for :func:`exact_input` floats) or int64 (exact), then rounded once to
    the inputs' dtype, so it is the correctly rounded result. ``op`` is one of :data:`REDUCE_OPS`;
    ``avg`` of integer tensors is a :class:`ValueError`, as in :meth:`lightning_sync.comms.CommContext.all_reduce`.
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown op {op!r}; allowed: {sorted(REDUCE_OPS)}")
    if not tensors:
        raise ValueError("reduce_reference needs at least one tensor")
    dtype = tensors[0].dtype
    if op == "avg" and not dtype.is_floating_point:
        raise ValueError(f"op 'avg' needs a floating dtype, got {dtype}")
    st = torch.stack([t.to(torch.float64) if t.is_floating_point() else t for t in tensors])
    if op == "sum":
        out = st.sum(0)
    elif op == "avg":
        out = st.sum(0) / len(tensors)
    elif op == "max":
        out = st.amax(0)
    else:
        out = st.amin(0)
    return out.to(dtype)


def mismatch(
    actual: Any, expected: torch.Tensor | Sequence[torch.Tensor], rtol: float = 0.0, atol: float = 0.0
) -> str | None:
    """Why ``actual`` is not ``expected`` (``None`` if it is); never raises on a mismatch.

    ``expected`` is a tensor, or a list/tuple of tensors that ``actual`` must match element-wise and
    in length. Tensors must agree in dtype and shape; floating values within
    ``|actual - expected| <= atol + rtol * |expected|`` (compared in float64 on the CPU), integer
    and bool values exactly. The default tolerances demand bit-exact floats.
    """
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            return f"expected a list of {len(expected)} tensors, got {str(actual)[:300]}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            why = mismatch(a, e, rtol, atol)
            if why:
                return f"[{i}] {why}"
        return None
    if not isinstance(actual, torch.Tensor):
        return f"expected a tensor, got {type(actual).__name__}: {str(actual)[:300]}"
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return f"got {actual.dtype}{tuple(actual.shape)}, expected {expected.dtype}{tuple(expected.shape)}"
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if e.is_floating_point():
        ok = bool(torch.isclose(a.double(), e.double(), rtol=rtol, atol=atol).all())
    else:
        ok = torch.equal(a, e)
    if ok:
        return None
    diff = (a.double() - e.double()).abs().max().item()
    return f"max abs diff {diff} (rtol={rtol}, atol={atol})\n  actual={actual}\n  expected={expected}"


class Checks:
    """Collects failed checks instead of raising, so every rank runs every collective.

    Each method counts one check and, if it fails, appends ``"<name>: <why>"`` to :attr:`failures`.
    A worker returns :meth:`result` (picklable) for :func:`assert_all_ranks_passed`.
    """

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.count = 0

    def close(
        self,
        name: str,
        actual: Any,
        expected: torch.Tensor | Sequence[torch.Tensor],
        *,
        rtol: float = 0.0,
        atol: float = 0.0,
    ) -> None:
        """``actual`` matches ``expected`` within the tolerances (see :func:`mismatch`)."""
        self.count += 1
        why = mismatch(actual, expected, rtol, atol)
        if why:
            self.failures.append(f"{name}: {why}")

    def true(self, name: str, cond: bool, detail: Any = "") -> None:
        """``cond`` holds; ``detail`` (e.g. the value found) goes into the failure message."""
        self.count += 1
        if not cond:
            self.failures.append(f"{name}: {detail}")

    def raises(
        self,
        name: str,
        fn: Callable[[], Any],
        *patterns: str,
        exc: type[BaseException] | tuple[type[BaseException], ...] = ValueError,
    ) -> None:
        """``fn()`` raises ``exc`` whose message matches every regex in ``patterns``.

        Returning normally, or raising another :class:`Exception`, is recorded as a failure; nothing
        propagates out of the rank.
        """
        self.count += 1
        expected = exc.__name__ if isinstance(exc, type) else " or ".join(e.__name__ for e in exc)
        try:
            fn()
        except exc as err:
            msg = str(err)
            missing = [p for p in patterns if not re.search(p, msg)]
            if missing:
                self.failures.append(f"{name}: message {msg!r} does not match {missing}")
        except Exception as err:  # noqa: BLE001 - recorded, never raised inside a rank
            self.failures.append(f"{name}: expected {expected}, got {type(err).__name__}: {err}")
        else:
            self.failures.append(f"{name}: expected {expected}, nothing was raised")

    @property
    def passed(self) -> bool:
        """No check has failed so far."""
        return not self.failures

    def result(self) -> tuple[list[str], int]:
        """``(failures, count)``: what a worker returns to the parent."""
        return self.failures, self.count


def assert_all_ranks_passed(results: Sequence[Sequence[Any]], min_checks: int, *, same_count: bool = True) -> None:
    """Assert (in the parent) that no rank reported a failed check and that enough checks ran.

    ``results`` holds one entry per rank, in rank order, as returned by
    :func:`~lightning_sync.testing.run_distributed`; each entry starts with ``(failures, count)``
    (:meth:`Checks.result`), and any further items are ignored. Every rank must have run at least
    ``min_checks`` checks and, with ``same_count`` (for workers where every rank runs the same
    checks), the same number. All ranks' failures are reported together, prefixed by the rank.
    """
    report = "\n".join(f"rank {r}: {f}" for r, res in enumerate(results) for f in res[0])
    assert not report, f"{sum(len(res[0]) for res in results)} failed checks:\n{report}"
    counts = [res[1] for res in results]
    assert counts, "no rank results"
    if same_count:
        assert len(set(counts)) == 1, f"ranks ran different numbers of checks: {counts}"
    assert min(counts) >= min_checks, f"too few checks ran: {counts}, expected >= {min_checks} on every rank"
