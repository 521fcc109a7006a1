"""``AsyncParameterServerStrategy``: workers push gradients to a parameter server and pull the global
model back, with no collective at all; a worker runs at most ``max_staleness`` versions ahead.

The Lightning adapter of :class:`lightning_sync.sync.ps.server.ParameterServer` (Li et al.,
OSDI 2014; stale-synchronous parallel, Ho et al., NIPS 2013). See that module for the step rule.

Where the server runs
    In the process of rank ``server_rank`` (0 by default), beside that rank's own worker: the server
    keeps its own copy of the model and the LightningModule's optimizer (rewritten to step that copy),
    and answers requests on RPC threads while the rank's worker trains. The rank's worker reaches it
    with direct calls; the other ranks over ``torch.distributed.rpc`` (TensorPipe), counted in
    its context's observer (``strategy.comm.observer``) as ``rpc_send`` / ``rpc_recv``.

What is synchronized, and when
    * **Setup:** every worker pulls the server's model (``server_rank``'s weights, or the checkpoint's).
    * **Every optimizer step:** the worker pushes its gradients, waits until the server has applied
      them (at once unless some other worker would fall more than ``max_staleness`` versions behind),
      and continues from the model the server returns (with ``compensation="lookahead"``, the default:
      that model extrapolated along the server's recent update by the worker's expected staleness, so
      its next gradient is computed about where it will be applied). Nothing else is exchanged: there
      is no process group, so no rank ever waits for another except through the bound.
      ``max_staleness=0`` is synchronous training step for step; ``math.inf`` never waits.
    * **Validation / test / predict:** each worker first pulls the newest global model, and evaluates
      it on the *whole* evaluation set (evaluation samplers are not sharded): its metrics are not
      reduced across ranks, because workers reach evaluation at different times. Rank 0's logger
      records rank 0's figures. ``sync_dist``, ``all_gather``, ``broadcast`` and ``barrier`` are local
      (no process group exists); torchmetrics metrics compute on the rank's own data.
    * **End of fit:** each worker waits for all the others to finish and takes the final global
      model, so every rank's module holds the same trained weights after ``fit``; rank 0 then takes the
      server's final state (for a checkpoint after fit), and the server's rank serves until every rank has
      left RPC.

Clocks
    ``trainer.global_step`` is *this worker's* optimizer steps (its pushes; they differ between
    workers when some are faster). :attr:`AsyncParameterServerStrategy.global_step` is the global
    clock, pushes applied // K: synchronous steps' worth of samples. ``Trainer(max_steps=N)`` is a
    budget on that clock (N x K pushes in all, the samples N synchronous steps would see), so fast
    workers take more steps than slow ones; step-interval LR schedulers step on it, on the server.
    Epoch-interval and plateau schedulers follow ``server_rank``'s epochs and metrics.

Checkpoints
    Rank 0 writes the server's state, all of it taken at one server version: the global model, the optimizer
    and LR schedulers, and the server's counters. Resuming restores all of it, at another world size too; with
    one worker or at ``max_staleness=0`` a run resumed at an epoch end equals the uninterrupted run bit for bit.
    What a checkpoint holds, what resuming restores and what it cannot:
    :mod:`lightning_sync.strategies._ps_checkpoint`.

Logged on rank 0 after its steps, with every strategy's communication telemetry (bytes and time of its
requests, the push counting as time blocked in communication; :mod:`lightning_sync.strategies._telemetry`):
``comm/staleness`` (its own push's), ``ps/global_step``, ``ps/version``, ``ps/staleness_mean``,
``ps/staleness_max``; at the end of fit the staleness histogram (``ps/staleness_count/<s>``, and a TensorBoard
histogram when that logger is used; see :mod:`lightning_sync.strategies._ps_metrics`).

Failure
    A worker that raises, or the server's own update (its optimizer step, clipping, a scheduler on the
    global clock), makes every worker's waiting or next request fail with an error naming the
    exception; the server's rank keeps answering until every worker has heard it (at most ``timeout``).
    A worker process that dies silently (SIGKILL) is given up on once the others wait for it and it has sent
    nothing for ``timeout`` seconds: every request then fails naming it. If the server's process dies, every
    worker's next request fails at once naming the server's rank. Either ends the job; a rerun resumes from the
    newest checkpoint (the fault-tolerance agent is refused: no live membership here).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_sync._lightning import finish_restored_epoch
from lightning_sync.checkpoint.reading import guarded_load
from lightning_sync.comms import rpc
from lightning_sync.strategies._common import as_timedelta, check_launch_args
from lightning_sync.strategies._no_process_group import NoProcessGroupStrategy
from lightning_sync.strategies._ps_checkpoint import read_server_state, write_snapshot
from lightning_sync.strategies._ps_metrics import log_final, step_metrics
from lightning_sync.strategies._ps_routing import PushingOptimizer, lr_targets, route_clipping, route_schedulers
from lightning_sync.strategies._telemetry import blocked
from lightning_sync.sync.ps.server import ParameterServer, Reply, check_lr_scaling, check_staleness
from lightning_sync.sync.ps.worker import LocalLink, PSWorker, RpcLink, check_compensation, host

__all__ = ["AsyncParameterServerStrategy"]


class AsyncParameterServerStrategy(NoProcessGroupStrategy):
    """Asynchronous parameter server with bounded staleness (see the module docstring). Its ranks share no
    process group (:class:`~lightning_sync.strategies._no_process_group.NoProcessGroupStrategy`).

    Args:
        max_staleness: s, the most versions a pushed gradient may lag the model it is applied to:
            an int >= 0 (0 is synchronous training), or ``math.inf`` (``.inf`` in YAML, ``inf`` on the
            Hydra command line) for no bound.
        server_rank: the global rank whose process hosts the server (beside its own worker).
        lr_scaling: how a step carrying |S| of the K workers' gradients scales the learning rate:
            ``"linear"`` (|S| / K: exact for SGD) or ``"sqrt"`` (sqrt(|S| / K): the square-root rule for
            Adam-type optimizers; see :mod:`lightning_sync.sync.ps.server`).
        compensation: how a worker compensates the staleness of its next gradient: ``"lookahead"``
            (compute it where the global model is expected to be when it is applied: the latest model
            extrapolated along the server's recent update by the worker's expected staleness; see
            :class:`~lightning_sync.sync.ps.worker.PSWorker`) or ``"none"`` (on the latest model as
            received). Neither changes ``max_staleness=0``, which is never stale.
        timeout: seconds an RPC request may wait (a silent dead peer is noticed after this).
        start_method: ``"popen"`` (re-run the script per rank), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
    """

    strategy_name = "async_ps"

    def __init__(
        self,
        max_staleness: int | float = 4,
        server_rank: int = 0,
        timeout: float | timedelta = 1800.0,
        start_method: str = "popen",
        lr_scaling: str = "linear",
        compensation: str = "lookahead",
        **kwargs: Any,
    ) -> None:
        self.max_staleness = check_staleness(max_staleness)
        self.lr_scaling = check_lr_scaling(lr_scaling)
        self.compensation = check_compensation(compensation)
        if isinstance(server_rank, bool) or not isinstance(server_rank, int) or server_rank < 0:
            raise ValueError(f"server_rank must be an int >= 0, got {server_rank!r}")
        check_launch_args(type(self).__name__, None, start_method, kwargs)
        super().__init__(start_method=start_method, **kwargs)
        self.server_rank, self._timeout = server_rank, as_timedelta(timeout)
        self.server: ParameterServer | None = None
        self.worker: PSWorker | None = None
        self._clip: tuple[str, float] | None = None
        self._pending_state: dict[str, Any] | None = None
        self._lifted_max_steps: int | None = None
        self._failed = False
        self._finished = False
        self._last: Reply | None = None  # the latest reply (kept after teardown)
        self._push_staleness: int | None = None  # of the latest push (None: discarded)
        self._final: dict[str, Any] | None = None  # rank 0: the server's state at the end of fit

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        """Join the RPC group (no process group: there is nothing collective to do)."""
        super().setup_environment()
        if not 0 <= self.server_rank < self.world_size:
            raise ValueError(
                f"server_rank must be a rank of this job, in [0, {self.world_size - 1}], got {self.server_rank}"
            )
        if torch.distributed.is_initialized():
            rank_zero_warn(
                f"{type(self).__name__}: a default process group exists; Lightning 2.6 then broadcasts "
                "a flag on it before every training step, so workers wait for each other anyway. "
                "This strategy needs none: run it without one to keep workers independent."
            )
        if self.world_size > 1:
            rpc.init(self.global_rank, self.world_size, self._timeout)

    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                f"{type(self).__name__} does not support fp16 loss scaling (precision='16-mixed'): each "
                "worker's scaler would skip steps on its own; use precision='bf16-mixed'"
            )
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError(f"{type(self).__name__} supports exactly one optimizer, got {len(self.optimizers)}")
        self.setup_precision_plugin()
        self._build(trainer, fitting)

    def _build(self, trainer: Any, fitting: bool) -> None:
        """Server on ``server_rank`` (from its weights, or the restored checkpoint's), then every worker pulls."""
        assert self.model is not None
        params = [p for p in self.model.parameters() if p.requires_grad]
        buffers = list(self.model.buffers())
        real = self.optimizers[0] if fitting else None
        if fitting:
            self.optimizers = [PushingOptimizer(real, self._push)]  # built before the server repoints `real`
        if self.global_rank == self.server_rank:
            budget = trainer.max_steps if fitting and trainer.max_steps >= 0 else None
            # pushes wait until Lightning has restored the optimizer and schedulers too (on_train_start)
            self.server = ParameterServer(
                params, buffers, real, self.world_size, self.max_staleness, budget, self.lr_scaling, restoring=fitting
            )
            if self._pending_state is not None:
                self.server.load_state_dict(self._pending_state)
            host(self.server)
            link: Any = LocalLink(self.server, self._timeout.total_seconds())
        else:
            link = RpcLink(self.server_rank, ctx=self.comm)
        if fitting:
            route_schedulers(self.lr_scheduler_configs, self.server)
            route_clipping(self.precision_plugin, self._set_clip)
        self.worker = PSWorker(self.global_rank, params, buffers, link, lookahead=self.compensation == "lookahead")
        self.worker.pull()
        rank_zero_info(
            f"{type(self).__name__}: server on rank {self.server_rank}, {self.world_size} workers, "
            f"max_staleness={self.max_staleness}, compensation={self.compensation}, {len(params)} parameters"
            + (f", budget {trainer.max_steps} global steps" if fitting and trainer.max_steps >= 0 else "")
        )

    def _set_clip(self, clip: tuple[str, float]) -> None:
        self._clip = clip

    # ------------------------------------------------------------------ training
    @override
    def on_train_start(self) -> None:
        """The server applies the pushes that waited for the restore (Lightning has restored everything it
        restores by now). ``max_steps`` is the global budget: the server stops every worker, so lift the
        per-worker limit."""
        super().on_train_start()
        if self.server is not None:
            self.server.restored()
        trainer = self.lightning_module.trainer
        finish_restored_epoch(trainer)
        if trainer.fit_loop.max_steps >= 0:
            self._lifted_max_steps = trainer.fit_loop.max_steps
            trainer.fit_loop.epoch_loop.max_steps = -1

    def _push(self) -> None:
        assert self.worker is not None
        read = self.worker.version
        with blocked(self.comm.observer):  # the worker waits for the server: exposed communication
            reply = self._last = self.worker.push(self._clip)
        # the server's staleness of a gradient applied in the step that made reply.version
        self._push_staleness = reply.version - 1 - read if reply.applied else None
        self._clip = None
        for group, lr in zip(self.optimizers[0].param_groups, reply.lrs):
            group["lr"] = lr  # every worker reports the global learning rate
        trainer = self.lightning_module.trainer
        if reply.stop:
            trainer.should_stop = True

    @override
    def _comm_gauges(self) -> dict[str, float]:
        return step_metrics(self._last, self._push_staleness) if self._last is not None else {}

    @property
    def global_step(self) -> int:
        """The global clock: pushes applied // K, as of this worker's last reply."""
        return self._last.global_step if self._last is not None else 0

    def lr_targets(self, schedulers: list[Any]) -> Any:
        """What :class:`~lightning_sync.lr_rules.ScaledWarmup` scales: the server's optimizer, on the global clock
        (:func:`~lightning_sync.strategies._ps_routing.lr_targets`)."""
        return lr_targets(self.server, schedulers)

    @property
    def staleness_histogram(self) -> dict[int, int]:
        """Staleness -> applied gradients, as of this worker's last reply."""
        return dict(self._last.staleness) if self._last is not None else {}

    # ------------------------------------------------------------------ evaluation on the global model
    def _pull(self) -> None:
        if self.worker is not None:
            self.worker.pull()

    @override
    def on_validation_start(self) -> None:
        self._pull()

    @override
    def on_test_start(self) -> None:
        self._pull()

    @override
    def on_predict_start(self) -> None:
        self._pull()

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Rank 0 writes the server's state, all of it from one server version (after fit: the final one)."""
        snap = None
        if self.is_global_zero:
            snap = self.worker.link.snapshot() if self.worker is not None else self._final
        if snap is not None:
            assert self.model is not None
            write_snapshot(checkpoint, self.model, snap)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Weights-only unless ``weights_only=False`` (``trainer.fit(..., weights_only=False)``); a
        checkpoint that needs more raises :class:`~lightning_sync.checkpoint.reading.UntrustedCheckpointError`."""
        checkpoint = guarded_load(
            lambda wo: super(AsyncParameterServerStrategy, self).load_checkpoint(checkpoint_path, wo),
            checkpoint_path,
            weights_only,
        )
        self._pending_state = read_server_state(checkpoint, self.world_size, type(self).__name__)
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Only the server's optimizer has state; the workers' are never stepped."""
        if self.server is not None and self.server.optimizer is not None:
            with self.server.lock:
                self.server.optimizer.load_state_dict(checkpoint["optimizer_states"][0])

    # ------------------------------------------------------------------ end
    def _finish(self) -> None:
        """Leave the bound, wait for every worker to finish, take the final global model (once)."""
        if self.worker is None or self._finished:
            return
        if self.server is not None:  # a fit loop that had nothing to do never called on_train_start
            self.server.restored()
        self._last = self.worker.finish()
        self._finished = True
        if self.is_global_zero:  # so that trainer.save_checkpoint after fit still saves the server's state
            self._final = self.worker.link.snapshot()

    @override
    def on_train_end(self) -> None:
        """Every worker ends with the final global model; rank 0 logs the final staleness histogram."""
        self._finish()
        if self.global_rank == 0:
            log_final(self.lightning_module.trainer, self.staleness_histogram, type(self).__name__)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Tell the server, so every other worker stops with an error naming this one."""
        self._failed = True
        if self.worker is not None:
            try:
                self.worker.link.abort(self.global_rank, f"{type(exception).__name__}: {exception}")
            except Exception:  # noqa: BLE001 - the server may be gone already; the original error propagates
                pass
            self.worker = None

    @override
    def teardown(self) -> None:
        """After fit every worker takes the final global model; then leave RPC."""
        trainer = self._trainer()
        if not self._failed and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._finish()  # if the fit loop ended without on_train_end
        if self._lifted_max_steps is not None and trainer is not None:
            trainer.fit_loop.epoch_loop.max_steps = self._lifted_max_steps
            self._lifted_max_steps = None
        hosting = self.server is not None
        if self.server is not None and self.server.error is not None:
            # keep answering until every worker has heard why training stopped
            self.server.wait_stopped(self._timeout.total_seconds())
        self.server, self.worker = None, None
        try:
            # Rank 0 asks the server for its final state after every worker has finished (see _finish), so
            # with the server on another rank that request can still be on its way now. A graceful shutdown
            # returns only once every rank has reached it, and a rank reaches it only after its own requests
            # were answered: serving until then answers every last request, with no handshake of our own.
            rpc.shutdown(graceful=not self._failed)  # after a failure, peers may never arrive
        finally:
            if hosting:
                host(None)  # the next fit's requests must wait for the next fit's server
        self._failed = self._finished = False
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "async_ps",
            cls,
            description="asynchronous parameter server with bounded staleness over RPC (lightning_sync)",
            override=True,
        )
