"""BucketedDDPStrategy on 2 and 3 real gloo ranks, each scenario against a single-process reference.

Every test spawns its ranks once (:func:`~lightning_sync.testing.run_distributed`: seconds per run) and
runs several ``Trainer.fit`` calls in sequence inside them, each on a fresh model. Ranks never raise on
a mismatch: a :class:`~lightning_sync.testing.Checks` collects the failures and the parent asserts
(:func:`~lightning_sync.testing.assert_all_ranks_passed`), so every rank takes part in every collective.

The single-process reference (``_lightning_reference.py``, shared with the ShardedStrategy tests) walks
exactly the batches Lightning hands each rank: Lightning replaces the training sampler with
``DistributedSampler(shuffle=True, seed=PL_GLOBAL_SEED)``, so the reference builds that sampler for every
rank ``r`` (``set_epoch(e)`` per epoch), computes each rank's mean loss on its batch, and backpropagates
their average (divided again by ``accumulate_grad_batches``, as Lightning's automatic optimization
does), then takes one optimizer step.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import textwrap
import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _lightning_reference import (
    BATCH,
    ENV,
    STEPS,
    _check_against,
    _quiet_rank,
    _reference,
    _state,
    _TiedModule,
    _token_data,
    _trainer,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.aggregation import MeanMetric, SumMetric

from lightning_sync import BucketedDDPStrategy
from lightning_sync.models import DigitsDataModule, DigitsMLP, SyntheticDataModule, WideMLP
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

__all__: list[str] = []

TINY_MB, MID_MB, HUGE_MB = 0.0001, 0.002, 1000.0  # ~100 B: a bucket per 1-2 parameters; ~2 KiB: a few; one


class _CommCounter(pl.Callback):
    """Per backward: all-reduces issued (CommStats delta), bucket count, and the bucketer's trace."""

    def __init__(self) -> None:
        self.deltas: list[int] = []
        self.buckets: list[int] = []
        self.bytes: list[int] = []
        self.traces: list[Any] = []
        self.steps: list[int] = []
        self.members: list[list[list[nn.Parameter]]] = []  # per backward: each bucket's parameters
        self.batches: list[torch.Tensor] = []  # per batch: its inputs
        self._calls = self._bytes = 0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.batches.append(batch[0].clone())

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        s = trainer.strategy.comm.observer["all_reduce"]
        self._calls, self._bytes = s.calls, s.bytes

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        s = trainer.strategy.comm.observer["all_reduce"]
        bucketer = trainer.strategy.bucketer  # type: ignore[attr-defined]
        self.deltas.append(s.calls - self._calls)
        self.bytes.append(s.bytes - self._bytes)
        self.buckets.append(len(bucketer.buckets))
        self.traces.append(bucketer.trace)
        self.steps.append(bucketer.step)
        self.members.append([[bucketer.params[i] for i in b.members] for b in bucketer.buckets])


# --------------------------------------------------------------------------- 1 + 2: equivalence, accumulation

# (optimizer, bucket_cap_mb, first_bucket_mb, gradient_as_bucket_view); run at every world size
_EQUIV = [
    ("sgd", TINY_MB, TINY_MB, True),
    ("sgd", TINY_MB, TINY_MB, False),
    ("sgd", HUGE_MB, HUGE_MB, True),
    ("adamw", TINY_MB, TINY_MB, False),
    ("adamw", MID_MB, TINY_MB, True),
    ("adamw", HUGE_MB, HUGE_MB, False),
]
# (accumulate_grad_batches, bucket_cap_mb, gradient_as_bucket_view, optimizer)
_ACCUM = [(2, TINY_MB, True, "sgd"), (3, TINY_MB, False, "adamw"), (3, MID_MB, True, "sgd")]


