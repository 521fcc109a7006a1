"""What the asynchronous parameter server (``async_ps``) reports to Lightning's loggers, on rank 0.

Workers run on their own clocks, so Lightning's own ``global_step`` says little about training as a whole.
Every ``log_every_n_steps`` of rank 0's steps the server's view goes to the loggers as of rank 0's latest
reply: ``ps/global_step`` (pushes applied // K), ``ps/version`` and the mean and largest staleness of the
gradients applied so far. At the end of fit the staleness histogram follows (``ps/staleness_count/<s>``, a
TensorBoard histogram where that logger is used, and one line of text).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

__all__ = ["StalenessLog"]


class StalenessLog:
    """Rank 0's logging of the server's clock and staleness (see the module docstring)."""

    def __init__(self) -> None:
        self._logged_at = 0  # this worker's step of the last log

    def progress(self, trainer: Any, own_steps: int, reply: Any) -> None:
        """After a push answered by ``reply``: log, if ``log_every_n_steps`` of this worker's steps have passed."""
        if not trainer.loggers or own_steps - self._logged_at < max(trainer.log_every_n_steps, 1):
            return
        self._logged_at = own_steps
        counts = reply.staleness
        n = sum(counts.values())
        metrics = {
            "ps/global_step": float(reply.global_step),
            "ps/version": float(reply.version),
            "ps/staleness_mean": sum(k * v for k, v in counts.items()) / n if n else 0.0,
            "ps/staleness_max": float(max(counts, default=0)),
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    @staticmethod
    def final(trainer: Any, counts: dict[int, int], owner: str) -> None:
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
