"""DiLoCo's outer loop, and its streaming form: fragments on a staggered schedule, outer all-reduces overlapped
with inner steps, and outer gradients sent in fewer bits.

DiLoCo (Douillard et al., "DiLoCo", 2023; torchft's ``DiLoCo``) keeps the global parameters of the last sync;
every H inner steps the pseudo-gradient ``global - local`` is averaged over the ranks, an outer SGD step
(Nesterov momentum by default: lr 0.7, momentum 0.9) steps the global parameters, and they are copied into the
local ones. Streaming DiLoCo (Douillard et al., "Streaming DiLoCo with overlapping communication", 2025) adds
three things, each a setting of :class:`DiLoCoOuter`:

* ``fragments`` (F): the trainable values, in module order, are cut into F consecutive runs of equal size (to one
  value; a run may start or end inside a tensor); fragment f syncs every H steps too, but at the steps ``t`` with
  ``t mod H = f H / F`` (the first after ``f H / F`` steps). One sync then moves 1/F of the model, so the peak
  bandwidth drops F-fold for the same total bytes. The outer SGD is elementwise, so a tensor cut in two takes its
  two outer steps at different steps, each on its own values and their momentum.
* ``overlap_steps`` (tau): a fragment's average is issued at its step and waited for ``tau`` inner steps later,
  when its outer step is applied; the inner steps between run while it travels. The local fragment has moved
  on meanwhile, so it is merged, not overwritten: ``local <- alpha local + (1 - alpha) global`` (the paper's
  mixing, ``overlap_alpha``, 0.5). With ``tau = 0`` the fragment takes the global value, as DiLoCo does.
* ``outer_dtype``: the pseudo-gradient travels as fp32 (DiLoCo's), bf16, int8 or int4 (with error feedback;
  :mod:`lightning_sync.sync.quantize`).

With F = 1, tau = 0 and fp32 this is DiLoCo, value for value. Every rank issues the same collectives at the same
steps (a sync's second half, where its codec has one, is issued at the step after its launch), so replicas of
the global model stay equal bit for bit.

Checkpoints: :meth:`DiLoCoOuter.state_dict` is what every rank holds alike: the counters, the global parameters,
the outer optimizer and the averages of the syncs in flight, waited for (their outer step is still applied at its
own step after a resume). The error-feedback buffers are each rank's own (:meth:`DiLoCoOuter.rank_state`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_sync._checks import check_int
from lightning_sync.sync.communicator import Communicator
from lightning_sync.sync.flat import FlatLayout
from lightning_sync.sync.quantize import OuterCodec

__all__ = ["DiLoCoOuter", "check_outer", "check_streaming", "distinct", "split_fragments"]


def check_outer(outer_lr: Any, outer_momentum: Any, nesterov: Any) -> None:
    """DiLoCo's outer SGD settings, each checked; a ValueError names the bad one."""
    if isinstance(outer_lr, bool) or not isinstance(outer_lr, (int, float)) or not 0 < outer_lr < math.inf:
        raise ValueError(f"outer_lr must be a finite number > 0, got {outer_lr!r}")
    if isinstance(outer_momentum, bool) or not isinstance(outer_momentum, (int, float)) or not 0 <= outer_momentum < 1:
        raise ValueError(f"outer_momentum must be a number in [0, 1), got {outer_momentum!r}")
    if not isinstance(nesterov, bool) or (nesterov and outer_momentum == 0):
        raise ValueError(
            f"nesterov must be True or False (True needs outer_momentum > 0), got {nesterov!r} "
            f"with outer_momentum={outer_momentum!r}"
        )


def check_streaming(sync_every: int, fragments: Any, overlap_steps: Any, overlap_alpha: Any) -> None:
    """The streaming settings against H, each checked; a ValueError names the bad one and what is allowed."""
    check_int("fragments", fragments, 1)
    if fragments > sync_every:
        raise ValueError(f"fragments must be in [1, sync_every={sync_every}] (one start step each), got {fragments}")
    check_int("overlap_steps", overlap_steps, 0)
    if overlap_steps >= sync_every:
        raise ValueError(
            f"overlap_steps must be in [0, sync_every={sync_every}) (a fragment's outer step lands before its "
            f"next sync starts), got {overlap_steps}"
        )
    if isinstance(overlap_alpha, bool) or not isinstance(overlap_alpha, (int, float)) or not 0 <= overlap_alpha <= 1:
        raise ValueError(f"overlap_alpha must be a number in [0, 1], got {overlap_alpha!r}")


