"""Shared pieces of the Lightning-level multi-process tests: a small model with tied weights and a frozen
layer, its data, and a single-process reference that walks exactly the batches Lightning hands each rank.

Lightning replaces the training sampler with ``DistributedSampler(shuffle=True, seed=PL_GLOBAL_SEED)``,
so :func:`_reference` builds that sampler for every rank ``r`` (``set_epoch(e)`` per epoch), computes
each rank's mean loss on its batch, and backpropagates their average (divided again by
``accumulate_grad_batches``, as Lightning's automatic optimization does), then (optionally) clips the
gradient norm, takes one optimizer step and steps a per-step LR scheduler.

:class:`_Sections` runs the scenarios of one spawned group of ranks, one :class:`Checks` each, so that a test
function asserts one scenario family and a failure names it.

Used by ``test_bucketed_ddp.py``, ``test_sharded_strategy.py``, ``test_sharded_full_checkpoint.py``,
``test_sharded_callbacks.py``, ``test_sharded_amp.py`` and ``test_sharded_optimizers.py``; not a test module
itself.
"""

from __future__ import annotations

import logging
import os
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import Strategy
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_sync.testing import Checks, assert_all_ranks_passed

__all__ = [
    "BATCH",
    "DIM",
    "ENV",
    "EQ_TOL",
    "HIDDEN",
    "LR_GAMMA",
    "LR_STEP_SIZE",
    "MIN_MOVE",
    "N_TRAIN",
    "SEED",
    "SEQ",
    "STEPS",
    "VOCAB",
    "_QUIET",
    "_Sections",
    "_IndexedModule",
    "_LogLines",
    "_TiedModule",
    "_TiedNet",
    "_assert_section",
    "_check_against",
    "_quiet_rank",
    "_rank_batches",
    "_reference",
    "_same_on_every_rank",
    "_state",
    "_token_data",
    "_trainer",
]

SEED = 11  # PL_GLOBAL_SEED in every rank; Lightning seeds its DistributedSampler with it (not the default 0)
ENV = {"PL_GLOBAL_SEED": str(SEED)}
VOCAB, DIM, HIDDEN, SEQ = 40, 16, 48, 5
BATCH = 4  # per rank
N_TRAIN = 288  # 2 ranks: 36 batches per rank and epoch; 3 ranks: 24 (divisible by accumulate 2 and 3)
STEPS = 6

# Tolerance of the equivalence checks. The distributed run averages per-rank gradients with an
# all-reduce (float32 sum over ranks, then a divide), the reference accumulates loss/(W*A) gradients
# into .grad: the two differ only in float32 rounding order, ~1e-7 relative per gradient value. Over
# 6 steps of SGD+momentum (lr 0.1) or AdamW (lr 0.01; its update is normalised, so a relative change
# of the gradient moves the update by about the same relative amount) on weights of magnitude <= ~1,
# that stays below ~1e-6 (observed max: 5e-7). 1e-5 is the bound, still far below what a bug
# does: a missing or doubled average, a stale, skipped or double-counted bucket, or a wrong sample
# each move weights by ~1e-3 or more (every scenario checks the weights moved by > 1e-2 from init).
EQ_TOL = {"rtol": 0.0, "atol": 1e-5}
MIN_MOVE = 1e-2

_QUIET = {
    "enable_checkpointing": False,
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}

# A per-step StepLR (``scheduler=True``): the learning rate halves every 2 optimizer steps.
LR_STEP_SIZE, LR_GAMMA = 2, 0.5


def _quiet_rank() -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


# --------------------------------------------------------------------------- models and data


