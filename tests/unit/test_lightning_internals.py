"""Every private Lightning internal listed in :data:`lightning_sync._lightning.INTERNALS` still exists and
still means what the compatibility module assumes, against the installed Lightning.

Run it before raising the Lightning cap in pyproject.toml: a failure names the internal that changed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import lightning
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, Strategy
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from torch.utils.data import DataLoader

from lightning_sync import _lightning as compat


def _trainer() -> Trainer:
    return Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _stateful() -> None:
    class Resumable:
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

    assert isinstance(Resumable(), compat.Stateful) and not isinstance(object(), compat.Stateful)


def _multiprocessing_launcher() -> None:
    assert issubclass(compat.MultiProcessingLauncher, _Launcher)
    launcher = compat.MultiProcessingLauncher(DDPStrategy(), start_method="spawn")
    for hook in ("launch", "get_extra_results", "update_main_process_results"):  # what Hogwild's subclass overrides
        assert callable(getattr(launcher, hook)), hook


def _subprocess_launcher() -> None:
    assert issubclass(compat.SubprocessScriptLauncher, _Launcher)


def _configure_launcher() -> None:
    assert callable(getattr(Strategy, "_configure_launcher", None)), "Strategy._configure_launcher is gone"
    calls = []

    class Probe(DDPStrategy):
        def _configure_launcher(self) -> None:
            calls.append(True)
            compat.set_launcher(self, "mine")

    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=Probe(), logger=False, enable_checkpointing=False, barebones=True
    )
    assert calls, "Lightning no longer calls Strategy._configure_launcher while it sets up the Trainer"
    assert trainer.strategy.launcher == "mine"


def _launcher_attribute() -> None:
    strategy = DDPStrategy()
    compat.set_launcher(strategy, "mine")
    assert strategy.launcher == "mine", "Strategy.launcher no longer returns Strategy._launcher"


def _checkpoint_io() -> None:
    strategy = DDPStrategy()
    assert compat.explicit_checkpoint_io(strategy) is None
    io = object()
    compat.set_checkpoint_io(strategy, io)
    assert compat.explicit_checkpoint_io(strategy) is io and strategy.checkpoint_io is io


def _start_method() -> None:
    assert compat.ddp_start_method(DDPStrategy(start_method="spawn")) == "spawn"


def _module_trainer() -> None:
    module = LightningModule()
    assert compat.trainer_of(module) is None and compat.trainer_of(None) is None
    trainer = _trainer()
    module.trainer = trainer
    assert compat.trainer_of(module) is trainer


def _unwrap_optimizer() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert compat.unwrap_optimizer(LightningOptimizer(optimizer)) is optimizer
    assert compat.unwrap_optimizer(optimizer) is optimizer


def _every_n_epochs() -> None:
    callback = ModelCheckpoint(every_n_epochs=1)
    assert getattr(callback, "_every_n_epochs", None) == 1, "ModelCheckpoint keeps every_n_epochs elsewhere"
    compat.set_every_n_epochs(callback, 3)
    assert callback._every_n_epochs == 3


def _should_accumulate() -> None:
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, accumulate_grad_batches=2, barebones=True)
    progress = trainer.fit_loop.epoch_loop.batch_progress
    progress.current.ready, progress.is_last_batch = 1, False
    assert compat.should_accumulate(trainer) is True  # 1 of 2 micro-batches
    progress.current.ready = 2
    assert compat.should_accumulate(trainer) is False  # the second: an optimizer step
    progress.current.ready, progress.is_last_batch = 3, True
    assert compat.should_accumulate(trainer) is False  # the epoch's last batch always steps


def _batch_progress() -> None:
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, accumulate_grad_batches=2, barebones=True)
    progress = trainer.fit_loop.epoch_loop.batch_progress
    # a checkpoint saved in on_train_batch_end of this epoch's 6th batch, the 16th of the run
    for tracker, n in ((progress.current, 6), (progress.total, 16)):
        tracker.ready = tracker.started = tracker.processed = n
        tracker.completed = n - 1
    assert compat.epoch_batches(trainer) == 6
    compat.set_epoch_batches(trainer, 9)  # the same samples in smaller batches
    assert (progress.current.ready, progress.current.processed, progress.current.completed) == (9, 9, 8)
    assert (progress.total.ready, progress.total.processed, progress.total.completed) == (19, 19, 18)
    progress.reset_on_restart()  # what the epoch loop does next on a restart: ready falls back to completed
    assert progress.current.ready == 8
    assert not compat.restored_at_epoch_end(trainer)
    # what loading an epoch-end checkpoint sets
    trainer.fit_loop.epoch_loop.restarting = progress.is_last_batch = True
    assert compat.restored_at_epoch_end(trainer)


def _metric_key() -> None:
    """Lightning's result collection calls the sync function from a method of the metric whose ``meta``
    names the logged key, as ``strategy.reduce`` would be called for ``self.log(..., sync_dist=True)``."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric, _Sync

    seen = []

    def reduce(tensor: torch.Tensor, group: object = None, reduce_op: object = None) -> torch.Tensor:
        seen.append(compat.calling_metric_key())
        return tensor

    meta = _Metadata(fx="training_step", name="loss", on_step=True, on_epoch=False)
    meta.sync = _Sync(fn=reduce, _should=True)
    _ResultMetric(meta, is_tensor=True).update(torch.tensor(1.0), batch_size=1)
    assert seen == ["training_step.loss"], f"the sync function's caller no longer carries meta.fx/meta.name: {seen}"
    assert compat.calling_metric_key() is None  # called from anywhere else


