"""ScaledWarmup and scale_lr in one process: real (tiny) Lightning fits on CPU with devices=1.

The LRs are compared with ``==``: the expected values are computed in float with the same operations
the callback performs (scaled = lr * k once, then scaled * (w0 + (1.0 - w0) * s / W) at step s), and
the StepLR gamma is 0.5, whose products are exact in binary, so the order of multiplication is moot.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sync import AsyncParameterServerStrategy
from lightning_sync.lr_rules import SCALE_KEY, ScaledWarmup, _scale_optimizer, lr_scale_factor, scale_lr
from lightning_sync.sync.ps.server import ParameterServer

LR, LR2 = 0.01, 0.002
GAMMA, STEP_SIZE = 0.5, 3


class _Tiny(pl.LightningModule):
    def __init__(self, groups: int = 1, step_lr: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        self._groups, self._step_lr = groups, step_lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.b(torch.relu(self.a(x))), y)

    def configure_optimizers(self) -> Any:
        if self._groups == 1:
            opt = torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)
        else:
            opt = torch.optim.SGD(
                [{"params": self.a.parameters()}, {"params": self.b.parameters(), "lr": LR2}], lr=LR, momentum=0.9
            )
        if not self._step_lr:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=STEP_SIZE, gamma=GAMMA)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _Spy(pl.Callback):
    """The LR each optimizer step used (read inside the step, after the pre-hooks), per group,
    and the LR the optimizer holds between steps (what the scheduler set)."""

    def __init__(self) -> None:
        self.applied: list[tuple[int, list[float]]] = []
        self.between: list[list[float]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.applied.append((trainer.global_step, [g["lr"] for g in optimizer.param_groups]))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.between.append([g["lr"] for g in trainer.optimizers[0].param_groups])


class _Capture(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    name, version = "capture", 0  # type: ignore[assignment]

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((int(step or 0), dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def _fit(
    callback: ScaledWarmup | None,
    max_steps: int,
    accumulate: int = 1,
    groups: int = 1,
    step_lr: bool = False,
    ckpt: Path | None = None,
    save: Path | None = None,
) -> tuple[_Spy, _Capture]:
    spy, logger = _Spy(), _Capture()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        callbacks=[c for c in (callback, spy) if c is not None],
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_Tiny(groups, step_lr), DataLoader(data, batch_size=4), ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    return spy, logger


def _closed_form(lr: float, k: float, warmup: int, start: str, steps: range, step_lr: bool = False) -> list[float]:
    """lr x k, times the StepLR decay, times w(s) = w0 + (1 - w0) s / W during warmup; in float, as applied."""
    scaled = lr * k
    w0 = 1.0 / k if start == "base" else 0.0
    out = []
    for s in steps:
        sched = scaled * GAMMA ** (s // STEP_SIZE) if step_lr else scaled
        out.append(sched * (w0 + (1.0 - w0) * s / warmup) if s < warmup else sched)
    return out


def _logged(logger: _Capture) -> list[float]:
    return [m["lr/effective"] for _, m in logger.rows if "lr/effective" in m]


@pytest.mark.parametrize("start", ["base", "zero"])
def test_applied_and_logged_lr_follow_the_linear_scaled_warmup_exactly(start: str) -> None:
    cb = ScaledWarmup("linear", base_batch_size=8, global_batch_size=24, warmup_steps=5, warmup_start=start)
    spy, logger = _fit(cb, max_steps=8)
    expected = _closed_form(LR, 3.0, 5, start, range(8))
    assert [s for s, _ in spy.applied] == list(range(8))
    assert [lrs[0] for _, lrs in spy.applied] == expected
    assert _logged(logger) == expected
    assert cb.scale == 3.0
    assert all(lrs == [LR * 3.0] for lrs in spy.between), "the warmup multiplier must last one step only"


def test_accumulation_micro_steps_do_not_advance_the_warmup() -> None:
    """4 x 1 x 2 = 8 samples a step (inferred); base 2: k = 4. 12 micro-batches are 6 optimizer steps."""
    cb = ScaledWarmup("linear", base_batch_size=2, warmup_steps=4)
    spy, logger = _fit(cb, max_steps=6, accumulate=2)
    assert cb.global_batch_size == 8 and cb.scale == 4.0
    assert len(spy.between) == 12, "every micro-batch ran"
    assert [s for s, _ in spy.applied] == list(range(6))
    expected = _closed_form(LR, 4.0, 4, "base", range(6))
    assert [lrs[0] for _, lrs in spy.applied] == expected
    assert _logged(logger) == expected, "one logged value per optimizer step, none for micro-steps"


def test_step_lr_takes_over_unchanged_after_warmup_times_the_scale() -> None:
    ref, _ = _fit(None, max_steps=10, step_lr=True)
    cb = ScaledWarmup("linear", base_batch_size=8, global_batch_size=24, warmup_steps=4)
    spy, logger = _fit(cb, max_steps=10, step_lr=True)
    applied = [lrs[0] for _, lrs in spy.applied]
    assert applied == _closed_form(LR, 3.0, 4, "base", range(10), step_lr=True)
    assert applied[4:] == [lrs[0] * 3.0 for _, lrs in ref.applied][4:], "after warmup: the scheduler's values x k"
    assert [b[0] for b in spy.between] == [b[0] * 3.0 for b in ref.between], "the scheduler never sees the warmup"
    assert _logged(logger) == applied


def test_every_param_group_is_scaled_from_its_own_lr() -> None:
    cb = ScaledWarmup("sqrt", base_batch_size=4, global_batch_size=16, warmup_steps=3)  # k = sqrt(4) = 2
    spy, _ = _fit(cb, max_steps=5, groups=2)
    assert cb.scale == 2.0
    for group, lr in enumerate((LR, LR2)):
        assert [lrs[group] for _, lrs in spy.applied] == _closed_form(lr, 2.0, 3, "base", range(5))


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_resume_mid_warmup_continues_the_schedule_and_does_not_rescale(tmp_path: Path) -> None:
    ckpt = tmp_path / "mid.ckpt"
    make = lambda: ScaledWarmup("linear", base_batch_size=8, global_batch_size=24, warmup_steps=6)  # noqa: E731
    first, _ = _fit(make(), max_steps=4, step_lr=True, save=ckpt)
    state = torch.load(ckpt, weights_only=False)
    group = state["optimizer_states"][0]["param_groups"][0]
    assert group["lr"] == LR * 3.0 * GAMMA and group["initial_lr"] == LR * 3.0 and group[SCALE_KEY] == 3.0
    assert state["lr_schedulers"][0]["base_lrs"] == [LR * 3.0]
    second, logger = _fit(make(), max_steps=9, step_lr=True, ckpt=ckpt)
    expected = _closed_form(LR, 3.0, 6, "base", range(9), step_lr=True)
    assert [lrs[0] for _, lrs in first.applied] == expected[:4]
    assert [s for s, _ in second.applied] == list(range(4, 9))
    assert [lrs[0] for _, lrs in second.applied] == expected[4:]
    assert _logged(logger) == expected[4:]


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_resume_from_an_unscaled_checkpoint_scales_once(tmp_path: Path) -> None:
    ckpt = tmp_path / "plain.ckpt"
    _fit(None, max_steps=2, save=ckpt)
    cb = ScaledWarmup("linear", base_batch_size=8, global_batch_size=16, warmup_steps=0)
    spy, _ = _fit(cb, max_steps=4, ckpt=ckpt)
    assert [lrs for _, lrs in spy.applied] == [[LR * 2.0]] * 2


@pytest.mark.parametrize(
    "make",
    [
        lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.3),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 7, eta_min=1e-3),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=12),
        lambda o: torch.optim.lr_scheduler.CyclicLR(o, 0.01, 0.1, step_size_up=3),
        lambda o: torch.optim.lr_scheduler.SequentialLR(
            o,
            [torch.optim.lr_scheduler.LinearLR(o, 0.2, total_iters=3), torch.optim.lr_scheduler.ExponentialLR(o, 0.9)],
            [3],
        ),
    ],
    ids=["step", "lambda", "cosine", "onecycle", "cyclic", "sequential"],
)
def test_scaling_makes_any_scheduler_k_times_its_unscaled_schedule(make: Any) -> None:
    """rtol 1e-12: the same products taken in another order differ in the last bits."""

    def run(scale: float | None) -> list[float]:
        groups = [{"params": [nn.Parameter(torch.zeros(1))]}, {"params": [nn.Parameter(torch.zeros(1))], "lr": 0.02}]
        opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9)
        sched = make(opt)
        if scale is not None:
            assert _scale_optimizer(opt, [sched], scale)
            assert not _scale_optimizer(opt, [sched], scale), "a second call changes nothing"
        out = []
        for _ in range(12):
            out += [g["lr"] for g in opt.param_groups]
            opt.step()
            sched.step()
        return out

    plain, scaled = run(None), run(2.5)
    assert len(set(plain)) > 2, "the schedule moves"
    assert scaled == pytest.approx([2.5 * v for v in plain], rel=1e-12)


def test_async_ps_scales_the_servers_optimizer_on_the_global_clock() -> None:
    """The server's optimizer (not the workers') is scaled and warmed up, by ParameterServer.global_step."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    params = list(model.parameters())
    server = ParameterServer(params, [], torch.optim.SGD(params, lr=LR), 2, 0)
    strategy = AsyncParameterServerStrategy()
    strategy.server = server
    trainer = SimpleNamespace(strategy=strategy, lr_scheduler_configs=[], optimizers=[], global_step=0)
    cb = ScaledWarmup("linear", base_batch_size=8, global_batch_size=32, warmup_steps=3)
    cb._attach(trainer, infer=False)  # type: ignore[arg-type]
    assert server.optimizer.param_groups[0]["lr"] == LR * 4.0
    seen = []
    for step in range(5):
        for worker in (0, 1):  # max_staleness 0: one optimizer step per global step, share 2/2 = 1
            grads = server.layout.flatten([torch.ones_like(p) for p in params])
            server.push(worker, server._read[worker], grads, [True] * len(params), [])
            server.pull(worker)
        seen.append(cb._effective)
        assert server.global_step == step + 1 and server.optimizer.param_groups[0]["lr"] == LR * 4.0
    assert seen == _closed_form(LR, 4.0, 3, "base", range(5))
    cb._detach()