def _token_data(n: int = N_TRAIN) -> TensorDataset:
    """Deterministic token sequences; the target is the first token (learnable through the tied head)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return TensorDataset(ids, ids[:, 0].clone())


class _TiedNet(nn.Module):
    """Embedding tied with the output head, a frozen layer, and parameters from 1 to 768 values.

    ``unused``: a layer that never takes part in the loss. ``sometimes``: a layer used only when the
    batch's first target is even, so whether it gets a gradient depends on the rank and the step.
    Trainable values: 2281 (odd, and 1 mod 3), so a flat buffer needs padding at 2 and at 3 ranks.
    """

    def __init__(self, unused: bool = False, sometimes: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.sometimes = nn.Linear(DIM, DIM) if sometimes else None
        self.scale = nn.Parameter(torch.ones(()))  # a 0-d parameter: one value
        self.head = nn.Linear(DIM, VOCAB)
        self.head.weight = self.embed.weight  # tied: one parameter, used twice per forward
        self.unused = nn.Linear(3, 3) if unused else None

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen(self.embed(ids).mean(1)))
        h = h + self.fc2(torch.tanh(self.fc1(h)))
        if self.sometimes is not None and int(targets[0]) % 2 == 0:
            h = h + self.sometimes(h)
        return self.scale * self.head(h)


class _TiedModule(pl.LightningModule):
    """``optimizer``: ``"sgd"`` (momentum 0.9) or ``"adamw"``; ``scheduler``: add a per-step StepLR."""

    def __init__(
        self, optimizer: str = "sgd", ds: TensorDataset | None = None, *, scheduler: bool = False, **net_kw: bool
    ) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(1234)  # the same initial weights in every rank and in the reference
            self.net = _TiedNet(**net_kw)
        self.optimizer_name = optimizer
        self.scheduler = scheduler
        self.ds = ds if ds is not None else _token_data()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, y = batch
        return F.cross_entropy(self.net(ids, y), y)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":  # no weight decay: an unused parameter (grad None) stays put
            opt: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=LR_STEP_SIZE, gamma=LR_GAMMA)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.ds, batch_size=BATCH, shuffle=True)  # Lightning swaps in a DistributedSampler


class _IndexedModule(_TiedModule):
    """``_TiedModule`` (a per-step StepLR with ``scheduler``) on ``n`` token samples whose batches of ``batch`` carry
    their sample indices, recorded per micro-batch in ``seen``; ``loader``: more ``DataLoader`` arguments."""

    def __init__(
        self, optimizer: str = "sgd", n: int = N_TRAIN, batch: int = BATCH, scheduler: bool = True, **loader: Any
    ) -> None:
        super().__init__(optimizer, _token_data(n), scheduler=scheduler)
        ids, y = self.ds.tensors
        self.indexed = TensorDataset(ids, y, torch.arange(len(y)))
        self.batch, self.loader = batch, loader
        self.seen: list[list[int]] = []

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        ids, y, idx = batch
        self.seen.append(idx.tolist())
        return super().training_step((ids, y), batch_idx)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.indexed, batch_size=self.batch, shuffle=True, **self.loader)


def _rank_batches(n: int, world: int, epoch: int, batch: int = BATCH) -> list[list[list[int]]]:
    """``[rank][batch] -> sample indices``: what Lightning's DistributedSampler gives each rank."""
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    out = []
    for r in range(world):
        sampler = DistributedSampler(
            range(n),
            num_replicas=world,
            rank=r,  # type: ignore[arg-type]
            shuffle=True,
            seed=seed,
        )
        sampler.set_epoch(epoch)
        idx = list(sampler)
        out.append([idx[i : i + batch] for i in range(0, len(idx), batch)])
    return out


def _reference(
    module: pl.LightningModule,
    ds: TensorDataset,
    world: int,
    steps: int,
    accumulate: int = 1,
    batch: int = BATCH,
    clip: float | None = None,
    clip_algorithm: str = "norm",
) -> dict[str, Any]:
    """Train ``module`` in this one process on the global batches of ``world`` ranks; return a summary.

    ``clip``: before each step, ``torch.nn.utils.clip_grad_norm_`` to this norm (``clip_algorithm="norm"``)
    or ``clip_grad_value_`` to this value (``"value"``), as Lightning's ``gradient_clip_val`` does. The
    summary holds the final ``state``, per-step ``usage`` of the ``sometimes`` layer, the pre-clip
    gradient ``norms`` (norm clipping), the ``lrs`` each step used, and the ``optimizer``.
    """
    configured = module.configure_optimizers()
    if isinstance(configured, dict):
        opt, sched = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    else:
        opt, sched = configured, None
    x, y = ds.tensors
    epoch, micro = 0, 0
    batches = _rank_batches(len(ds), world, epoch, batch)
    assert len(batches[0]) % accumulate == 0, "an accumulation window must not straddle epochs"
    usage: list[int] = []  # "sometimes" layer: on how many ranks it was used, per step
    norms: list[float] = []
    lrs: list[float] = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        used = 0
        for _ in range(accumulate):
            if micro == len(batches[0]):
                epoch, micro = epoch + 1, 0
                batches = _rank_batches(len(ds), world, epoch, batch)
            for r in range(world):
                idx = batches[r][micro]
                used += int(int(y[idx][0]) % 2 == 0)
                loss = module.training_step((x[idx], y[idx]), micro)
                (loss / (world * accumulate)).backward()
            micro += 1
        usage.append(used)
        if clip is not None and clip_algorithm == "norm":
            norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), clip)))
        elif clip is not None:
            torch.nn.utils.clip_grad_value_(module.parameters(), clip)
        lrs.append(float(opt.param_groups[0]["lr"]))
        opt.step()
        if sched is not None:
            sched.step()
    return {"state": _state(module), "usage": usage, "norms": norms, "lrs": lrs, "optimizer": opt}


