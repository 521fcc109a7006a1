"""Every private Lightning internal lightning_sync relies on, in one place.

Lightning's public API does not cover everything a strategy or a callback needs: launchers, a loop's
accumulation decision, a module's trainer when none may be attached. Each such reach into Lightning's
private names goes through this module, and only this module, so that a Lightning release that renames or
removes one breaks here, named in :data:`INTERNALS`, and ``tests/unit/test_lightning_internals.py`` says
which one. pyproject.toml caps Lightning below the next minor release because private names can change in
any of them: raising the cap means running that test against the new release first.

Every other module imports Lightning's public API directly; importing this module imports Lightning, so
:mod:`lightning_sync.comms` and :mod:`lightning_sync.sync` never import it.
"""

from __future__ import annotations

import csv
import os
import sys
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

__all__ = [
    "INTERNALS",
    "MultiProcessingLauncher",
    "Stateful",
    "SubprocessScriptLauncher",
    "batch_index",
    "calling_metric_key",
    "closure_for",
    "continue_csv",
    "dump_training_state",
    "ddp_start_method",
    "epoch_batches",
    "explicit_checkpoint_io",
    "finish_restored_epoch",
    "hidden_from_setup_broadcast",
    "logged_state",
    "next_restored",
    "replace_sigterm_broadcast",
    "restore_logged_state",
    "restore_next",
    "set_logger_version",
    "restored_at_epoch_end",
    "set_checkpoint_io",
    "set_epoch_batches",
    "set_every_n_epochs",
    "set_launcher",
    "should_accumulate",
    "trainer_of",
    "unwrap_optimizer",
    "warm_logging",
]

#: The private Lightning names used below, each with what we use it for. The unit test checks every one
#: against the installed Lightning and fails naming the one that changed.
INTERNALS: dict[str, str] = {
    "lightning.fabric.utilities.types._Stateful": "is a loader already resumable (state_dict/load_state_dict)",
    "lightning.pytorch.strategies.launchers._MultiProcessingLauncher": "fork/spawn launcher (Hogwild, async PS)",
    "lightning.pytorch.strategies.launchers._SubprocessScriptLauncher": "popen launcher (async PS)",
    "Strategy._configure_launcher": "the hook a strategy overrides to choose its launcher",
    "Strategy._launcher": "where that hook puts the launcher (read by Strategy.launcher)",
    "Strategy._checkpoint_io": "the checkpoint_io a user passed, before Lightning fills in its default",
    "DDPStrategy._start_method": "the start_method DDPStrategy was given",
    "LightningModule._trainer": "a module's trainer, or None where none is attached (the property raises)",
    "LightningOptimizer._optimizer": "the optimizer a LightningOptimizer wraps",
    "ModelCheckpoint._every_n_epochs": "the epoch interval ModelCheckpoint's epoch-end saves read",
    "_TrainingEpochLoop._should_accumulate": "does this batch end with an optimizer step or an accumulation step",
    "_TrainingEpochLoop.batch_progress (.current, .total, .is_last_batch)": "the batches trained in this epoch, "
    "shifted when a resume counts the same samples in batches of another size; whether the last was the epoch's",
    "_ResultMetric.meta (.fx, .name)": "which logged key a strategy.reduce call syncs (the caller's frame)",
    "lightning.pytorch.overrides.distributed._sync_module_states (._ddp_params_and_buffers_to_ignore)": "the "
    "broadcast DDPStrategy.setup issues before evaluation, and the names it skips (meta tensors have no values)",
    "_TrainingEpochLoop.batch_idx": "the index in the epoch of the batch being trained (live: whose share it is)",
    "_TrainingEpochLoop._build_kwargs / _AutomaticOptimization._make_closure": "the closure Lightning runs for a "
    "micro-batch, built again for a replayed one (live fault tolerance)",
    "_TrainingEpochLoop._broadcast_sigterm_tensor": "the SIGTERM flag Lightning broadcasts with torch at every "
    "batch, replaced by one whose failure the strategy sees (live fault tolerance)",
    "Trainer._checkpoint_connector (.dump_checkpoint, ._loaded_checkpoint)": "the state a live peer sends a "
    "replacement, and where Lightning restores it from after setup",
    "Logger._version / CSV _ExperimentWriter (.metrics_file_path, .metrics_keys)": "a replacement logs into the "
    "run's version, and a new rank 0 continues the CSV file its lost predecessor wrote (live fault tolerance)",
    "_TrainingEpochLoop._results / _ResultMetric (.value, .cumulated_batch_size, .has_reset)": "what the epoch "
    "accumulated of self.log(on_epoch=True), put back before a live replay trains its window again",
    "lightning.pytorch.trainer.connectors.logger_connector.result._ResultCollection.log": "a live replacement's "
    "first self.log, run before it joins (cold, it costs 0.2 s its peers would wait)",
}

