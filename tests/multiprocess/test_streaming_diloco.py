"""Streaming DiLoCo on real gloo ranks, against a single-process reference.

* **The outer loop alone (3 ranks).** With one fragment, no overlap and fp32 it equals today's DiLoCo
  (``support.diloco_reference``, the class as it was) bit for bit. Streamed (fragments on a staggered schedule,
  an overlap, fp32 and int4) it equals :class:`_Reference`, which runs the K replicas side by side in one process
  and averages with plain sums (int4: every rank's encoding, each owner's segment mean, its encoding, with both
  error-feedback buffers); the global model is the same on every rank, bit for bit. An int4 average counts the
  bytes of its codes and scales.
* **In Lightning (2 ranks, then 1).** ``DiLoCoStrategy(fragments=2, overlap_steps=2, outer_dtype="int4")`` with
  AdamW, accumulation, a tied and a frozen parameter equals the reference; a checkpoint taken while a fragment's
  sync is in flight resumes to the uninterrupted run's weights, outer state and error feedback bit for bit; and
  one rank resumes a two-rank checkpoint (in flight too) as the reference started from it does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _lightning_reference import ENV, EQ_TOL, MIN_MOVE, _quiet_rank, _state, _TiedModule, _train_replicas
from lightning.pytorch.callbacks import ModelCheckpoint
from support.diloco_reference import TodaysDiLoCo
from test_exact_resume import BATCH, N
from test_periodic_resume import ACCUMULATE, _fit_recorded, _Recorded

from lightning_sync import DiLoCoStrategy, comms
from lightning_sync.resume import RANK_STATES
from lightning_sync.sync.outer import DiLoCoOuter, split_fragments
from lightning_sync.sync.quantize import CHUNK, OuterCodec, decode, encode, encoded_bytes
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

LR, MOMENTUM = 0.7, 0.9
# The reference sums K values in rank order and divides; gloo's fp32 all-reduce may add them in another
# order: an ulp of the pseudo-gradient per outer step, a few ulps of weights ~1 over a dozen outer steps.
# int4 adds nothing to that: every rank decodes the same bytes, and the reference decodes the same codes
# (the codes themselves would differ only if an input sat within an ulp of a rounding boundary; one
# that did would move a weight by a quantization step, ~1e-2, far outside).
ALGO_TOL = {"rtol": 0.0, "atol": 1e-6}


# --------------------------------------------------------------------------- the single-process reference


def _average(vectors: list[torch.Tensor], dtype: str, errors: dict[str, Any], key: str) -> torch.Tensor:
    """The average of K ranks' flat ``vectors`` as ``dtype`` sends it, written plainly: fp32, the mean; int8 /
    int4, each rank's vector (plus its carried error) encoded per segment, each segment's owner averaging the
    decoded segments in rank order (plus its carried error) and encoding the mean, every rank decoding those."""
    world, n = len(vectors), vectors[0].numel()
    if dtype == "fp32":
        return sum(vectors[1:], vectors[0].clone()) / world
    segment = -(-n // (world * CHUNK)) * CHUNK
    sent = []
    for r, v in enumerate(vectors):
        padded = torch.zeros(world * segment)
        padded[:n] = v + errors.setdefault(f"worker/{r}/{key}", torch.zeros(n))
        pieces = [encode(part, dtype) for part in padded.view(world, segment)]
        errors[f"worker/{r}/{key}"] = (padded - torch.cat([d for _, d in pieces]))[:n]
        sent.append([b for b, _ in pieces])
    means = []
    for owner in range(world):
        mean = decode(sent[0][owner], segment, dtype)
        for r in range(1, world):
            mean += decode(sent[r][owner], segment, dtype)
        mean /= world
        mean += errors.setdefault(f"server/{owner}/{key}", torch.zeros(segment))
        buffer, decoded = encode(mean, dtype)
        errors[f"server/{owner}/{key}"] = mean - decoded
        means.append(decode(buffer, segment, dtype))
    return torch.cat(means)[:n]


class _Reference:
    """Streaming DiLoCo over K replicas in one process: ``replicas[r]`` is rank r's list of trainable tensors. The
    outer Nesterov SGD is written out per value (buffer = m buffer + g; step g + m buffer), a fragment's values
    at a time; a fragment of whole tensors could equally be torch's SGD, the same arithmetic."""

    def __init__(self, replicas: list[list[torch.Tensor]], H: int, F: int, tau: int, dtype: str, alpha: float = 0.5):
        self.replicas, self.H, self.tau, self.dtype, self.alpha = replicas, H, tau, dtype, alpha
        self.fragments = split_fragments([p.numel() for p in replicas[0]], F)
        self.offsets = [f * H // F for f in range(F)]
        self.global_params = [p.detach().clone() for p in replicas[0]]
        self.momentum = [torch.zeros_like(p) for p in self.global_params]
        self.steps, self.flights, self.errors = 0, [], {}

    def load(self, saved: dict[str, Any]) -> None:
        """The outer state of a checkpoint's ``lightning_sync/diloco`` entry (torch's SGD state: by index)."""
        for g, value in zip(self.global_params, saved["global_params"]):
            g.copy_(value)
        for i, state in saved["outer_optimizer"]["state"].items():
            self.momentum[int(i)].copy_(state["momentum_buffer"])
        self.steps = saved["steps"]
        for entry in saved.get("in_flight", []):
            pieces = [tuple(piece) for piece in entry["pieces"] if piece[2] > piece[1]]
            self.flights.append((entry["fragment"], entry["due"], dict(zip(pieces, entry["averages"])), True))

    def step(self) -> None:
        self.steps += 1
        for flight in [f for f in self.flights if f[1] == self.steps]:
            self.flights.remove(flight)
            self._apply(*flight)
        for f, offset in enumerate(self.offsets):
            if self.steps % self.H == offset and self.steps >= max(offset, 1):
                pieces = [(i, lo, hi) for i, lo, hi in self.fragments[f] if hi > lo]
                deltas = [
                    torch.cat([(self.global_params[i] - rep[i]).detach().reshape(-1)[lo:hi] for i, lo, hi in pieces])
                    for rep in self.replicas
                ]
                average = _average(deltas, self.dtype, self.errors, f"{f}/0")
                parts = dict(zip(pieces, average.split([hi - lo for _, lo, hi in pieces])))
                flight = (f, self.steps + self.tau, parts, self.tau > 0)
                self.flights.append(flight) if self.tau else self._apply(*flight)

    def _apply(self, fragment: int, due: int, parts: dict[Any, torch.Tensor], overlapped: bool) -> None:
        for (i, lo, hi), grad in parts.items():
            buf = self.momentum[i].view(-1)[lo:hi]
            buf.mul_(MOMENTUM).add_(grad)
            self.global_params[i].view(-1)[lo:hi].sub_(LR * (grad + MOMENTUM * buf))
        with torch.no_grad():
            for rep in self.replicas:
                for i, lo, hi in self.fragments[fragment]:
                    local, new = rep[i].view(-1)[lo:hi], self.global_params[i].view(-1)[lo:hi]
                    if overlapped:
                        local.mul_(self.alpha).add_(new, alpha=1 - self.alpha)
                    else:
                        local.copy_(new)


# --------------------------------------------------------------------------- the outer loop alone, 3 ranks


def _params() -> list[torch.nn.Parameter]:
    """Six tensors, one empty, 0-d to 700 values (the flat message needs padding at 3 ranks)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(130,), (0,), (), (20, 35), (9, 7), (3,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _inner_step(params: list[torch.Tensor], rank: int, step: int) -> None:
    """What an inner step does to rank ``rank``'s replica: a move of its own (seeded by rank and step)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    with torch.no_grad():
        for p in params:
            p.sub_(0.05 * torch.randn(p.shape, generator=g))


def _equal_everywhere(ck: Checks, ctx: comms.CommContext, tag: str, tensors: list[torch.Tensor]) -> None:
    mine = [t.detach().clone() for t in tensors]
    everyone = ctx.all_gather_object(mine)
    ck.true(tag, all(all(torch.equal(a, b) for a, b in zip(mine, other)) for other in everyone))


def _algorithm(rank: int, world: int) -> tuple[list[str], int]:
    torch.set_num_threads(1)
    ck = Checks()
    ctx = comms.CommContext(observer=comms.CommStats())

    # F = 1, tau = 0, fp32 is today's DiLoCo, value for value (tolerance 0: the same ops in the same order)
    ours, theirs = _params(), _params()
    new = DiLoCoOuter(ours, ctx, 3, LR, MOMENTUM, True, fragments=1, overlap_steps=0, outer_dtype="fp32")
    old = TodaysDiLoCo(theirs, ctx, 3, LR, MOMENTUM, True)
    for step in range(1, 10):
        _inner_step(ours, rank, step)
        _inner_step(theirs, rank, step)
        ck.true(f"step {step}: an outer step when today's takes one", new.step() == old.step())
    for i, (a, b) in enumerate(zip(ours, theirs)):
        ck.true(f"F=1, tau=0, fp32 == today's DiLoCo: parameter {i}", torch.equal(a, b))
    for i, (a, b) in enumerate(zip(new.global_params, old.global_params)):
        momentum = new.outer_optimizer.state[a]["momentum_buffer"], old.outer_optimizer.state[b]["momentum_buffer"]
        ck.true(f"... global parameter {i} and its momentum", torch.equal(a, b) and torch.equal(*momentum))

    # streamed: 3 fragments (offsets 0, 2, 4 of H = 6), tau = 2, fp32 and int4, against K replicas in one process
    for dtype in ("fp32", "int4"):
        mine = _params()
        outer = DiLoCoOuter(mine, ctx, 6, LR, MOMENTUM, True, fragments=3, overlap_steps=2, outer_dtype=dtype)
        ref = _Reference([_params() for _ in range(world)], 6, 3, 2, dtype)
        for step in range(1, 20):
            _inner_step(mine, rank, step)
            for r, replica in enumerate(ref.replicas):
                _inner_step(replica, r, step)
            outer.step()
            ref.step()
        # 897 values in thirds of 299: the 700-value tensor is cut twice
        thirds = [
            [(0, 0, 130), (1, 0, 0), (2, 0, 1), (3, 0, 168)],
            [(3, 168, 467)],
            [(3, 467, 700), (4, 0, 63), (5, 0, 3)],
        ]
        ck.true(f"[{dtype}] the fragments", outer.fragments == ref.fragments == thirds, outer.fragments)
        for i, p in enumerate(mine):
            ck.close(
                f"[{dtype}] streamed == reference: replica {rank}, tensor {i}", p, ref.replicas[rank][i], **ALGO_TOL
            )
        for i, g in enumerate(outer.global_params):
            ck.close(f"[{dtype}] streamed == reference: global {i}", g, ref.global_params[i], **ALGO_TOL)
        moved = max((g - p).abs().max().item() for g, p in zip(outer.global_params, _params()) if g.numel())
        ck.true(f"[{dtype}] the outer steps moved the global model", moved > 0.1, moved)
        _equal_everywhere(ck, ctx, f"[{dtype}] every rank holds the same global model", outer.global_params)

    # an int4 average of n values sends codes and scales: the all-to-all every rank's K segments, the all-gather
    # its own mean segment; fp32's all-reduce, 4 bytes a value
    n = 1000
    segment = -(-n // (world * CHUNK)) * CHUNK
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    ctx.observer.reset()
    handle = OuterCodec("int4").start("k", x, ctx)
    handle.advance()
    average = handle.wait()
    stats = ctx.observer.snapshot()
    ck.true("int4: the all-to-all's bytes", stats["all_to_all"].bytes == world * encoded_bytes(segment, "int4"))
    ck.true("int4: the all-gather's bytes", stats["all_gather"].bytes == encoded_bytes(segment, "int4"))
    sent = stats["all_to_all"].bytes + stats["all_gather"].bytes
    # n/2 (1 + 1/K) bytes and the scales, padding to whole segments included: under a quarter of fp32's
    ck.true("int4 sends under a quarter of fp32's 4 bytes a value", sent * 4 < 4 * n, (sent, 4 * n))
    exact = ctx.all_reduce(x.clone(), op="avg")
    # two roundings: each rank's (half a step of its chunk's absmax / 7, averaged) and the mean's (half a step)
    bound = x.abs().max().item() / 7
    ck.true("int4: the average is within a quantization step", (average - exact).abs().max().item() <= bound)
    _equal_everywhere(ck, ctx, "int4: every rank gets the same average", [average])
    return ck.result()


@pytest.mark.timeout(180)
def test_streaming_outer_loop_matches_todays_diloco_and_the_reference() -> None:
    assert_all_ranks_passed(run_distributed(_algorithm, 3, timeout=150), min_checks=40)


# --------------------------------------------------------------------------- in Lightning: 2 ranks, then 1

H, F, TAU, DTYPE = 3, 2, 2, "int4"  # fragment 0 sent at 3, 6, 9 and lands at 5, 8, 11; fragment 1 at 1, 4, 7, 10
STEPS = 10  # N = 128, BATCH = 4, ACCUMULATE = 2: 2 ranks take 16 micro-batches an epoch, 8 optimizer steps
MID, EPOCH_END = 5, 8  # after step 5 fragment 1 (sent at 4) is in flight; after step 8, fragment 1 (sent at 7)


def _fit(max_steps: int, callbacks: list[Any], ckpt: Path | None = None, **kw: Any) -> tuple[pl.Trainer, _Recorded]:
    strategy = DiLoCoStrategy(
        sync_every=H, outer_lr=LR, outer_momentum=MOMENTUM, fragments=F, overlap_steps=TAU, outer_dtype=DTYPE
    )
    return _fit_recorded(strategy, max_steps, callbacks, ckpt, **kw)


def _trained_reference(world: int, steps: int, start: dict[str, Any] | None = None, epoch: int = 0) -> _Reference:
    """K replicas of the Lightning module, each on its rank's batches with its own AdamW and StepLR, and the
    streaming outer loop over their trainable parameters. ``start``: a checkpoint every replica starts from (the
    mean of its replicas, rank 0's optimizer and scheduler, the outer state, the syncs in flight, the error
    feedback regrouped for ``world``), at the start of ``epoch``."""
    reps = [_TiedModule("adamw", _Recorded().ds, scheduler=True) for _ in range(world)]
    configured = [m.configure_optimizers() for m in reps]
    opts = [c["optimizer"] for c in configured]
    scheds = [c["lr_scheduler"]["scheduler"] for c in configured]
    if start is not None:
        for m, o, s in zip(reps, opts, scheds):
            m.load_state_dict(start["state_dict"])
            o.load_state_dict(start["optimizer_states"][0])
            s.load_state_dict(start["lr_schedulers"][0])
    ref = _Reference([[p for p in m.parameters() if p.requires_grad] for m in reps], H, F, TAU, DTYPE)
    if start is not None:
        ref.load(start["lightning_sync/diloco"])
        regrouped = [
            OuterCodec.regrouped([s["outer_errors"] for s in start[RANK_STATES]], world, r) for r in range(world)
        ]
        for r, errors in enumerate(regrouped):
            for key, value in errors["worker"].items():
                ref.errors[f"worker/{r}/{key}"] = value.clone()
            for key, value in errors["server"].items():
                ref.errors[f"server/{r}/{key}"] = value.clone()
    _train_replicas(reps, opts, scheds, N, steps, ACCUMULATE, epoch, BATCH, after_step=ref.step)
    ref.modules = reps  # type: ignore[attr-defined]
    return ref


def _outer_state(strategy: Any) -> dict[str, torch.Tensor]:
    """The global model, outer momentum and error feedback, once the syncs in flight have run their course (as a
    checkpoint would have them: the uninterrupted run's last checkpoint, at step 10, finished the one sent then)."""
    outer = strategy.averager
    outer.state_dict()  # every rank calls it: waits for the syncs in flight
    out = {f"global/{i}": g.detach().clone() for i, g in enumerate(outer.global_params)}
    out.update(
        {f"momentum/{i}": s["momentum_buffer"].clone() for i, s in enumerate(outer.outer_optimizer.state.values())}
    )
    errors = outer.rank_state()
    out.update({f"{kind}/{k}": v.clone() for kind in ("worker", "server") for k, v in errors.get(kind, {}).items()})
    return out


def _two_ranks(rank: int, world: int, tmpdir: str) -> tuple[list[str], int]:
    _quiet_rank()
    ck = Checks()
    root = Path(tmpdir)
    savers = [ModelCheckpoint(dirpath=root / str(s), every_n_train_steps=s, save_top_k=-1) for s in (MID, EPOCH_END)]
    trainer, whole = _fit(STEPS, savers, enable_checkpointing=True)
    final, outer_final = _state(whole), _outer_state(trainer.strategy)
    ref = _trained_reference(world, STEPS)
    mine = _state(ref.modules[rank])
    for key, value in final.items():
        ck.close(f"uninterrupted == single-process reference: {key}", value, mine[key], **EQ_TOL)
    init = _state(_TiedModule("adamw", whole.ds))
    moved = max((mine[k] - init[k]).abs().max().item() for k in mine)
    ck.true("the reference moved the weights", moved > MIN_MOVE, moved)
    for i, g in enumerate(trainer.strategy.averager.global_params):
        ck.close(f"global parameter {i} == reference", g, ref.global_params[i], **EQ_TOL)

    ckpt = root / str(MID) / f"epoch=0-step={MID}.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    flights = [(e["fragment"], e["due"]) for e in saved["lightning_sync/diloco"].get("in_flight", [])]
    ck.true("the checkpoint holds fragment 1's sync in flight, due at step 6", flights == [(1, MID + 1)], flights)
    errors = saved[RANK_STATES][rank].get("outer_errors", {})
    ck.true(
        "the checkpoint holds this rank's error feedback", bool(errors.get("worker")) and bool(errors.get("server"))
    )

    trainer, resumed = _fit(STEPS, [], ckpt=ckpt)
    for key, value in _state(resumed).items():  # the same batches and ops in the same order: bitwise
        ck.true(f"resumed mid-overlap == uninterrupted: {key}", torch.equal(value, final[key]))
    for key, value in _outer_state(trainer.strategy).items():
        ck.true(f"outer state resumed == uninterrupted: {key}", torch.equal(value, outer_final[key]))
    ck.true("the samples after the resume are the uninterrupted run's", resumed.seen == whole.seen[MID * ACCUMULATE :])
    return ck.result()


def _one_rank(rank: int, world: int, tmpdir: str) -> tuple[list[str], int]:
    _quiet_rank()
    ck = Checks()
    ckpt = Path(tmpdir) / str(EPOCH_END) / f"epoch=0-step={EPOCH_END}.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    ck.true("the 2-rank checkpoint has a sync in flight", len(saved["lightning_sync/diloco"].get("in_flight", [])) == 1)
    trainer, module = _fit(STEPS, [], ckpt=ckpt)
    ck.true("trained to max_steps", trainer.global_step == STEPS, trainer.global_step)
    start = {**saved, "state_dict": module.at_start["state"]}  # the mean of the replicas (test_periodic_resume)
    ref = _trained_reference(1, STEPS - EPOCH_END, start=start, epoch=1)
    for key, value in _state(module).items():
        ck.close(f"[2 -> 1 rank] == reference from the checkpoint: {key}", value, _state(ref.modules[0])[key], **EQ_TOL)
    for i, g in enumerate(trainer.strategy.averager.global_params):
        ck.close(f"[2 -> 1 rank] global parameter {i} == reference", g, ref.global_params[i], **EQ_TOL)
    moved = max(
        (g - s).abs().max().item() for g, s in zip(ref.global_params, saved["lightning_sync/diloco"]["global_params"])
    )
    ck.true("[2 -> 1 rank] the in-flight sync and the next outer steps moved the global model", moved > 1e-4, moved)
    return ck.result()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_streaming_diloco_in_lightning_resumes_mid_overlap_exactly_and_at_another_world_size(tmp_path: Path) -> None:
    assert_all_ranks_passed(
        run_distributed(_two_ranks, 2, str(tmp_path), timeout=240, env=ENV), min_checks=20, same_count=False
    )
    assert_all_ranks_passed(run_distributed(_one_rank, 1, str(tmp_path), timeout=120, env=ENV), min_checks=5)