def _setup_broadcast() -> None:
    """Lightning's evaluation-time broadcast hands torch the names in ``_ddp_params_and_buffers_to_ignore``."""
    import torch.distributed as dist
    import torch.distributed.utils as torch_utils
    from lightning.pytorch.overrides.distributed import _sync_module_states

    seen: list[set[str]] = []
    real = torch_utils._sync_module_states
    module = torch.nn.Linear(2, 2)
    module._ddp_params_and_buffers_to_ignore = ["weight"]  # a user's own entry, kept
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch_utils._sync_module_states = lambda *a, params_and_buffers_to_ignore, **k: seen.append(
            set(params_and_buffers_to_ignore)
        )
        with compat.hidden_from_setup_broadcast(module, ["bias"]):
            _sync_module_states(module)
        _sync_module_states(module)
    finally:
        torch_utils._sync_module_states = real
        dist.destroy_process_group()
    assert seen == [{"weight", "bias"}, {"weight"}], seen
    assert module._ddp_params_and_buffers_to_ignore == ["weight"]


class _Tiny(LightningModule):
    """One weight, a loss ``w * batch``; records what its training steps saw."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.lr, self.seen = lr, []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.append((float(batch.sum()), batch_idx))
        return (self.w * batch).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.ones(4, 1), batch_size=1)


def _fit(module: LightningModule, steps: int, **kwargs: object) -> Trainer:
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, barebones=True, logger=False, **kwargs)
    trainer.fit(module)
    return trainer


def _batch_index() -> None:
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, barebones=True)
    trainer.fit_loop.epoch_loop.batch_progress.current.ready = 3  # the third batch of the epoch is in flight
    assert compat.batch_index(trainer) == 2


def _closure_for() -> None:
    """A closure built for another micro-batch runs training_step with that batch and index, and backward."""

    class Replaying(_Tiny):
        def on_train_batch_end(self, *args: object) -> None:
            if len(self.seen) == 1:
                self.w.grad = None
                compat.closure_for(self.trainer, self.trainer.optimizers[0], 5, torch.full((1, 1), 3.0))()

    module = Replaying()
    _fit(module, 1)
    assert module.seen == [(1.0, 0), (3.0, 5)], module.seen
    assert module.w.grad is not None and float(module.w.grad) == 3.0  # backward ran: d(w * 3)/dw


def _sigterm_broadcast() -> None:
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, barebones=True)
    replacement = lambda: None  # noqa: E731
    assert compat.replace_sigterm_broadcast(trainer, replacement)
    assert trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor is replacement


def _checkpoint_connector() -> None:
    """The dumped state, made what the Trainer restores next in a strategy's setup, resumes the run."""
    first = _Tiny()
    dumped = compat.dump_training_state(_fit(first, 1))
    assert {"state_dict", "loops", "optimizer_states", "lr_schedulers"} <= set(dumped), sorted(dumped)

    class Restoring(SingleDeviceStrategy):
        @property
        def restore_checkpoint_after_setup(self) -> bool:
            return True

        def setup(self, trainer: Trainer) -> None:
            super().setup(trainer)
            compat.restore_next(trainer, dumped)
            assert compat.next_restored(trainer) is dumped

    second = _Tiny(lr=0.0)  # its own weights and learning rate are replaced by the restored ones
    trainer = _fit(second, 2, strategy=Restoring(device=torch.device("cpu")))
    assert trainer.global_step == 2 and len(second.seen) == 1  # the loops were restored at step 1
    uninterrupted = _Tiny()
    _fit(uninterrupted, 2)  # the weights and momentum after step 1 restored, step 2 is the same step
    torch.testing.assert_close(second.w.detach(), uninterrupted.w.detach(), rtol=0, atol=0)