def _equivalence_worker(rank: int, world: int) -> tuple[list[str], int, dict[str, dict[str, torch.Tensor]]]:
    _quiet_rank()
    ck = Checks()
    finals: dict[str, dict[str, torch.Tensor]] = {}
    ds = _token_data()
    for opt, cap, first, view in _EQUIV:
        tag = f"[W={world} {opt} cap={cap} first={first} view={view}]"
        init = _state(_TiedModule(opt))
        ref = _reference(_TiedModule(opt), ds, world, STEPS)["state"]
        module = _TiedModule(opt, ds)
        strategy = BucketedDDPStrategy(bucket_cap_mb=cap, first_bucket_mb=first, gradient_as_bucket_view=view)
        counter = _CommCounter()
        _trainer(world, strategy, max_steps=STEPS, callbacks=[counter]).fit(module)
        _check_against(ck, tag, module, ref, init)
        finals[tag] = _state(module)
        expect_many = cap == TINY_MB
        ck.true(f"{tag} bucket count", (min(counter.buckets) >= 5) if expect_many else True, counter.buckets)
        if cap == HUGE_MB:
            ck.true(f"{tag} one bucket", set(counter.buckets) == {1}, counter.buckets)
        ck.true(
            f"{tag} one all-reduce per bucket", counter.deltas == counter.buckets, (counter.deltas, counter.buckets)
        )
        frozen = [n for n in init if n.startswith("net.frozen")]
        for name in frozen:
            ck.close(f"{tag} frozen {name} unchanged", module.state_dict()[name], init[name])
    for accumulate, cap, view, opt in _ACCUM:
        tag = f"[W={world} accumulate={accumulate} cap={cap} view={view} {opt}]"
        init = _state(_TiedModule(opt))
        ref = _reference(_TiedModule(opt), ds, world, STEPS // 2, accumulate=accumulate)["state"]
        module = _TiedModule(opt, ds)
        strategy = BucketedDDPStrategy(bucket_cap_mb=cap, first_bucket_mb=TINY_MB, gradient_as_bucket_view=view)
        counter = _CommCounter()
        _trainer(world, strategy, max_steps=STEPS // 2, accumulate_grad_batches=accumulate, callbacks=[counter]).fit(
            module
        )
        _check_against(ck, tag, module, ref, init)
        finals[tag] = _state(module)
        # micro-step k (0-based) is a boundary iff (k + 1) % accumulate == 0 (all within epoch 0)
        expected = [n if (k + 1) % accumulate == 0 else 0 for k, n in enumerate(counter.buckets)]
        ck.true(f"{tag} micro-steps", len(counter.deltas) == accumulate * (STEPS // 2), counter.deltas)
        ck.true(
            f"{tag} zero all-reduces off the boundary, one per bucket on it",
            counter.deltas == expected,
            (counter.deltas, expected),
        )
        ck.true(f"{tag} several buckets", min(counter.buckets) >= 3, counter.buckets)
    return (*ck.result(), finals)


def _assert_replicas_identical(results: list[tuple[Any, ...]]) -> None:
    """Every rank holds bit-identical weights: each applied the same all-reduced gradient."""
    for r, res in enumerate(results[1:], start=1):
        for tag, state in res[2].items():
            for name, value in state.items():
                assert torch.equal(value, results[0][2][tag][name]), f"rank {r} drifted from rank 0: {tag} {name}"


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_equivalence_and_accumulation_match_single_process(world: int) -> None:
    results = run_distributed(_equivalence_worker, world, timeout=200, env=ENV)
    assert_all_ranks_passed(results, min_checks=len(_EQUIV) * 10 + len(_ACCUM) * 10)
    _assert_replicas_identical(results)


# --------------------------------------------------------------------------- 3, 4, 6, 8: overlap .. metrics

SLOW_BACKWARD_S = 0.05  # a fixed delay in the first layer's backward; nothing here waits for a condition
_SLOW_STARTS: list[float] = []  # perf_counter() when each slow backward began (this process)


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps a fixed time: a deliberately slow first layer."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _SLOW_STARTS.append(time.perf_counter())
        time.sleep(SLOW_BACKWARD_S)
        return grad


class _SlowFirstModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(7)
            self.first = nn.Linear(32, 64)
            self.rest = nn.Sequential(
                nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
            )
            x = torch.randn(64, 32)
        self.ds = TensorDataset(x, (x[:, :10]).argmax(1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.rest(_SlowBackward.apply(self.first(x))), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.ds, batch_size=8, shuffle=True)


def _check_overlap(ck: Checks, world: int) -> None:
    module = _SlowFirstModule()
    counter = _CommCounter()
    strategy = BucketedDDPStrategy(bucket_cap_mb=TINY_MB, first_bucket_mb=TINY_MB)
    _SLOW_STARTS.clear()
    _trainer(world, strategy, max_steps=3, callbacks=[counter]).fit(module)
    first = {id(p) for p in module.first.parameters()}
    ck.true("[overlap] one slow backward per step", len(_SLOW_STARTS) == 3, _SLOW_STARTS)
    ck.true("[overlap] several buckets", min(counter.buckets) >= 4, counter.buckets)
    for step, (trace, slow_start) in enumerate(zip(counter.traces, _SLOW_STARTS)):
        launched = trace.launched_at
        ck.true(f"[overlap step {step}] every bucket launched", None not in launched, launched)
        ck.true(
            f"[overlap step {step}] launched during backward",
            trace.launched_during_backward >= 1,
            (launched, trace.backward_end),
        )
        # Buckets without the first layer's parameters are complete before the slow backward starts,
        # so each must have been issued by then (timestamps from the same clock, no thresholds).
        early = [
            t
            for t, members in zip(launched, counter.members[step])
            if not first & {id(p) for p in members} and t is not None
        ]
        ck.true(
            f"[overlap step {step}] buckets issued before the slow first layer's backward",
            len(early) >= 3 and all(t < slow_start for t in early),
            (early, slow_start),
        )
        ck.true(f"[overlap step {step}] launched in index order", launched == sorted(launched), launched)


def _lightning_unused_sentence() -> str:
    """The first sentence of the message Lightning's ``strategy="ddp"`` raises for unused parameters, read from
    Lightning's source (``DDPStrategy.on_exception`` passes it as a literal, not a constant we could import)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(DDPStrategy.on_exception)))
    (text,) = [k.value.value for k in ast.walk(tree) if isinstance(k, ast.keyword) and k.arg == "new_message"]
    sentence = text[: text.index(". ") + 1]
    assert sentence.startswith("It looks like your LightningModule has parameters"), sentence
    return sentence


def _check_unused(ck: Checks, world: int) -> None:
    ds = _token_data()
    # find_unused_parameters=False: every rank's fit raises with Lightning's own sentence (what users search
    # for), then naming both parameters of the unused layer
    module = _TiedModule("sgd", ds, unused=True)
    strategy = BucketedDDPStrategy(bucket_cap_mb=TINY_MB, first_bucket_mb=TINY_MB)
    ck.raises(
        "[unused=False] fit raises naming the parameters",
        lambda: _trainer(world, strategy, max_steps=2).fit(module),
        "^" + re.escape(_lightning_unused_sentence()),
        r"net\.unused\.weight",
        r"net\.unused\.bias",
        r"find_unused_parameters=True",
        exc=RuntimeError,
    )
    # find_unused_parameters=True: the same as one process, where the unused layer's grad is None (SGD
    # skips it) and the "sometimes" layer gets the average of the ranks that used it (zeros elsewhere)
    for view in (True, False):
        tag = f"[unused=True view={view}]"
        init = _state(_TiedModule("sgd", unused=True, sometimes=True))
        ref = _reference(_TiedModule("sgd", unused=True, sometimes=True), ds, world, STEPS)
        module = _TiedModule("sgd", ds, unused=True, sometimes=True)
        strategy = BucketedDDPStrategy(
            bucket_cap_mb=TINY_MB, first_bucket_mb=TINY_MB, gradient_as_bucket_view=view, find_unused_parameters=True
        )
        _trainer(world, strategy, max_steps=STEPS).fit(module)
        _check_against(ck, tag, module, ref["state"], init)
        for name in ("net.unused.weight", "net.unused.bias"):
            ck.close(f"{tag} {name} untouched", module.state_dict()[name], init[name])
        # the data must exercise both cases: a step where only some ranks used the layer (its gradient
        # is their average, zeros elsewhere) and one where no rank did (its grad stays None: no update)
        ck.true(
            f"{tag} 'sometimes' used by some ranks only in one step, by none in another",
            any(0 < u < world for u in ref["usage"]) and 0 in ref["usage"],
            ref["usage"],
        )


# Lightning restarts a mid-epoch resume at the epoch's first batch (its DataLoader is not stateful), so
# the checkpoint is taken at an epoch end: 24 samples on 2 ranks of batch 4 are 3 steps an epoch.
RESUME_SAMPLES, RESUME_K, RESUME_N = 24, 3, 7


def _check_resume(ck: Checks, world: int, tmpdir: str) -> None:
    ds = _token_data(RESUME_SAMPLES)
    for compression in (None, "powersgd"):
        tag = f"[resume compression={compression}]"
        kw: dict[str, Any] = {
            "bucket_cap_mb": TINY_MB,
            "first_bucket_mb": TINY_MB,
            "compression": compression,
            "powersgd_rank": 1,
            "powersgd_warmup_steps": 1,
        }
        dirpath = os.path.join(tmpdir, f"ckpt-{compression}")
        # uninterrupted n steps, checkpointing every k steps along the way
        full = _TiedModule("sgd", ds)
        saver = ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=RESUME_K, save_top_k=-1)
        full_counter = _CommCounter()
        _trainer(
            world,
            BucketedDDPStrategy(**kw),
            max_steps=RESUME_N,
            callbacks=[saver, full_counter],
            enable_checkpointing=True,
        ).fit(full)
        # k steps restored from the checkpoint, then trained on to n
        resumed = _TiedModule("sgd", ds)
        counter = _CommCounter()
        strategy = BucketedDDPStrategy(**kw)
        trainer = _trainer(world, strategy, max_steps=RESUME_N, callbacks=[counter])
        trainer.fit(resumed, ckpt_path=os.path.join(dirpath, f"step={RESUME_K}.ckpt"))
        ck.true(
            f"{tag} resumed at step k",
            len(counter.steps) == RESUME_N - RESUME_K and trainer.global_step == RESUME_N,
            (counter.steps, trainer.global_step),
        )
        ck.true(
            f"{tag} resumed run saw the uninterrupted run's batches",
            all(torch.equal(a, b) for a, b in zip(counter.batches, full_counter.batches[RESUME_K:])),
            (counter.batches, full_counter.batches),
        )
        # The resumed run performs the same float operations on the same values as the uninterrupted one
        # (same batches, optimizer and compressor state restored bit for bit), so the weights agree exactly.
        for name, value in _state(resumed).items():
            ck.close(f"{tag} {name}", value, _state(full)[name])
        ck.true(
            f"{tag} bucketer step counter continued",
            counter.steps == full_counter.steps[RESUME_K:],
            (counter.steps, full_counter.steps),
        )
        ck.true(
            f"{tag} same buckets as the uninterrupted run",
            _plans(counter) == _plans(full_counter)[RESUME_K:],
            (_plans(counter), _plans(full_counter)),
        )
        if compression == "powersgd":  # compressed steps happened before k, so error feedback mattered
            ck.true(
                f"{tag} compressed before the checkpoint",
                full_counter.bytes[RESUME_K - 1] < full_counter.bytes[0],
                full_counter.bytes,
            )


def _plans(counter: _CommCounter) -> list[list[list[tuple[int, ...]]]]:
    return [[[tuple(p.shape) for p in members] for members in step] for step in counter.members]


N_VAL = 40  # divisible by 2 ranks x batch 4: Lightning's DistributedSampler(shuffle=False) adds no padding


class _MetricModule(pl.LightningModule):
    """Validation logs torchmetrics metrics of rank-dependent data and rank-dependent ``sync_dist`` values."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.total = SumMetric()
        self.mean = MeanMetric()

    def validation_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        (x,) = batch
        self.total.update(x.sum())
        self.mean.update(x)
        self.log("val_total", self.total, on_epoch=True)
        self.log("val_mean", self.mean, on_epoch=True)
        value = torch.tensor(float(self.global_rank + 1))
        self.log("rank_mean", value, sync_dist=True)  # per rank: mean over batches = rank + 1
        self.log("rank_sum", value, sync_dist=True, reduce_fx="sum")  # per rank: 5 * (rank + 1)
        self.log("rank_max", value, sync_dist=True, reduce_fx="max")


def _check_metrics(ck: Checks, world: int) -> None:
    values = torch.arange(N_VAL, dtype=torch.float32) / 4  # quarters: every sum here is exact in float32
    loader = DataLoader(TensorDataset(values), batch_size=BATCH)
    strategy = BucketedDDPStrategy()
    ops: list[Any] = []
    original = strategy.reduce

    def spy(tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        ops.append(reduce_op)
        return original(tensor, group=group, reduce_op=reduce_op)

    strategy.reduce = spy  # type: ignore[method-assign]
    before = strategy.comm.observer["all_reduce"].calls
    trainer = _trainer(world, strategy)
    trainer.validate(_MetricModule(), dataloaders=loader)
    got = trainer.callback_metrics
    batches_per_rank = N_VAL // world // BATCH
    ranks = torch.arange(1, world + 1, dtype=torch.float32)
    # Exact: sums and means of quarters up to 10 over 40 values are exact in float32 (< 2^24 quarters).
    ck.close("[metrics] SumMetric over all ranks' data", got["val_total"], values.sum())
    ck.close("[metrics] MeanMetric over all ranks' data", got["val_mean"], values.mean())
    ck.close("[metrics] sync_dist mean", got["rank_mean"], ranks.mean())
    ck.close("[metrics] sync_dist sum", got["rank_sum"], batches_per_rank * ranks.sum())
    ck.close("[metrics] sync_dist max", got["rank_max"], ranks.max())
    ck.true("[metrics] sync_dist went through the strategy's reduce", len(ops) >= 3, ops)
    ck.true(
        "[metrics] ... and through the strategy's communication context",
        strategy.comm.observer["all_reduce"].calls - before >= 3,
        strategy.comm.observer.table(),
    )


def _misc_worker(rank: int, world: int, tmpdir: str) -> tuple[list[str], int]:
    _quiet_rank()
    ck = Checks()
    _check_overlap(ck, world)
    _check_unused(ck, world)
    _check_resume(ck, world, tmpdir)
    _check_metrics(ck, world)
    return ck.result()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_overlap_unused_resume_and_metrics(tmp_path: Any) -> None:
    results = run_distributed(_misc_worker, 2, str(tmp_path), timeout=200, env=ENV)
    assert_all_ranks_passed(results, min_checks=60)


# --------------------------------------------------------------------------- 5: compression

DIGITS_EPOCHS = 8
# fp16/bf16 change each averaged gradient by at most one rounding of the low precision (2^-11 / 2^-8
# relative), so training follows nearly the same path: the issue asks for val accuracy within 1% of
# uncompressed (359 validation images: 1% is ~3.6 images).
CAST_ACC_TOL = 0.01
# PowerSGD rank 2 with error feedback keeps SGD's accuracy in Vogels et al.; digits reaches ~0.97
# uncompressed here, chance is 0.10. 0.85 is far above chance and above what the uncompressed model
# has after its first epoch, so a compressor that drops or garbles most of the gradient fails it,
# while leaving room for rank-2 approximation slowing training down a little.
POWERSGD_MIN_ACC = 0.85


def _digits_accuracy(world: int, compression: str | None) -> float:
    torch.manual_seed(0)  # the same initial weights for every compression (rank 0's are broadcast)
    model, data = DigitsMLP(), DigitsDataModule(batch_size=32)
    strategy = BucketedDDPStrategy(compression=compression, powersgd_rank=2, powersgd_warmup_steps=10)
    trainer = _trainer(world, strategy, max_epochs=DIGITS_EPOCHS, check_val_every_n_epoch=DIGITS_EPOCHS)
    trainer.fit(model, datamodule=data)  # validates once, after the last epoch
    return float(trainer.callback_metrics["val_acc"])


def _wide_bytes_per_step(world: int, compression: str | None, steps: int) -> _CommCounter:
    torch.manual_seed(0)
    model, data = WideMLP(), SyntheticDataModule(num_samples=64, batch_size=8, val_samples=8)
    counter = _CommCounter()
    strategy = BucketedDDPStrategy(compression=compression, powersgd_rank=2, powersgd_warmup_steps=1)
    _trainer(world, strategy, max_steps=steps, limit_val_batches=0, callbacks=[counter]).fit(model, datamodule=data)
    return counter


def _compression_worker(rank: int, world: int) -> tuple[list[str], int, dict[str, float]]:
    _quiet_rank()
    ck = Checks()
    acc = {str(c): _digits_accuracy(world, c) for c in (None, "fp16", "bf16", "powersgd")}
    for c in ("fp16", "bf16"):
        ck.true(
            f"[digits] {c} val accuracy within {CAST_ACC_TOL} of uncompressed",
            abs(acc[c] - acc["None"]) <= CAST_ACC_TOL,
            acc,
        )
    ck.true(
        f"[digits] powersgd rank 2 converges (val acc >= {POWERSGD_MIN_ACC})", acc["powersgd"] >= POWERSGD_MIN_ACC, acc
    )
    # WideMLP (8,403,978 float32 parameters): all-reduced bytes per step, from CommStats
    grad_bytes = 4 * sum(p.numel() for p in WideMLP().parameters())
    plain = _wide_bytes_per_step(world, None, steps=2)
    ck.true(
        "[wide] uncompressed: exactly the gradient bytes every step",
        plain.bytes == [grad_bytes] * 2,
        (plain.bytes, grad_bytes),
    )
    fp16 = _wide_bytes_per_step(world, "fp16", steps=2)
    ck.true("[wide] fp16: exactly half", [2 * b for b in fp16.bytes] == plain.bytes, (fp16.bytes, plain.bytes))
    psgd = _wide_bytes_per_step(world, "powersgd", steps=3)  # step 0: warm-up (uncompressed)
    ck.true("[wide] powersgd warm-up step uncompressed", psgd.bytes[0] == grad_bytes, psgd.bytes)
    ratios = [b / grad_bytes for b in psgd.bytes[1:]]
    ck.true(
        "[wide] powersgd rank 2 below 10% of uncompressed after warm-up", len(ratios) == 2 and max(ratios) < 0.1, ratios
    )
    return (*ck.result(), {**acc, "powersgd_bytes_ratio": max(ratios)})


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_compression_accuracy_and_bytes() -> None:
    results = run_distributed(_compression_worker, 2, timeout=200, env=ENV)
    assert_all_ranks_passed(results, min_checks=7)
    print(f"digits val accuracy and PowerSGD byte ratio: {results[0][2]}")