def distinct(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor once, in first-seen order (a tied parameter is one tensor)."""
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


Piece = tuple[int, int, int]
"""A fragment's part of one parameter: its index and the first and past-the-last element of its flat values."""


def split_fragments(sizes: list[int], fragments: int) -> list[list[Piece]]:
    """The values of consecutive tensors (``sizes`` in module order) cut into ``fragments`` runs of equal size, to
    one value: run k holds values ``[k N / F, (k + 1) N / F)`` of the N, as pieces of the tensors they fall in. An
    empty tensor goes with the run its place falls in (a no-op outer step, as DiLoCo's)."""
    total = sum(sizes)
    if fragments > max(total, 1):
        raise ValueError(f"fragments={fragments} is more than the {total} trainable values to split")
    bounds = [k * total // fragments for k in range(fragments + 1)]
    out: list[list[Piece]] = [[] for _ in range(fragments)]
    start = 0
    for i, size in enumerate(sizes):
        if size == 0:  # the run its place falls in (the bounds rise strictly: F <= N)
            out[min(bisect.bisect_right(bounds, start) - 1, fragments - 1)].append((i, 0, 0))
        for k in range(fragments):
            lo, hi = max(bounds[k], start), min(bounds[k + 1], start + size)
            if lo < hi:
                out[k].append((i, lo - start, hi - start))
        start += size
    return out


class _Flight:
    """One fragment's average: issued at one step, its outer step applied at step ``due``."""

    def __init__(self, fragment: int, pieces: list[Piece], due: int, overlapped: bool) -> None:
        self.fragment, self.pieces, self.due, self.overlapped = fragment, pieces, due, overlapped
        self.layout: FlatLayout | None = None
        self.handles: list[Any] = []
        self.averages: list[torch.Tensor] | None = None  # per non-empty piece (flat), once waited for

    @property
    def sent(self) -> list[Piece]:
        return [piece for piece in self.pieces if piece[2] > piece[1]]

    def advance(self) -> None:
        for handle in self.handles:
            handle.advance()

    def wait(self) -> list[torch.Tensor]:
        if self.averages is None:
            flats = [handle.wait() for handle in self.handles]
            self.averages = [a.clone() for a in self.layout.views(flats)] if self.layout is not None else []
            self.handles, self.layout = [], None
        return self.averages


class DiLoCoOuter:
    """DiLoCo's outer loop over the local ``params``, streamed (see the module docstring).

    Args:
        params: the trainable parameters the inner optimizer steps (each shared tensor once), in module order.
        comm: the communicator.
        sync_every: H >= 1 inner steps per outer step of a fragment.
        outer_lr: outer SGD learning rate (> 0; the paper's 0.7).
        outer_momentum: outer momentum in [0, 1) (the paper's 0.9).
        nesterov: Nesterov momentum (needs ``outer_momentum > 0``).
        fragments: F in [1, H], and at most the number of trainable values.
        overlap_steps: tau in [0, H): inner steps between a fragment's launch and its outer step.
        outer_dtype: ``"fp32"``, ``"bf16"``, ``"int8"`` or ``"int4"``.
        overlap_alpha: with tau > 0, the weight the local fragment keeps when the global one lands, in [0, 1].
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        comm: Communicator,
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        fragments: int = 1,
        overlap_steps: int = 0,
        outer_dtype: str = "fp32",
        overlap_alpha: float = 0.5,
    ) -> None:
        self.sync_every = check_int("sync_every", sync_every, 1)
        check_outer(outer_lr, outer_momentum, nesterov)
        check_streaming(self.sync_every, fragments, overlap_steps, overlap_alpha)
        self.codec = OuterCodec(outer_dtype)
        self.params = distinct(params)
        self.comm = comm
        self.fragments = split_fragments([p.numel() for p in self.params], fragments)
        self.offsets = [f * self.sync_every // fragments for f in range(fragments)]
        self.overlap_steps, self.overlap_alpha = overlap_steps, float(overlap_alpha)
        self.global_params = [nn.Parameter(p.detach().clone()) for p in self.params]
        self.outer_optimizer = torch.optim.SGD(
            self.global_params, lr=float(outer_lr), momentum=float(outer_momentum), nesterov=bool(nesterov)
        )
        self.steps = 0
        self.syncs = 0  # outer steps applied, one per fragment
        self.in_flight: list[_Flight] = []

    @property
    def streaming(self) -> bool:
        """Whether the schedule is more than DiLoCo's: several fragments or an overlap."""
        return len(self.fragments) > 1 or self.overlap_steps > 0

    def step(self) -> bool:
        """Count one inner step: apply the outer steps due now, move the syncs in flight on, launch the
        fragments whose turn it is. Returns whether the last fragment's outer step was applied (a round of
        every fragment ended; with F = 1: whether DiLoCo's outer step ran)."""
        self.steps += 1
        ended = False
        for flight in list(self.in_flight):
            if flight.due == self.steps:
                ended |= self._apply(flight)
            else:
                flight.advance()
        for f, offset in enumerate(self.offsets):
            if self.steps % self.sync_every == offset and self.steps >= max(offset, 1):
                flight = self._launch(f, self.overlap_steps)
                if not flight.overlapped:
                    ended |= self._apply(flight)
        return ended

    def period_ends_next(self) -> bool:
        """Whether the next inner step ends a period (an outer step follows it)."""
        return (self.steps + 1) % self.sync_every == 0

    def in_sync(self) -> bool:
        """Whether every replica is the global model now (never while streaming: some fragment is apart)."""
        return not self.streaming and self.steps % self.sync_every == 0

    def _launch(self, fragment: int, overlap: int) -> _Flight:
        flight = _Flight(fragment, self.fragments[fragment], self.steps + overlap, overlapped=overlap > 0)
        with torch.no_grad():
            deltas = [
                self.global_params[i].detach().view(-1)[lo:hi] - self.params[i].detach().view(-1)[lo:hi]
                for i, lo, hi in flight.sent
            ]
        if deltas:
            flight.layout = FlatLayout(deltas, by_device=True)
            flats = flight.layout.flatten(deltas)
            flight.handles = [self.codec.start(f"{fragment}/{j}", flat, self.comm) for j, flat in enumerate(flats)]
        if flight.overlapped:
            self.in_flight.append(flight)
        return flight

    def _apply(self, flight: _Flight) -> bool:
        """The fragment's outer step on its average, merged into the local fragment."""
        if flight in self.in_flight:
            self.in_flight.remove(flight)
        with torch.no_grad():
            averages = iter(flight.wait())
            for piece in flight.pieces:  # an empty tensor steps too (nothing moves; its momentum is kept, empty)
                self._outer_step(piece, next(averages) if piece[2] > piece[1] else self.params[piece[0]].new_zeros(0))
            for i, lo, hi in flight.pieces:
                local, new = self.params[i].view(-1)[lo:hi], self.global_params[i].detach().view(-1)[lo:hi]
                if flight.overlapped:  # the local fragment moved on while the average travelled: merge
                    local.mul_(self.overlap_alpha).add_(new, alpha=1 - self.overlap_alpha)
                else:
                    local.copy_(new)
        self.syncs += 1
        return flight.fragment == len(self.fragments) - 1

    def _outer_step(self, piece: Piece, grad: torch.Tensor) -> None:
        """The outer SGD step on the values of one piece, written as torch's SGD (single-tensor) takes it, so a
        whole tensor steps as ``outer_optimizer.step()`` would step it; elementwise, so the values outside the
        piece and their momentum are left as they are. The optimizer holds the settings and the momentum buffers
        (what a checkpoint saves), not the step."""
        i, lo, hi = piece
        g = self.global_params[i]
        group = self.outer_optimizer.param_groups[0]
        lr, momentum, nesterov = group["lr"], group["momentum"], group["nesterov"]
        if momentum:
            state = self.outer_optimizer.state[g]
            if "momentum_buffer" not in state:  # zero where no step ran yet: m * 0 + grad is torch's first buffer
                state["momentum_buffer"] = torch.zeros_like(g, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"].view(-1)[lo:hi]
            buf.mul_(momentum).add_(grad)
            grad = grad.add(buf, alpha=momentum) if nesterov else buf
        g.detach().view(-1)[lo:hi].add_(grad, alpha=-lr)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Global parameters, outer optimizer state, counters and the averages in flight (waited for here, so
        every rank must call it at the same step; identical on every rank)."""
        state = {
            "steps": self.steps,
            "syncs": self.syncs,
            "global_params": [g.detach().clone() for g in self.global_params],
            "outer_optimizer": self.outer_optimizer.state_dict(),
        }
        if self.in_flight:
            state["in_flight"] = [
                {"fragment": f.fragment, "pieces": [list(p) for p in f.pieces], "due": f.due, "averages": f.wait()}
                for f in self.in_flight
            ]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["global_params"]
        if len(saved) != len(self.global_params) or any(s.shape != g.shape for s, g in zip(saved, self.global_params)):
            raise ValueError(
                f"DiLoCo state holds {len(saved)} global parameters that do not match this model's "
                f"{len(self.global_params)}"
            )
        flights = []
        for entry in state.get("in_flight", []):
            pieces = [(int(i), int(lo), int(hi)) for i, lo, hi in entry["pieces"]]
            flight = _Flight(int(entry["fragment"]), pieces, int(entry["due"]), True)
            averages = list(entry["averages"])
            fits = all(0 <= i < len(self.params) and 0 <= lo <= hi <= self.params[i].numel() for i, lo, hi in pieces)
            if not fits or [hi - lo for _, lo, hi in flight.sent] != [a.numel() for a in averages]:
                raise ValueError(
                    f"DiLoCo state holds an outer step in flight for the values {pieces} that do not match this model's"
                )
            # from a checkpoint: on the CPU, the parameters maybe on a GPU
            flight.averages = [
                a.to(self.params[i].device, self.params[i].dtype, copy=True)
                for (i, _, _), a in zip(flight.sent, averages)
            ]
            flights.append(flight)
        with torch.no_grad():
            for g, s in zip(self.global_params, saved):
                g.copy_(s)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.steps, self.syncs = int(state.get("steps", 0)), int(state.get("syncs", 0))
        self.in_flight = flights

    def rank_state(self) -> dict[str, Any]:
        """This rank's own state: the error-feedback buffers of int8 / int4 (empty otherwise)."""
        return self.codec.rank_state() if self.codec.lossy_with_memory else {}

    def load_rank_state(self, state: dict[str, Any]) -> None:
        self.codec.load_rank_state(state)
