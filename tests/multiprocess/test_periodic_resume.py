"""Exact resume of LocalSGD and DiLoCo from a checkpoint taken between two syncs, on 2 real gloo ranks.

Between syncs every rank trains its own replica with its own optimizer, so a checkpoint there must give
each rank back *its* replica, *its* optimizer state and the counters of the period (DiLoCo: the global
model and the outer Nesterov momentum too), while the checkpoint's ``state_dict`` stays the synchronized
model a user exports. Each run stops by a step-interval ``ModelCheckpoint`` and ``max_steps`` inside a
period and inside an epoch, with ``accumulate_grad_batches=2`` and AdamW (per-rank moments) under a
per-step LR schedule; a fresh Trainer resumes it with ``ckpt_path``. The resumed run must train on the
uninterrupted run's samples, draw its random numbers, and end with bitwise its weights on every rank
(same batches, same ops, same order). The uninterrupted run itself equals a single-process reference
that trains the K replicas side by side.

Another world size: a 2-rank checkpoint taken at an epoch's end (inside a period) resumed by 1 rank starts
the replica from the mean of the saved replicas with rank 0's optimizer state, keeps the counters and
DiLoCo's outer state, and continues as a single-process reference started from that state does.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from _lightning_reference import (
    ENV,
    EQ_TOL,
    MIN_MOVE,
    _quiet_rank,
    _state,
    _TiedModule,
    _token_data,
    _train_replicas,
    _trainer,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from test_exact_resume import BATCH, N
from test_exact_resume import _Recorded as _IndexedRecording

from lightning_sync import DiLoCoStrategy, LocalSGDStrategy, comms
from lightning_sync.resume import RANK_STATES
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

# The communication context of this process's checks (a strategy owns one the same way).
CTX = comms.CommContext(observer=comms.CommStats())

ACCUMULATE = 2  # N = 128 samples, BATCH = 4: 2 ranks take 16 micro-batches each per epoch, 8 optimizer steps
H, WARMUP = 3, 1  # local_sgd syncs after steps 4, 7, 10 (one synchronous step first); diloco after 3, 6, 9
STEPS = 10
CKPT_STEP = 5  # inside epoch 0 and inside a period of both
EPOCH_END = 8  # the end of epoch 0, inside a period of both: the checkpoint another world size resumes
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
KEYS = {"local_sgd": "lightning_sync/local_sgd", "diloco": "lightning_sync/diloco"}
# Averaging K replicas (an all-reduce here, a sum then a divide in the reference) and DiLoCo's outer step
# differ from the reference only in fp32 rounding order, ~1e-7 relative; over 10 AdamW steps (lr 0.01) on
# weights ~1 that stays far below 1e-5 (EQ_TOL). A lost replica or optimizer state moves weights by ~1e-3.
AVG_TOL = {"rtol": 0.0, "atol": 1e-6}  # one average of 2 fp32 replicas ~1: a few ulps


def _strategy(kind: str) -> Any:
    if kind == "local_sgd":
        return LocalSGDStrategy(sync_every=H, warmup_steps=WARMUP, bucket_cap_mb=0.001)
    return DiLoCoStrategy(sync_every=H, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM)


class _Recorded(_IndexedRecording):
    """AdamW, a per-step StepLR, loader without workers; records each training batch's sample indices and
    the user code's RNG draws (``test_exact_resume``), and this rank's replica, optimizer state and the
    period's counters when training starts (after Lightning and the strategy restored a checkpoint)."""

    def __init__(self) -> None:
        super().__init__({"num_workers": 0})
        self.at_start: dict[str, Any] = {}

    def on_train_start(self) -> None:
        strategy = self.trainer.strategy
        self.at_start = {
            "state": _state(self),
            "optimizer": _optimizer_tensors(self.trainer.optimizers[0]),
            "steps": strategy.averager.steps,
            "syncs": strategy.averager.syncs,
            "outer": _outer(strategy),
        }


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """An optimizer's per-parameter state, flat: ``"<param index>/<key>" -> tensor`` (copies)."""
    state = optimizer.state_dict()["state"]
    return {f"{i}/{k}": torch.as_tensor(v).clone() for i, s in state.items() for k, v in s.items()}


def _outer(strategy: Any) -> dict[str, torch.Tensor]:
    """DiLoCo's global parameters and outer momentum buffers (copies); nothing for local_sgd."""
    if not isinstance(strategy, DiLoCoStrategy):
        return {}
    outer = strategy.averager
    out = {f"global/{i}": g.detach().clone() for i, g in enumerate(outer.global_params)}
    for i, g in enumerate(outer.global_params):
        if "momentum_buffer" in outer.outer_optimizer.state.get(g, {}):  # after the first outer step
            out[f"momentum/{i}"] = outer.outer_optimizer.state[g]["momentum_buffer"].clone()
    return out


