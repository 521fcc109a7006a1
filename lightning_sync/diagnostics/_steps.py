"""Where optimizer steps end, for callbacks that act every N optimizer steps (not every batch)."""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_sync._lightning import should_accumulate

__all__ = ["optimizer_step_ended"]


def optimizer_step_ended(trainer: pl.Trainer) -> bool:
    """In ``on_train_batch_end``: did this batch end with an optimizer step (not an accumulation micro-step)?

    Lightning's own decision (``accumulate_grad_batches`` reached, or the epoch's last batch), taken from
    the batch counters, so every rank answers the same on the same batch and collectives that follow
    stay paired across ranks.
    """
    return not should_accumulate(trainer)
