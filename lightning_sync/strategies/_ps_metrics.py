"""What the asynchronous parameter server (``async_ps``) reports to Lightning's loggers, on rank 0.

Workers run on their own clocks, so Lightning's own ``global_step`` says little about training as a whole.
After each of rank 0's optimizer steps, the server's view as of rank 0's latest reply joins the strategy's
communication telemetry (:mod:`lightning_sync.strategies._telemetry`, logged through ``LightningModule.log``,
so at ``log_every_n_steps``): ``ps/global_step`` (pushes applied // K), ``ps/version``, the mean and largest
staleness of the gradients applied so far, and ``comm/staleness``, the staleness of rank 0's own push of that
step (NaN for a push discarded because the budget was spent). At the end of fit the staleness histogram
follows (``ps/staleness_count/<s>``, a TensorBoard histogram where that logger is used, and one line of text).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_sync.strategies._telemetry import STALENESS

__all__ = ["log_final", "step_metrics"]


def step_metrics(reply: Any, staleness: int | None) -> dict[str, float]:
    """The server's clock and staleness as of ``reply``, and ``staleness``, that of the push it answered (None:
    the push was discarded, so it has none: NaN is logged, as Lightning would otherwise repeat the last value)."""
    counts = reply.staleness
    n = sum(counts.values())
    metrics = {
        "ps/global_step": float(reply.global_step),
        "ps/version": float(reply.version),
        "ps/staleness_mean": sum(k * v for k, v in counts.items()) / n if n else 0.0,
        "ps/staleness_max": float(max(counts, default=0)),
    }
    metrics[STALENESS] = float(staleness) if staleness is not None else math.nan
    return metrics


def log_final(trainer: Any, counts: dict[int, int], owner: str) -> None:
    """At the end of fit: the staleness histogram ``counts`` (staleness -> applied gradients)."""
    if not counts:
        return
    rank_zero_info(
        f"{owner}: staleness of the {sum(counts.values())} applied gradients: "
        + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    )
    for logger in trainer.loggers:
        logger.log_metrics(
            {f"ps/staleness_count/{k}": float(v) for k, v in sorted(counts.items())}, step=trainer.global_step
        )
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_histogram"):
            values = torch.tensor([k for k, v in counts.items() for _ in range(v)], dtype=torch.float32)
            experiment.add_histogram("ps/staleness", values, trainer.global_step)