def _fit(
    kind: str, max_steps: int, callbacks: list[Any], ckpt: Path | None = None, **kw: Any
) -> tuple[pl.Trainer, _Recorded]:
    return _fit_recorded(_strategy(kind), max_steps, callbacks, ckpt, **kw)


def _fit_recorded(
    strategy: Any, max_steps: int, callbacks: list[Any], ckpt: Path | None = None, **kw: Any
) -> tuple[pl.Trainer, _Recorded]:
    """A :class:`_Recorded` fit under ``strategy`` on this rank's group, with accumulation, resumed from ``ckpt``."""
    # every fit starts from the same RNG states; a resume must replace them with the saved ones
    random.seed(100 + comms.get_rank())
    np.random.seed(200)
    torch.manual_seed(300)
    module = _Recorded()
    trainer = _trainer(
        comms.get_world_size(),
        strategy,
        max_steps=max_steps,
        accumulate_grad_batches=ACCUMULATE,
        callbacks=callbacks,
        **kw,
    )
    trainer.fit(module, ckpt_path=ckpt)
    return trainer, module


# --------------------------------------------------------------------------- the single-process reference


def _reference(
    kind: str, world: int, steps: int, start: dict[str, Any] | None = None, epoch: int = 0
) -> list[dict[str, torch.Tensor]]:
    """K replicas trained side by side in this process, each on the batches its rank gets, with its own
    AdamW and StepLR; local_sgd averages the gradients for the warm-up steps and the parameters every H
    steps after, diloco steps the global parameters with the outer Nesterov SGD on the mean of
    ``global - replica`` every H steps and copies them into every replica. ``start``: a checkpoint every
    replica starts from (model, rank 0's optimizer and scheduler, the counters, the outer state), at the
    start of ``epoch``. Returns each replica's final state."""
    reps = [_TiedModule("adamw", _token_data(N), scheduler=True) for _ in range(world)]
    configured = [m.configure_optimizers() for m in reps]
    opts = [c["optimizer"] for c in configured]
    scheds = [c["lr_scheduler"]["scheduler"] for c in configured]
    done = 0
    if start is not None:
        for m, o, s in zip(reps, opts, scheds):
            m.load_state_dict(start["state_dict"])
            o.load_state_dict(start["optimizer_states"][0])
            s.load_state_dict(start["lr_schedulers"][0])
        done = start[KEYS[kind]]["steps"]
    trainable = [p for p in reps[0].parameters() if p.requires_grad]
    global_params = [torch.nn.Parameter(p.detach().clone()) for p in trainable]
    outer = torch.optim.SGD(global_params, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    trainables = [[p for p in m.parameters() if p.requires_grad] for m in reps]
    if start is not None and kind == "diloco":
        with torch.no_grad():
            for g, saved in zip(global_params, start[KEYS[kind]]["global_params"]):
                g.copy_(saved)
        outer.load_state_dict(start[KEYS[kind]]["outer_optimizer"])
    counter = {"done": done}

    def synchronous() -> None:
        if kind == "local_sgd" and counter["done"] < WARMUP:  # every replica steps with the mean gradient
            _mean_into([[p.grad for p in m.parameters() if p.grad is not None] for m in reps])

    def sync() -> None:
        counter["done"] += 1
        done = counter["done"]
        if kind == "local_sgd" and done > WARMUP and (done - WARMUP) % H == 0:
            _mean_into([[p.data for p in m.parameters()] for m in reps])
        if kind == "diloco" and done % H == 0:
            with torch.no_grad():
                for i, g in enumerate(global_params):
                    g.grad = sum(g.detach() - t[i].detach() for t in trainables) / world
            outer.step()
            outer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for t in trainables:
                    for p, g in zip(t, global_params):
                        p.copy_(g)

    _train_replicas(reps, opts, scheds, N, steps, ACCUMULATE, epoch, BATCH, synchronous, sync)
    return [_state(m) for m in reps]


def _mean_into(per_replica: list[list[torch.Tensor]]) -> None:
    """Set the i-th tensor of every replica to the mean over replicas of the i-th tensors."""
    with torch.no_grad():
        for same in zip(*per_replica):
            mean = sum(same) / len(same)
            for t in same:
                t.copy_(mean)


# --------------------------------------------------------------------------- 2 ranks: stop mid-period, resume


def _same_run(ck: Checks, tag: str, whole: _Recorded, first: _Recorded, resumed: _Recorded, steps: int) -> None:
    """The stopped and the resumed run, joined, trained on the uninterrupted run's samples and drew its numbers."""
    done = steps * ACCUMULATE
    ck.true(f"{tag} stopped run trained {done} micro-batches", len(first.seen) == done, len(first.seen))
    joined = first.seen + resumed.seen
    ck.true(
        f"{tag} sample indices of every batch equal the uninterrupted run's",
        joined == whole.seen,
        next((i for i, (a, b) in enumerate(zip(joined, whole.seen)) if a != b), (len(joined), len(whole.seen))),
    )
    ck.true(
        f"{tag} RNG draws in user code continue the uninterrupted run's",
        resumed.draws == whole.draws[done:],
        (resumed.draws[:1], whole.draws[done : done + 1]),
    )


def _check_kind(ck: Checks, kind: str, tmpdir: Path) -> None:
    world = comms.get_world_size()
    # the uninterrupted run; it also writes the end-of-epoch checkpoint that 1 rank resumes below
    epoch_end = ModelCheckpoint(dirpath=tmpdir / kind / "epoch_end", every_n_train_steps=EPOCH_END, save_top_k=-1)
    trainer, whole = _fit(kind, STEPS, [epoch_end], enable_checkpointing=True)
    final = _state(whole)
    outer_final = _outer(trainer.strategy)
    counters = (trainer.strategy.averager.steps, trainer.strategy.averager.syncs)
    ref = _reference(kind, world, STEPS)[comms.get_rank()]
    init = _state(_TiedModule("adamw", _token_data(N)))
    for key, value in final.items():
        ck.close(f"[{kind}] uninterrupted == single-process reference: {key}", value, ref[key], **EQ_TOL)
    moved = max((ref[k] - init[k]).abs().max().item() for k in ref)
    ck.true(f"[{kind}] the reference moved the weights", moved > MIN_MOVE, moved)

    # stop inside a period: the replicas differ, and the checkpoint's state_dict is the synchronized model
    dirpath = tmpdir / kind / "mid_period"
    saver = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=CKPT_STEP, save_top_k=-1)
    trainer, first = _fit(kind, CKPT_STEP, [saver], enable_checkpointing=True)
    stopped = _state(first)
    stopped_opt = _optimizer_tensors(trainer.optimizers[0])
    replicas = CTX.all_gather_object(stopped)
    drift = max((replicas[0][k] - replicas[1][k]).abs().max().item() for k in stopped)
    ck.true(f"[{kind}] the replicas differ at the stop (inside a period)", drift > 1e-6, drift)
    ckpt = dirpath / f"epoch=0-step={CKPT_STEP}.ckpt"
    ck.true(f"[{kind}] the checkpoint was written", ckpt.is_file(), sorted(p.name for p in dirpath.iterdir()))
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    if kind == "local_sgd":
        model = {k: sum(r[k] for r in replicas) / world for k in stopped}
    else:  # the global model of the last outer step (step 3), identical on every rank (tied weights: each name)
        outer = trainer.strategy.averager
        global_of = {id(p): g.detach() for p, g in zip(outer.params, outer.global_params)}
        model = {k: global_of.get(id(v), v).detach() for k, v in first.state_dict(keep_vars=True).items()}
    for key, value in saved["state_dict"].items():
        ck.close(f"[{kind}] the checkpoint's state_dict is the synchronized model: {key}", value, model[key], **AVG_TOL)

    # a fresh Trainer resumes it: this rank's replica and optimizer state are back before the first step
    trainer, resumed = _fit(kind, STEPS, [], ckpt=ckpt)
    for key, value in resumed.at_start["state"].items():
        ck.true(
            f"[{kind}] resume starts from this rank's replica: {key}",
            torch.equal(value, stopped[key]),
            (value - stopped[key]).abs().max().item(),
        )
    start_opt = resumed.at_start["optimizer"]
    ck.true(
        f"[{kind}] resume starts from this rank's optimizer state",
        start_opt.keys() == stopped_opt.keys() and all(torch.equal(start_opt[k], v) for k, v in stopped_opt.items()),
        max(((start_opt[k] - v).abs().max().item() for k, v in stopped_opt.items() if k in start_opt), default=None),
    )
    ck.true(
        f"[{kind}] the period's counters continue",
        (resumed.at_start["steps"], resumed.at_start["syncs"])
        == (CKPT_STEP, (CKPT_STEP - WARMUP) // H if kind == "local_sgd" else CKPT_STEP // H),
        resumed.at_start,
    )
    _same_run(ck, f"[{kind}]", whole, first, resumed, CKPT_STEP)
    for key, value in _state(resumed).items():
        # same batches, same ops, same order as the uninterrupted run: bitwise equal
        ck.true(
            f"[{kind}] resumed == uninterrupted: {key}",
            torch.equal(value, final[key]),
            (value - final[key]).abs().max().item(),
        )
    for key, value in _outer(trainer.strategy).items():
        ck.true(
            f"[{kind}] outer state resumed == uninterrupted: {key}",
            torch.equal(value, outer_final[key]),
            (value - outer_final[key]).abs().max().item(),
        )
    ck.true(
        f"[{kind}] counters at the end == uninterrupted",
        (trainer.strategy.averager.steps, trainer.strategy.averager.syncs) == counters,
        ((trainer.strategy.averager.steps, trainer.strategy.averager.syncs), counters),
    )


def _two_ranks(rank: int, world: int, tmpdir: str) -> tuple[list[str], int]:
    _quiet_rank()
    ck = Checks()
    for kind in KEYS:
        _check_kind(ck, kind, Path(tmpdir))
    return ck.result()


# --------------------------------------------------------------------------- another world size: 1 rank


def _mean_of_replicas(saved: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model state the checkpoint's replicas average to (every name of a tied parameter; a rank whose
    replica does not hold a tensor had the saved value)."""
    replicas = []
    for entry in saved[RANK_STATES]:
        module = _TiedModule("adamw", _token_data(N))
        module.load_state_dict(saved["state_dict"])
        live = module.state_dict(keep_vars=True)
        with torch.no_grad():
            for key, value in entry["replica"].items():
                live[key].copy_(value)
        replicas.append(_state(module))
    return {k: sum(r[k].double() for r in replicas).div(len(replicas)).to(replicas[0][k].dtype) for k in replicas[0]}


def _one_rank(rank: int, world: int, tmpdir: str) -> tuple[list[str], int]:
    _quiet_rank()
    ck = Checks()
    for kind in KEYS:
        ckpt = Path(tmpdir) / kind / "epoch_end" / f"epoch=0-step={EPOCH_END}.ckpt"
        saved = torch.load(ckpt, map_location="cpu", weights_only=False)
        trainer, module = _fit(kind, STEPS, [], ckpt=ckpt)
        at_start = module.at_start
        start = {**saved, "state_dict": _mean_of_replicas(saved)}
        for key, value in at_start["state"].items():
            # local_sgd's saved model is that mean (in fp32, this one in fp64: an ulp apart); diloco's is not
            ck.close(
                f"[{kind} 2 -> 1 rank] starts from the mean of the saved replicas: {key}",
                value,
                start["state_dict"][key],
                **AVG_TOL,
            )
        if kind == "diloco":  # the replicas' inner progress since the last outer step is kept
            gone = max(
                (start["state_dict"][k] - saved["state_dict"][k]).abs().max().item() for k in start["state_dict"]
            )
            ck.true(f"[{kind} 2 -> 1 rank] the mean is not the global model", gone > 1e-4, gone)
        rank0 = {
            f"{i}/{k}": torch.as_tensor(v)
            for i, s in saved["optimizer_states"][0]["state"].items()
            for k, v in s.items()
        }
        ck.true(
            f"[{kind} 2 -> 1 rank] starts from rank 0's optimizer state",
            at_start["optimizer"].keys() == rank0.keys()
            and all(torch.equal(at_start["optimizer"][k], v) for k, v in rank0.items()),
        )
        ck.true(f"[{kind} 2 -> 1 rank] the counters continue", at_start["steps"] == EPOCH_END, at_start["steps"])
        if kind == "diloco":  # the outer state is global: kept whatever the world size
            state = saved[KEYS[kind]]
            saved_outer = {f"global/{i}": g for i, g in enumerate(state["global_params"])}
            saved_outer.update(
                {f"momentum/{i}": s["momentum_buffer"] for i, s in state["outer_optimizer"]["state"].items()}
            )
            ck.true(
                f"[{kind} 2 -> 1 rank] the outer state continues",
                at_start["outer"].keys() == saved_outer.keys()
                and all(torch.equal(at_start["outer"][k], v) for k, v in saved_outer.items()),
            )
        ck.true(f"[{kind} 2 -> 1 rank] trained to max_steps", trainer.global_step == STEPS, trainer.global_step)
        # it continues as one process started from that state does (epoch 1 of a 1-rank sampler); the
        # same ops in one process, the tolerance is the one of the 2-rank comparison
        ref = _reference(kind, 1, STEPS - EPOCH_END, start=start, epoch=1)[0]
        for key, value in _state(module).items():
            ck.close(f"[{kind} 2 -> 1 rank] == reference from the checkpoint: {key}", value, ref[key], **EQ_TOL)
        moved = max((ref[k] - saved["state_dict"][k]).abs().max().item() for k in ref)
        ck.true(f"[{kind} 2 -> 1 rank] the continuation moved the weights", moved > 1e-4, moved)
    return ck.result()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_local_sgd_and_diloco_resume_mid_period_exactly_and_at_another_world_size(tmp_path: Path) -> None:
    assert_all_ranks_passed(
        run_distributed(_two_ranks, 2, str(tmp_path), timeout=420, env=ENV), min_checks=40, same_count=False
    )
    assert_all_ranks_passed(
        run_distributed(_one_rank, 1, str(tmp_path), timeout=150, env=ENV), min_checks=20, same_count=False
    )
