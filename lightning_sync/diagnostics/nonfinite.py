"""``NonFiniteGuard``: a NaN or Inf gradient skips the optimizer step on every rank; too many in a row abort.

Just before each optimizer step (after the strategy has synchronized the gradients, so a NaN on one rank
has usually reached all of them) every rank checks its gradients and the ranks agree with
``strategy.reduce_boolean_decision(any, all=False)``: if any rank saw a non-finite value, every rank sets
every gradient to ``None``, so the optimizer leaves every parameter, its state and its weight decay alone
(the step is skipped; a step-interval LR scheduler still ticks, as in Lightning's AMP skip). Skips are
counted (:attr:`NonFiniteGuard.skipped`, the metric ``nonfinite/skipped``, and ``comm/nonfinite_skipped`` in
the strategy's per-step telemetry) and each is logged once with the global step. ``max_consecutive`` skips
in a row raise a ``RuntimeError`` on every rank, naming the steps.

It works where ``param.grad`` holds the synchronized gradient before the step: ``bucketed_ddp``, Lightning's
``ddp``, ``local_sgd``/``diloco`` (local gradients) and single-device runs. ZeRO/FSDP-style strategies keep
their own gradient shards and are not covered.
"""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import torch

from lightning_sync._checks import check_int
from lightning_sync.strategies._telemetry import NONFINITE

__all__ = ["NonFiniteGuard"]

log = logging.getLogger("lightning_sync.diagnostics")


class NonFiniteGuard(pl.Callback):
    """Skip optimizer steps whose gradients hold a NaN or Inf on any rank; abort after ``max_consecutive``.

    Args:
        max_consecutive: consecutive skipped steps that end the run with an error (an int >= 1).
    """

    def __init__(self, max_consecutive: int = 10) -> None:
        self.max_consecutive = check_int("max_consecutive", max_consecutive, 1)
        self.skipped = 0
        self.skipped_steps: list[int] = []
        self._run = 0

    def comm_gauges(self) -> dict[str, float]:
        """The skips so far, for the strategy's per-step telemetry
        (:class:`~lightning_sync.strategies._telemetry.GaugeSource`)."""
        return {NONFINITE: float(self.skipped)}

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        bad_here = any(not bool(torch.isfinite(g).all()) for g in grads)
        if not trainer.strategy.reduce_boolean_decision(bad_here, all=False):
            self._run = 0
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        self.skipped += 1
        self._run += 1
        step = trainer.global_step + 1  # the step being skipped, 1-based
        self.skipped_steps.append(step)
        pl_module.log("nonfinite/skipped", float(self.skipped), rank_zero_only=True)
        if trainer.is_global_zero:
            log.warning(
                "non-finite gradient%s: optimizer step %d skipped on every rank (%d skipped so far)",
                " here" if bad_here else " on another rank",
                step,
                self.skipped,
            )
        if self._run >= self.max_consecutive:
            steps = self.skipped_steps[-self._run :]
            raise RuntimeError(
                f"{self._run} consecutive optimizer steps had non-finite gradients (steps {steps}); "
                f"max_consecutive={self.max_consecutive}: stopping instead of training on"
            )