def _train_replicas(
    reps: list[Any],
    opts: list[torch.optim.Optimizer],
    scheds: list[Any],
    n: int,
    steps: int,
    accumulate: int,
    epoch: int = 0,
    batch: int = BATCH,
    before_step: Callable[[], None] | None = None,
    after_step: Callable[[], None] | None = None,
) -> None:
    """K replicas trained side by side, each on the batches its rank gets (``accumulate`` micro-batches a step,
    epochs running on), with its own optimizer and per-step scheduler: what the periodic strategies' ranks do
    between their syncs. ``before_step``: after the gradients, before the optimizers step (a synchronous step's
    average); ``after_step``: after they stepped (a sync)."""
    x, y = reps[0].ds.tensors
    micro, batches = 0, _rank_batches(n, len(reps), epoch, batch)
    for _ in range(steps):
        for o in opts:
            o.zero_grad(set_to_none=True)
        for _ in range(accumulate):
            if micro == len(batches[0]):
                epoch, micro = epoch + 1, 0
                batches = _rank_batches(n, len(reps), epoch, batch)
            for r, m in enumerate(reps):
                idx = batches[r][micro]
                (m.training_step((x[idx], y[idx]), micro) / accumulate).backward()
            micro += 1
        if before_step is not None:
            before_step()
        for o, s in zip(opts, scheds):
            o.step()
            s.step()
        if after_step is not None:
            after_step()


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _check_against(
    ck: Checks,
    tag: str,
    module: nn.Module,
    ref: dict[str, torch.Tensor],
    init: dict[str, torch.Tensor],
    tol: dict[str, float] = EQ_TOL,
) -> None:
    """Every tensor of ``module`` equals the reference; and the reference did move (a check that can fail)."""
    for name, value in _state(module).items():
        ck.close(f"{tag} {name}", value, ref[name], **tol)
    moved = max((ref[k] - init[k]).abs().max().item() for k in ref)
    ck.true(f"{tag} weights moved", moved > MIN_MOVE, f"max |ref - init| = {moved}")


def _same_on_every_rank(ck: Checks, tag: str, state: dict[str, torch.Tensor]) -> None:
    """Rank 0's tensors, broadcast (a collective), equal this rank's bit for bit."""
    theirs = [state]
    dist.broadcast_object_list(theirs, src=0)
    for name, value in state.items():
        ck.close(f"{tag} {name} same on every rank", value, theirs[0][name], rtol=0.0, atol=0.0)


def _trainer(world: int, strategy: Strategy, **kw: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, **{**_QUIET, **kw})


# --------------------------------------------------------------------------- sections of one spawned group


class _LogLines(logging.Handler):
    """Keeps the messages of the records at ``level`` and above that reach the logger it is added to."""

    def __init__(self, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class _Sections:
    """One :class:`Checks` per scenario family; an exception inside one becomes one of its failures."""

    def __init__(self) -> None:
        self.checks: dict[str, Checks] = {}
        self.extra: dict[str, Any] = {}

    def run(self, name: str, fn: Callable[..., None], *args: Any) -> None:
        ck = self.checks.setdefault(name, Checks())
        try:
            fn(ck, *args)
        except Exception:  # noqa: BLE001 - recorded; every rank raises at the same point here
            ck.true(f"[{name}] raised", False, traceback.format_exc()[-3000:])

    def result(self) -> dict[str, Any]:
        """Per section ``(failures, count)``; a failure keeps its first line (values are long tensors),
        a traceback its last lines."""
        short = {k: ([_shorten(f) for f in v.failures], v.count) for k, v in self.checks.items()}
        return {"sections": short, **self.extra}


def _shorten(failure: str) -> str:
    if "Traceback" in failure:
        return failure[:200] + " ... " + failure[-1500:]
    return failure.split("\n")[0][:500]


def _assert_section(results: list[dict[str, Any]], name: str, min_checks: int, same_count: bool = True) -> None:
    assert_all_ranks_passed([r["sections"][name] for r in results], min_checks=min_checks, same_count=same_count)