def _csv_hand_over() -> None:
    """A new rank 0's CSV logger goes on from the rows its predecessor wrote, in the run's version."""
    import tempfile

    from lightning.pytorch.loggers import CSVLogger

    with tempfile.TemporaryDirectory() as root:
        before = CSVLogger(root, name="run")
        before.log_metrics({"loss": 1.0}, step=0)
        before.save()
        after = CSVLogger(root, name="run")
        compat.set_logger_version(after, before.version)  # else: the next free version
        compat.continue_csv(after)
        after.log_metrics({"loss": 0.5, "acc": 0.9}, step=1)
        after.save()
        with open(f"{after.log_dir}/metrics.csv") as file:
            lines = file.read().splitlines()
    assert lines[0] == "acc,loss,step" and len(lines) == 3, lines
    assert lines[1].endswith("1.0,0") and lines[2] == "0.9,0.5,1", lines


def _logged_state() -> None:
    """What the epoch accumulated of logged tensors is put back: the values logged since are forgotten, and a key
    first logged since is reset (absent from the epoch's metrics)."""

    class Logging(_Tiny):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            if batch_idx == 1:
                self.mark = compat.logged_state(self.trainer)  # what batch 0 logged
            self.log("x", torch.tensor(float(batch_idx**2)), on_step=False, on_epoch=True)  # 0, 1, 4, 9
            if batch_idx == 2:
                self.log("y", torch.tensor(1.0), on_step=False, on_epoch=True)
                compat.restore_logged_state(self.trainer, self.mark)  # batches 1 and 2 logged nothing after all
            return super().training_step(batch, batch_idx)

    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False)
    trainer.fit(Logging())
    assert float(trainer.callback_metrics["x"]) == 4.5 and "y" not in trainer.callback_metrics  # (0 + 9) / 2


def _warm_logging() -> None:
    """The warm-up logs as self.log does, into a collection of its own (no trainer needed)."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    compat.warm_logging(torch.device("cpu"))
    collection = _ResultCollection(training=True)
    collection.log("training_step", "x", torch.tensor(2.0), batch_size=1)
    assert float(collection["training_step.x"].value) == 2.0


_CHECKS: dict[str, Callable[[], None]] = {
    "lightning.fabric.utilities.types._Stateful": _stateful,
    "lightning.pytorch.strategies.launchers._MultiProcessingLauncher": _multiprocessing_launcher,
    "lightning.pytorch.strategies.launchers._SubprocessScriptLauncher": _subprocess_launcher,
    "Strategy._configure_launcher": _configure_launcher,
    "Strategy._launcher": _launcher_attribute,
    "Strategy._checkpoint_io": _checkpoint_io,
    "DDPStrategy._start_method": _start_method,
    "LightningModule._trainer": _module_trainer,
    "LightningOptimizer._optimizer": _unwrap_optimizer,
    "ModelCheckpoint._every_n_epochs": _every_n_epochs,
    "_TrainingEpochLoop._should_accumulate": _should_accumulate,
    "_TrainingEpochLoop.batch_progress (.current, .total, .is_last_batch)": _batch_progress,
    "_ResultMetric.meta (.fx, .name)": _metric_key,
    "lightning.pytorch.overrides.distributed._sync_module_states (._ddp_params_and_buffers_to_ignore)": (
        _setup_broadcast
    ),
    "_TrainingEpochLoop.batch_idx": _batch_index,
    "_TrainingEpochLoop._build_kwargs / _AutomaticOptimization._make_closure": _closure_for,
    "_TrainingEpochLoop._broadcast_sigterm_tensor": _sigterm_broadcast,
    "Trainer._checkpoint_connector (.dump_checkpoint, ._loaded_checkpoint)": _checkpoint_connector,
    "Logger._version / CSV _ExperimentWriter (.metrics_file_path, .metrics_keys)": _csv_hand_over,
    "_TrainingEpochLoop._results / _ResultMetric (.value, .cumulated_batch_size, .has_reset)": _logged_state,
    "lightning.pytorch.trainer.connectors.logger_connector.result._ResultCollection.log": _warm_logging,
}


def test_every_listed_internal_has_a_check() -> None:
    assert set(_CHECKS) == set(compat.INTERNALS)


@pytest.mark.parametrize("internal", sorted(compat.INTERNALS))
def test_lightning_internal_still_works(internal: str) -> None:
    try:
        _CHECKS[internal]()
    except Exception as error:  # an ImportError, AttributeError or failed assertion: all mean the same here
        pytest.fail(
            f"Lightning {lightning.__version__} changed the private internal {internal!r} "
            f"({compat.INTERNALS[internal]}), which lightning_sync._lightning relies on: "
            f"{type(error).__name__}: {error}"
        )
