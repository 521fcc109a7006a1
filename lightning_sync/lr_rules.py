"""Learning-rate rules for large global batches: scaling with the batch size, and gradual warmup.

Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (2017): when the global
batch grows k-fold, multiply the learning rate by k (the *linear scaling rule*) and reach it through
a *gradual warmup* that ramps from the original learning rate over the first steps. For adaptive
optimizers (Adam and kin) the square-root rule, lr x sqrt(k), is the usual choice (Malladi et al.,
"On the SDEs and Scaling Rules for Adaptive Gradient Algorithms", 2022).

:func:`scale_lr` is the arithmetic; :class:`ScaledWarmup` is a Lightning callback that applies both
rules to whatever optimizers and LR schedulers ``configure_optimizers`` returned. It lives outside
every strategy and works with each of them (see "Clocks" in :class:`ScaledWarmup`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_sync._checks import check_choice, check_int

__all__ = [
    "LR_SCALINGS",
    "SCALE_KEY",
    "WARMUP_STARTS",
    "LrTargets",
    "ScaledWarmup",
    "lr_scale_factor",
    "scale_lr",
    "warmup_factor",
]

#: Rules accepted by :func:`scale_lr`: f(r) = 1, r or sqrt(r) for r = global batch / base batch.
LR_SCALINGS: tuple[str, ...] = ("none", "linear", "sqrt")
#: Where the warmup starts: ``"base"`` (the unscaled LR, scaled LR / k) or ``"zero"``.
WARMUP_STARTS: tuple[str, ...] = ("base", "zero")
#: Param-group key holding the factor already multiplied into that group's LRs. It is saved with the
#: optimizer's state, so a resumed optimizer is never scaled twice (and is rescaled by k_new / k_old
#: when the global batch changed between runs).
SCALE_KEY = "lr_scale_applied"
#: Where an LR rule applies: the optimizers that update the model, their LR schedulers, the step clock, and a
#: lock to scale under (what a strategy's ``lr_targets(schedulers)`` returns, see :class:`ScaledWarmup`).
LrTargets = tuple[list[torch.optim.Optimizer], list[Any], Callable[[], int], AbstractContextManager[Any]]
# Absolute learning rates a param group or a scheduler may hold (OneCycleLR keeps max_lr / min_lr in
# the groups; CyclicLR max_lrs; ReduceLROnPlateau min_lrs; cosine schedules eta_min). Scaling all of
# them by k makes the user's schedule exactly k times the schedule it would follow unscaled.
_GROUP_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")
_SCHEDULER_LR_ATTRS = ("base_lrs", "_last_lr", "max_lrs", "min_lrs")


def lr_scale_factor(global_batch: int, base_batch: int, rule: str) -> float:
    """The factor f(global_batch / base_batch) of ``rule`` (one of :data:`LR_SCALINGS`).

    ``"none"`` gives 1.0, ``"linear"`` ``global_batch / base_batch``, ``"sqrt"`` its square root.
    """
    check_choice("lr_scaling", rule, LR_SCALINGS)
    check_int("global_batch", global_batch, 1)
    check_int("base_batch", base_batch, 1)
    ratio = global_batch / base_batch
    return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


def scale_lr(lr: float, global_batch: int, base_batch: int, rule: str) -> float:
    """``lr x f(global_batch / base_batch)`` for ``rule`` in :data:`LR_SCALINGS` (see :func:`lr_scale_factor`).

    Example: ``scale_lr(0.1, 1024, 256, "linear") == 0.4``; ``"sqrt"`` gives 0.2.
    """
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    return lr * lr_scale_factor(global_batch, base_batch, rule)


def warmup_factor(step: int, warmup_steps: int, start: float) -> float:
    """The warmup multiplier at optimizer step ``step`` (0-based): ``start + (1.0 - start) * step / warmup_steps``
    while ``step < warmup_steps``, then 1.0. It is ``start`` at step 0 and would reach 1.0 at ``warmup_steps``."""
    if step >= warmup_steps:
        return 1.0
    return start + (1.0 - start) * step / warmup_steps


def _scale_values(values: Any, ratios: list[float]) -> Any:
    if isinstance(values, (list, tuple)) and len(values) == len(ratios):
        return type(values)(v * r for v, r in zip(values, ratios))
    return values


def _scale_scheduler(scheduler: Any, ratios: list[float]) -> None:
    """Multiply a scheduler's absolute LRs (one per param group) by ``ratios``, recursing into
    SequentialLR / ChainedScheduler children. ``eta_min`` (one number for every group) is scaled when
    every group has the same ratio."""
    for attr in _SCHEDULER_LR_ATTRS:
        if hasattr(scheduler, attr):
            setattr(scheduler, attr, _scale_values(getattr(scheduler, attr), ratios))
    if isinstance(getattr(scheduler, "eta_min", None), (int, float)) and len(set(ratios)) == 1:
        scheduler.eta_min = scheduler.eta_min * ratios[0]
    for child in getattr(scheduler, "_schedulers", None) or []:
        _scale_scheduler(child, ratios)


def _scale_optimizer(optimizer: torch.optim.Optimizer, schedulers: list[Any], scale: float) -> bool:
    """Bring every param group (and the schedulers stepping ``optimizer``) to ``scale`` x its unscaled
    LRs, given the factor each group already holds (:data:`SCALE_KEY`). Returns whether anything changed."""
    ratios = [scale / group.get(SCALE_KEY, 1.0) for group in optimizer.param_groups]
    for group, ratio in zip(optimizer.param_groups, ratios):
        if ratio != 1.0:
            for key in _GROUP_LR_KEYS:
                if key in group and group[key] is not None:
                    group[key] = group[key] * ratio
        group[SCALE_KEY] = scale
    if all(r == 1.0 for r in ratios):
        return False
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is optimizer:
            _scale_scheduler(scheduler, ratios)
    return True


class ScaledWarmup(pl.Callback):
    """Scale every optimizer's learning rates with the global batch, and ramp them up over the first steps.

    Goyal et al., 2017 (linear scaling rule and gradual warmup); see the module docstring.

    **Scaling.** k = f(``global_batch_size`` / ``base_batch_size``) by ``lr_scaling`` (:func:`lr_scale_factor`).
    Once the optimizers and schedulers exist (``on_fit_start``, checked again at ``on_train_start``,
    after a checkpoint was restored), every param group of every optimizer from ``configure_optimizers``
    has its own ``lr`` and ``initial_lr`` (plus OneCycleLR's ``max_lr``/``min_lr``) multiplied by k, and so
    do the absolute LRs of the LR schedulers that step it (``base_lrs``, ``_last_lr``, ``max_lrs``,
    ``min_lrs``, ``eta_min``). From then on the user's scheduler works from the scaled LR: it produces
    k x the values it would produce unscaled. The factor applied is recorded in each param group
    (:data:`SCALE_KEY`), which is saved with the optimizer, so a resumed run is not scaled twice (a run
    resumed with another global batch is rescaled by k_new / k_old).

    **Warmup.** At optimizer step s (0-based, the clock below), while s < ``warmup_steps``, the LR used by
    the step is the scheduler's LR times ``w(s) = w0 + (1 - w0) * s / warmup_steps``
    (:func:`warmup_factor`), with ``w0 = 1 / k`` for ``warmup_start="base"`` (step 0 uses the unscaled LR)
    or 0 for ``"zero"`` (step 0 uses LR 0: only the optimizer's statistics move). From step
    ``warmup_steps`` on, the scheduler's LR is used unchanged. The multiplier is applied by a step
    pre-hook on each optimizer (``Optimizer.register_step_pre_hook``) and undone by a step post-hook, so
    it lasts exactly one ``optimizer.step()``: schedulers that read ``group["lr"]`` (StepLR and the
    other chainable ones), checkpoints and ``LearningRateMonitor`` always see the scheduler's own value.
    Gradient-accumulation micro-batches call no ``optimizer.step()``, so they neither use nor advance
    the warmup.

    **Logged:** ``lr/effective`` (float64, exact), the LR the latest optimizer step used (first optimizer, group 0),
    at ``on_train_batch_end`` of the batches that stepped.

    **Clocks.** s is read when the step starts. Except under ``async_ps`` it is ``trainer.global_step``,
    the optimizer steps this process has completed (Lightning restores it on resume, so the warmup
    continues where it stopped):

    * DDP, ``bucketed_ddp``, ``zero1``-``zero3``: every rank takes the same steps.
    * ``local_sgd`` and ``diloco``: each rank's *inner* (local) optimizer steps. DiLoCo's outer
      optimizer (``outer_lr``) is neither scaled nor warmed up. Note that ``LocalSGDStrategy``'s own
      ``warmup_steps`` is something else (its synchronous phase).
    * ``hogwild``: each process's own steps, on each process's own optimizer (as its LR schedulers).
    * ``async_ps``: the optimizer that updates the model lives in the parameter server (on
      ``server_rank``), so scaling and warmup apply *there*, on the strategy's **global clock**:
      ``ParameterServer.global_step`` = pushes applied // K (synchronous steps' worth of samples;
      ``AsyncParameterServerStrategy.global_step``), the clock its step-interval LR schedulers follow.
      The warmup factor multiplies the server's own per-step share (|S| / K, or its square root).
      Workers' optimizers are not touched: they report the server's LR; ``lr/effective`` (the server's
      latest step) is logged by rank 0 when it hosts the server. The server's LRs are scaled at the
      server rank's ``on_fit_start``, just after the server is built; a push applied before that
      would use the unscaled LR.

    Args:
        lr_scaling: ``"none"``, ``"linear"`` or ``"sqrt"`` (:data:`LR_SCALINGS`).
        base_batch_size: the global batch the configured LRs were tuned for (>= 1); needed unless
            ``lr_scaling="none"``.
        global_batch_size: this run's global batch (per-device batch x world size x accumulation); None:
            inferred at ``on_train_start`` from the training DataLoader's ``batch_size`` x
            ``trainer.world_size`` x ``trainer.accumulate_grad_batches``.
        warmup_steps: optimizer steps of warmup (>= 0; 0: none).
        warmup_start: ``"base"`` (ramp from the unscaled LR, i.e. LR / k) or ``"zero"`` (:data:`WARMUP_STARTS`).
    """

    def __init__(
        self,
        lr_scaling: str = "none",
        base_batch_size: int | None = None,
        global_batch_size: int | None = None,
        warmup_steps: int = 0,
        warmup_start: str = "base",
    ) -> None:
        super().__init__()
        self.lr_scaling = check_choice("lr_scaling", lr_scaling, LR_SCALINGS)
        if base_batch_size is not None:
            check_int("base_batch_size", base_batch_size, 1)
        elif lr_scaling != "none":
            raise ValueError(
                f"lr_scaling={lr_scaling!r} needs base_batch_size (an int >= 1, the global batch "
                f"the learning rate was tuned for), got None"
            )
        self.base_batch_size = base_batch_size
        if global_batch_size is not None:
            check_int("global_batch_size", global_batch_size, 1)
        self.global_batch_size = global_batch_size
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.warmup_start = check_choice("warmup_start", warmup_start, WARMUP_STARTS)
        self._scale: float | None = None
        self._start = 0.0
        self._clock: Callable[[], int] = lambda: 0
        self._hooks: list[Any] = []
        self._attached: list[torch.optim.Optimizer] = []
        self._saved: dict[int, list[Any]] = {}
        self._logged_optimizer: torch.optim.Optimizer | None = None
        self._effective: float | None = None
        self._stepped = False
        self._loaded: dict[str, Any] | None = None

    @property
    def scale(self) -> float | None:
        """k, the factor applied to the learning rates (None until fit resolved it)."""
        return self._scale

    def warmup(self, step: int) -> float:
        """The warmup multiplier at optimizer step ``step`` (1.0 once the warmup is over)."""
        return warmup_factor(step, self.warmup_steps, self._start)

    # ------------------------------------------------------------------ resolving and attaching
    def _resolve_scale(self, trainer: pl.Trainer, infer: bool) -> float | None:
        if self.lr_scaling == "none":
            return 1.0
        if self.global_batch_size is None:
            if not infer:
                return None
            per_device = getattr(trainer.train_dataloader, "batch_size", None)
            if not isinstance(per_device, int):
                raise ValueError(
                    f"ScaledWarmup(lr_scaling={self.lr_scaling!r}) cannot infer the global batch: the "
                    f"training DataLoader's batch_size is {per_device!r}; pass global_batch_size"
                )
            self.global_batch_size = per_device * trainer.world_size * trainer.accumulate_grad_batches
        assert self.base_batch_size is not None
        return lr_scale_factor(self.global_batch_size, self.base_batch_size, self.lr_scaling)

    @staticmethod
    def _targets(trainer: pl.Trainer) -> LrTargets:
        """(optimizers that update the model, their schedulers, the step clock, a lock to scale under). A
        strategy whose optimizer steps somewhere else (``async_ps``: in the parameter server) says where through
        its ``lr_targets(schedulers)`` method; the others step ``trainer.optimizers`` on ``trainer.global_step``."""
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        elsewhere = getattr(trainer.strategy, "lr_targets", None)
        if elsewhere is not None:
            return elsewhere(schedulers)
        return list(trainer.optimizers), schedulers, lambda: trainer.global_step, nullcontext()

    def _attach(self, trainer: pl.Trainer, infer: bool) -> None:
        scale = self._resolve_scale(trainer, infer)
        if scale is None:
            return
        optimizers, schedulers, clock, lock = self._targets(trainer)
        with lock:
            changed = [_scale_optimizer(opt, schedulers, scale) for opt in optimizers]
        first = self._scale is None
        self._scale, self._clock = scale, clock
        self._start = 1.0 / scale if self.warmup_start == "base" else 0.0
        if not self._hooks:
            self._attached = list(optimizers)
            for opt in optimizers:
                self._hooks += [
                    opt.register_step_pre_hook(self._pre_step),
                    opt.register_step_post_hook(self._post_step),
                ]
            self._logged_optimizer = optimizers[0] if optimizers else None
        if first:
            ratio = (
                ""
                if self.lr_scaling == "none"
                else f" ({self.lr_scaling} rule: global batch {self.global_batch_size}"
                f" / base batch {self.base_batch_size})"
            )
            start = "the unscaled lr (lr / k)" if self.warmup_start == "base" else "0"
            warm = f"; warmup over {self.warmup_steps} optimizer steps from {start}" if self.warmup_steps else ""
            rank_zero_info(f"ScaledWarmup: lr x k, k = {scale:.6g}{ratio}{warm}")
            if self.warmup_steps and self.warmup_start == "base" and scale == 1.0:
                rank_zero_warn(
                    "ScaledWarmup: warmup_start='base' with k = 1 ramps from the LR to itself (no "
                    "warmup); use warmup_start='zero' to warm up an unscaled LR",
                    category=UserWarning,
                )
        elif any(changed) and self._loaded is not None and self._loaded.get("scale") not in (None, scale):
            rank_zero_info(
                f"ScaledWarmup: the checkpoint's LRs were scaled by {self._loaded['scale']:.6g}; "
                f"rescaled to k = {scale:.6g}"
            )

    # ------------------------------------------------------------------ optimizer step hooks
    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        factor = self.warmup(self._clock())
        self._saved[id(optimizer)] = [group["lr"] for group in optimizer.param_groups]
        if factor != 1.0:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * factor
        if optimizer is self._logged_optimizer:
            self._effective = float(optimizer.param_groups[0]["lr"])
            self._stepped = True

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._restore(optimizer)

    def _restore(self, optimizer: torch.optim.Optimizer) -> None:
        saved = self._saved.pop(id(optimizer), None)
        if saved is not None:
            for group, lr in zip(optimizer.param_groups, saved):
                group["lr"] = lr

    def _detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._attached, self._saved, self._logged_optimizer = [], [], {}, None

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._detach()  # a callback reused for a second fit attaches to that fit's optimizers

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._attach(trainer, infer=False)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._attach(trainer, infer=True)  # after the checkpoint's optimizer state: idempotent (SCALE_KEY)
        if self._loaded is not None:
            mine = {k: v for k, v in self.state_dict().items() if k not in ("scale", "global_batch_size")}
            theirs = {k: self._loaded.get(k) for k in mine}
            if mine != theirs:
                rank_zero_warn(
                    f"ScaledWarmup: resumed with other settings than the checkpoint's: now {mine}, "
                    f"checkpoint {theirs}; the warmup follows the new ones from global step "
                    f"{trainer.global_step}",
                    category=UserWarning,
                )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._stepped and self._effective is not None:
            self._stepped = False
            # float64 on the CPU: the logger receives exactly the LR the step used (Lightning casts a float to fp32)
            value = torch.tensor(self._effective, dtype=torch.float64)
            pl_module.log("lr/effective", value, on_step=True, on_epoch=False)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            for optimizer in self._attached:  # a step that raised left its warmup multiplier in place
                self._restore(optimizer)
            self._detach()

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "lr_scaling": self.lr_scaling,
            "base_batch_size": self.base_batch_size,
            "global_batch_size": self.global_batch_size,
            "warmup_steps": self.warmup_steps,
            "warmup_start": self.warmup_start,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Only remembered, to report a change of settings: the LRs' scale travels with the optimizer's
        param groups (:data:`SCALE_KEY`) and the warmup's position is ``trainer.global_step``."""
        self._loaded = dict(state_dict)
