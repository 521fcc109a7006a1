"""What passes from one live member to another: the training state a replacement heals from, and rank 0's duties
when the member that held them is lost.

* **The state** (:func:`training_state`, :func:`take_training_state`): what a Lightning checkpoint holds
  (weights, optimizers, LR schedulers, loop counters and data position, callbacks, precision), plus what it does
  not: the strategy's own state (its ``_live_state()``), rank 0's RNG streams and the loggers' versions. Sent as
  ``torch.save`` bytes and loaded ``weights_only``, like any checkpoint this package reads.
* **Rank 0's duties** (:func:`take_over_rank_zero`): a member that becomes rank 0 continues the CSV metrics from
  its predecessor's last row, measures and logs the step figures, and shows the progress bar, which Lightning
  disabled on every other rank at setup.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from lightning.pytorch.callbacks import TQDMProgressBar

from lightning_sync._lightning import (
    batch_index,
    continue_csv,
    dump_training_state,
    restore_next,
    set_logger_version,
)
from lightning_sync.resume import rng_state

__all__ = ["load_training_state", "take_over_rank_zero", "take_training_state", "training_state"]

_LIVE = "lightning_sync/live"  # the healing checkpoint's key of what Lightning does not hold
# what a replacement does not need from the members' checkpoint, and a weights-only load might refuse
_NOT_SENT = ("hyper_parameters", "hparams_name", "datamodule_hyper_parameters")


def training_state(strategy: Any, trainer: Any) -> bytes:
    """The training state as a Lightning checkpoint holds it, with the strategy's own and the RNG streams."""
    with strategy._live_handing_over():  # what the strategy sends otherwise (its shards) is not in the checkpoint
        checkpoint = dump_training_state(trainer)
    for key in _NOT_SENT:
        checkpoint.pop(key, None)
    checkpoint[_LIVE] = {
        "rng": rng_state(strategy.root_device),
        "strategy": strategy._live_state(),
        "logger_versions": [logger.version for logger in trainer.loggers],
    }
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return buffer.getvalue()


def load_training_state(data: bytes) -> dict[str, Any]:
    """:func:`training_state`'s bytes as the checkpoint dict (weights-only: nothing in it is executed)."""
    return torch.load(io.BytesIO(data), weights_only=True)


def take_training_state(strategy: Any, trainer: Any, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """At the end of a replacement's ``setup``: the received state becomes the checkpoint Lightning restores next
    (its modules and callbacks, then its loops, optimizers and schedulers); the strategy takes its own here.
    Returns the RNG streams, for the replacement to set at its first step (Lightning may draw from them before,
    for a loader's seed)."""
    live = checkpoint.pop(_LIVE)
    strategy._live_load(live["strategy"])
    for logger, version in zip(trainer.loggers, live["logger_versions"]):
        set_logger_version(logger, version)
    restore_next(trainer, checkpoint)
    return live["rng"]


def take_over_rank_zero(strategy: Any, trainer: Any) -> None:
    """This member became rank 0 after a loss: the rows its predecessor wrote stay and the next ones follow them,
    the step figures are its to measure and log, and the progress bar is its to show."""
    for logger in trainer.loggers:
        continue_csv(logger)
    strategy.telemetry.start()
    for callback in trainer.callbacks:
        if isinstance(callback, TQDMProgressBar) and trainer.training:
            _show_progress(callback, trainer)


def _show_progress(bar: TQDMProgressBar, trainer: Any) -> None:
    """The epoch's bar made again, at the batch the loop is in."""
    bar.enable()
    progress = bar.init_train_tqdm()
    progress.reset(total=bar.total_train_batches)
    progress.n = batch_index(trainer)
    progress.set_description(f"Epoch {trainer.current_epoch}")
    bar.train_progress_bar = progress