def test_scale_lr_rules() -> None:
    assert scale_lr(0.1, 1024, 256, "linear") == 0.1 * 4.0
    assert scale_lr(0.1, 1024, 256, "sqrt") == 0.1 * 2.0
    assert scale_lr(0.1, 1024, 256, "none") == 0.1
    assert lr_scale_factor(96, 64, "linear") == 1.5 and lr_scale_factor(32, 64, "sqrt") == math.sqrt(0.5)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: scale_lr(0.1, 64, 32, "cubic"),
            r"lr_scaling must be one of \['none', 'linear', 'sqrt'\], got 'cubic'",
        ),
        (lambda: scale_lr(0.1, 0, 32, "linear"), r"global_batch must be an int >= 1, got 0"),
        (lambda: scale_lr(0.1, 64, 2.5, "linear"), r"base_batch must be an int >= 1, got 2.5"),
        (lambda: scale_lr(-1.0, 64, 32, "linear"), r"lr must be a finite number >= 0, got -1.0"),
        (lambda: ScaledWarmup("Linear", 32), r"lr_scaling must be one of \['none', 'linear', 'sqrt'\], got 'Linear'"),
        (lambda: ScaledWarmup("linear"), r"lr_scaling='linear' needs base_batch_size .* got None"),
        (lambda: ScaledWarmup("sqrt", base_batch_size=-4), r"base_batch_size must be an int >= 1, got -4"),
        (
            lambda: ScaledWarmup("linear", 32, global_batch_size=True),
            r"global_batch_size must be an int >= 1, got True",
        ),
        (lambda: ScaledWarmup(warmup_steps=-1), r"warmup_steps must be an int >= 0, got -1"),
        (lambda: ScaledWarmup(warmup_steps=2.0), r"warmup_steps must be an int >= 0, got 2.0"),
        (lambda: ScaledWarmup(warmup_start="one"), r"warmup_start must be one of \['base', 'zero'\], got 'one'"),
    ],
)
def test_bad_arguments_name_the_value_and_the_allowed_ones(call: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_warmup_from_base_without_scaling_warns() -> None:
    with pytest.warns(UserWarning, match="warmup_start='base' with k = 1"):
        _fit(ScaledWarmup(warmup_steps=2), max_steps=1)