Stateful = _Stateful
MultiProcessingLauncher = _MultiProcessingLauncher
SubprocessScriptLauncher = _SubprocessScriptLauncher


def should_accumulate(trainer: Any) -> bool:
    """In ``on_train_batch_end``: is this batch an accumulation micro-step (no optimizer step after it)?"""
    return bool(trainer.fit_loop.epoch_loop._should_accumulate())


#: The counters of a batch progress tracker, in the order a batch passes them.
_BATCH_COUNTERS = ("ready", "started", "processed", "completed")


def epoch_batches(trainer: Any) -> int:
    """The batches of the current epoch whose training step ran (counted before ``on_train_batch_end``)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)


def set_epoch_batches(trainer: Any, batches: int) -> None:
    """Shift every batch counter of the training loop (this epoch's and the total) by the same amount, so that
    this epoch has trained ``batches``; their differences (a batch saved between processed and completed)
    stay as Lightning left them."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    delta = batches - progress.current.processed
    for tracker in (progress.current, progress.total):
        for counter in _BATCH_COUNTERS:
            setattr(tracker, counter, getattr(tracker, counter) + delta)


def restored_at_epoch_end(trainer: Any) -> bool:
    """Whether the training loop was restored from a checkpoint written at its epoch's last batch (read before
    the epoch loop restarts: in ``on_train_start``)."""
    loop = trainer.fit_loop.epoch_loop
    return bool(loop.restarting and loop.batch_progress.is_last_batch)


def finish_restored_epoch(trainer: Any) -> None:
    """In ``on_train_start``: a loop restored at its epoch's last batch counts that epoch as finished in this
    run's batches. An epoch of fewer batches (more ranks, or larger batches, when it was saved) would otherwise
    read to Lightning as a place inside this run's longer epoch: it would train on to that epoch's end while
    the loader starts the next, and then start the next epoch over."""
    if restored_at_epoch_end(trainer) and epoch_batches(trainer) < trainer.num_training_batches < float("inf"):
        set_epoch_batches(trainer, int(trainer.num_training_batches))


def trainer_of(module: Any) -> Any | None:
    """The Trainer ``module`` is attached to, or None (``LightningModule.trainer`` raises instead)."""
    return getattr(module, "_trainer", None) if module is not None else None


def explicit_checkpoint_io(strategy: Any) -> Any | None:
    """The ``checkpoint_io`` set on ``strategy`` so far, None where Lightning would pick its default."""
    return strategy._checkpoint_io


def set_checkpoint_io(strategy: Any, io: Any) -> None:
    """Set ``strategy``'s checkpoint_io without going through (a subclass's override of) the property."""
    strategy._checkpoint_io = io


def set_launcher(strategy: Any, launcher: Any) -> None:
    """In a ``_configure_launcher`` override: the launcher ``strategy.launcher`` returns."""
    strategy._launcher = launcher


def ddp_start_method(strategy: Any) -> str:
    """The ``start_method`` a ``DDPStrategy`` (or subclass) was constructed with."""
    return strategy._start_method


def unwrap_optimizer(optimizer: Any) -> Any:
    """The plain optimizer behind a ``LightningOptimizer``; any other optimizer as it is."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def set_every_n_epochs(callback: Any, every_n_epochs: int) -> None:
    """Set the epoch interval a ``ModelCheckpoint``'s epoch-end and validation-end saves read."""
    callback._every_n_epochs = every_n_epochs


def calling_metric_key(depth: int = 2) -> str | None:
    """``"<hook>.<name>"`` of the logged value being synced, when called from a ``Strategy.reduce`` that
    Lightning's result collection called to sync a ``self.log(..., sync_dist=True)`` value; else None.

    Lightning passes ``reduce`` the tensor alone; the key is on the caller's metadata. ``depth`` counts frames
    from this function: 2 is the caller of the function that calls this one.
    """
    meta = getattr(sys._getframe(depth).f_locals.get("self"), "meta", None)
    name = getattr(meta, "name", None)
    return f"{meta.fx}.{name}" if isinstance(name, str) else None


@contextmanager
def hidden_from_setup_broadcast(module: Any, names: list[str]) -> Iterator[None]:
    """Inside the block, the broadcast of rank 0's parameters and buffers that ``DDPStrategy.setup`` issues before
    evaluation (Lightning's ``_sync_module_states``) skips ``names`` of ``module``: it skips those in torch DDP's
    ``_ddp_params_and_buffers_to_ignore`` attribute, which is extended for the block and restored after."""
    before = getattr(module, "_ddp_params_and_buffers_to_ignore", None)
    module._ddp_params_and_buffers_to_ignore = [*(before or []), *names]
    try:
        yield
    finally:
        if before is None:
            del module._ddp_params_and_buffers_to_ignore
        else:
            module._ddp_params_and_buffers_to_ignore = before


def batch_index(trainer: Any) -> int:
    """The index in the current epoch of the batch being trained (inside ``training_step``)."""
    return int(trainer.fit_loop.epoch_loop.batch_idx)


def closure_for(trainer: Any, optimizer: Any, batch_idx: int, batch: Any) -> Any:
    """The closure Lightning's automatic optimization runs for micro-batch ``batch_idx`` with ``batch``:
    ``training_step`` (with the arguments its signature takes), zeroing the gradients at a window's first
    micro-batch, and backward."""
    loop = trainer.fit_loop.epoch_loop
    kwargs = loop._build_kwargs(OrderedDict(), batch, batch_idx)
    return loop.automatic_optimization._make_closure(kwargs, optimizer, batch_idx)


def replace_sigterm_broadcast(trainer: Any, broadcast: Any) -> bool:
    """Lightning (2.6) broadcasts rank 0's SIGTERM flag with torch at the start of every training batch, and
    swallows its failure; run ``broadcast()`` there instead. False where this Lightning has no such broadcast."""
    loop = trainer.fit_loop.epoch_loop
    if not callable(getattr(loop, "_broadcast_sigterm_tensor", None)):
        return False
    loop._broadcast_sigterm_tensor = broadcast
    return True


def dump_training_state(trainer: Any) -> dict[str, Any]:
    """Everything a full checkpoint holds, as a dict (what ``trainer.save_checkpoint`` would write)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def restore_next(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """Make ``checkpoint`` what the Trainer restores next: called in ``Strategy.setup`` of a strategy whose
    ``restore_checkpoint_after_setup`` is True, it is restored as if ``fit(ckpt_path=...)`` had loaded it."""
    trainer._checkpoint_connector._loaded_checkpoint = checkpoint


def next_restored(trainer: Any) -> dict[str, Any]:
    """What the Trainer restores next (:func:`restore_next`)."""
    return trainer._checkpoint_connector._loaded_checkpoint


def set_logger_version(logger: Any, version: Any) -> None:
    """Make ``logger`` write into ``version`` (a process that joined a running job would take the next free one)."""
    if hasattr(logger, "_version"):
        logger._version = version


def continue_csv(logger: Any) -> None:
    """On a process that just became rank 0: ``logger``'s metrics file goes on from the rows its lost predecessor
    wrote (Lightning's CSV writer deletes an existing file when it is created). Loggers without a CSV file pass."""
    from lightning.fabric.loggers.csv_logs import _ExperimentWriter

    if getattr(logger, "_experiment", None) is not None or not hasattr(logger, "log_dir"):
        return
    path = os.path.join(logger.log_dir, _ExperimentWriter.NAME_METRICS_FILE)
    rows: list[dict[str, str]] = []
    if os.path.isfile(path):
        with open(path, newline="") as file:
            rows = list(csv.DictReader(file))
    writer = logger.experiment
    if not isinstance(writer, _ExperimentWriter) or not rows:
        return
    writer.metrics_keys = sorted(rows[0])
    with open(writer.metrics_file_path, "w", newline="") as file:
        out = csv.DictWriter(file, fieldnames=writer.metrics_keys)
        out.writeheader()
        out.writerows(rows)


def logged_state(trainer: Any) -> dict[str, tuple[Any, Any, bool]]:
    """What the training epoch has accumulated so far of each ``self.log(..., on_epoch=True)`` tensor value. The
    accumulation assigns new tensors (``value = value + ...``), so keeping references is a snapshot."""
    results = trainer.fit_loop.epoch_loop._results
    return {
        key: (metric.value, getattr(metric, "cumulated_batch_size", None), metric.has_reset)
        for key, metric in results.items()
        if metric.is_tensor
    }


def restore_logged_state(trainer: Any, state: dict[str, tuple[Any, Any, bool]]) -> None:
    """Put :func:`logged_state` back: what was logged since is forgotten (a key first logged since, reset)."""
    for key, metric in trainer.fit_loop.epoch_loop._results.items():
        if not metric.is_tensor:
            continue  # a torchmetrics Metric logged as such: its own state is the module's (live_window)
        if key not in state:
            metric.reset()
            continue
        metric.value, cumulated, metric.has_reset = state[key]
        if cumulated is not None:
            metric.cumulated_batch_size = cumulated


def warm_logging(device: Any) -> None:
    """Log one value the way ``self.log`` does, into a collection of its own. A process's first ``self.log`` costs
    about 0.2 s, the cold ``collections.abc`` checks of Lightning's ``apply_to_collection`` as it moves the new
    result to the device; a live replacement pays it here, before it joins, not in its first step, where its peers
    wait for it. (Done earlier, at process start, it is lost: later imports register types and clear those caches.)"""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    _ResultCollection(training=True).log("training_step", "warm", torch.zeros((), device=device), batch_size=1)
