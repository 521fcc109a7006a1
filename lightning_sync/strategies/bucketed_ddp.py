"""``BucketedDDPStrategy``: data parallelism with explicit, overlapped, bucketed gradient all-reduce.

The Lightning adapter of :class:`lightning_sync.sync.bucketing.GradBucketer` (torch DDP's Reducer,
written out; Li et al., VLDB 2020). It subclasses Lightning's ``DDPStrategy`` only for what is not
about synchronization (launchers, cluster environments, process-group setup, device placement);
the model is never wrapped in torch's ``DistributedDataParallel``.

What is synchronized, and when:

* **Setup:** parameters and buffers are broadcast from rank 0, so every replica starts equal.
* **Every backward:** gradients are averaged in buckets while backward runs (see ``sync.bucketing``);
  the optimizer step sees averaged gradients. Inside ``block_backward_sync`` (Lightning's
  accumulation micro-steps) no collective is issued at all.
* **Buffers** (e.g. BatchNorm running statistics) follow torch DDP's ``broadcast_buffers=True``
  policy by default: rank 0's buffers are broadcast at the start of every training step, in one
  flat message; ``broadcast_buffers=False`` keeps each rank's own.
* **Metrics:** ``reduce``/``all_gather``/``broadcast``/``barrier`` go through ``lightning_sync.comms``.
* **Checkpoints:** the model and optimizer are identical on every rank and saved by rank 0; each rank's
  bucketer state (step count, recorded bucket order, and the compressor state: PowerSGD's error
  feedback differs per rank) is gathered on rank 0 with the rank's RNG states (one tensor gather,
  :mod:`lightning_sync.resume`) and handed back to each rank on resume (the compressor state is reset if
  the world size changed). The training loader resumes at its position in the epoch.

If a rank fails, its peers raise once the process group notices (connection closed, or ``timeout``). Started by
the fault-tolerance agent (``fault_tolerant``), they keep training instead: the lost rank's step is replayed with
the global batch shared over the survivors, and a replacement heals from a live peer
(:mod:`lightning_sync.strategies._live`).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_sync._lightning import next_restored
from lightning_sync.checkpoint.reading import guarded_load
from lightning_sync.comms.algorithms import ALGORITHMS
from lightning_sync.resume import RANK_STATES
from lightning_sync.strategies._base import SyncStrategy
from lightning_sync.strategies._common import as_timedelta, check_bool, check_launch_args, no_sync_of
from lightning_sync.strategies._telemetry import BUCKETS
from lightning_sync.sync.bucketing import GradBucketer, check_mib
from lightning_sync.sync.compression import COMPRESSIONS, make_compressor
from lightning_sync.sync.replicas import broadcast_buffers, broadcast_module_states

__all__ = ["BucketedDDPStrategy"]


class BucketedDDPStrategy(SyncStrategy):
    """Bucketed, overlapped gradient averaging; every collective explicit and counted.

    Args:
        bucket_cap_mb: bucket size limit in MiB (torch DDP's default 25).
        first_bucket_mb: size limit of the first bucket in MiB, so communication starts early (1).
        gradient_as_bucket_view: ``param.grad`` are views into the buckets (no gradient copies).
        find_unused_parameters: allow parameters without a gradient (zero-filled); else raise naming them.
        compression: ``None``, ``"fp16"``, ``"bf16"`` or ``"powersgd"``.
        powersgd_rank: rank of the PowerSGD approximation (with ``compression="powersgd"``).
        powersgd_warmup_steps: uncompressed steps before PowerSGD starts.
        broadcast_buffers: broadcast rank 0's buffers at every training step (torch DDP's default).
        comm_algorithm: how each bucket is all-reduced: ``"backend"`` (the backend's collective, overlapped
            with backward), or written out in ``comms``: ``"ring"``, ``"tree"`` or ``"hierarchical"``
            (within each node, among node leaders, within each node again; for multi-node jobs). These
            complete as each bucket launches, so they overlap less.
        process_group_backend: ``"gloo"``, ``"nccl"`` or None (Lightning picks for the accelerator).
        timeout: collective timeout in seconds (or a ``timedelta``).
        start_method: ``"popen"`` (re-run the script per rank), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        fault_tolerant: keep training when a rank is lost (live membership; the ranks must be started by the
            fault-tolerance agent, ``lightning-sync launch``); None: on exactly when they were.
        rebalance: split each global batch over the ranks by their measured speed, the gradient still the exact
            global mean (:mod:`lightning_sync.strategies._rebalance`).
        rebalance_every: optimizer steps between two measurements of the ranks' speeds.
        rebalance_deadline: with ``rebalance``: drop a micro-batch whose forward alone took longer than this many
            times the median rank's predicted compute (a stalled rank), the gradient then the mean over the samples
            that arrived, an approximation; None (default): never.
    """

    strategy_name = "bucketed_ddp"
    _live_capable = True

    def __init__(
        self,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        gradient_as_bucket_view: bool = True,
        find_unused_parameters: bool = False,
        compression: str | None = None,
        powersgd_rank: int = 2,
        powersgd_warmup_steps: int = 10,
        broadcast_buffers: bool = True,
        comm_algorithm: str = "backend",
        process_group_backend: str | None = None,
        timeout: float | timedelta = 1800.0,
        start_method: str = "popen",
        fault_tolerant: bool | None = None,
        rebalance: bool = False,
        rebalance_every: int = 10,
        rebalance_deadline: float | None = None,
        **kwargs: Any,
    ) -> None:
        check_mib("bucket_cap_mb", bucket_cap_mb)
        check_mib("first_bucket_mb", first_bucket_mb)
        for name, value, low in (
            ("powersgd_rank", powersgd_rank, 1),
            ("powersgd_warmup_steps", powersgd_warmup_steps, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:  # checked even if unused
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if compression not in (None, "none", *COMPRESSIONS):
            raise ValueError(f"unknown compression {compression!r}; allowed: {[None, *COMPRESSIONS]}")
        for name, flag in (
            ("gradient_as_bucket_view", gradient_as_bucket_view),
            ("find_unused_parameters", find_unused_parameters),
            ("broadcast_buffers", broadcast_buffers),
        ):
            check_bool(name, flag)
        if not isinstance(comm_algorithm, str) or comm_algorithm not in ALGORITHMS:
            raise ValueError(f"unknown comm_algorithm {comm_algorithm!r}; allowed: {sorted(ALGORITHMS)}")
        check_launch_args(type(self).__name__, process_group_backend, start_method, kwargs)
        self._compressor = make_compressor(compression, powersgd_rank, powersgd_warmup_steps)  # validates
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=as_timedelta(timeout),
            start_method=start_method,
            **kwargs,
        )
        self.bucket_cap_mb, self.first_bucket_mb = bucket_cap_mb, first_bucket_mb
        self.gradient_as_bucket_view, self.find_unused_parameters = gradient_as_bucket_view, find_unused_parameters
        self.compression, self.broadcast_buffers, self.comm_algorithm = compression, broadcast_buffers, comm_algorithm
        self.bucketer: GradBucketer | None = None
        self._pending_state: dict[str, Any] | None = None  # loaded before configure_ddp built the bucketer
        self._live_compressor: dict[str, Any] | None = None  # the compressor's state at the live window's start
        self._go_live(
            fault_tolerant,
            process_group_backend,
            start_method,
            compression=(compression, (None, "none", *COMPRESSIONS)),
            comm_algorithm=(comm_algorithm, ("backend",)),
        )
        self._rebalance(rebalance, rebalance_every, rebalance_deadline)

    # ------------------------------------------------------------------ setup / teardown
    @override
    def configure_ddp(self) -> None:
        """Broadcast rank 0's parameters and buffers, then bucket the gradients (no DDP wrapper)."""
        model = self.model
        assert model is not None
        if self.live is None or not self.live.replacement:  # a replacement has its peers' state already
            broadcast_module_states(model, self.comm)
        comm = (  # the context is a Communicator on the backend's own all-reduce; a written-out one needs a bound view
            self.comm
            if self.comm_algorithm == "backend"
            else self.comm.bound(algorithm=self.comm_algorithm, ranks_per_node=self.num_processes)
        )
        self.bucketer = GradBucketer(
            model.named_parameters(),
            comm,
            self.bucket_cap_mb,
            self.first_bucket_mb,
            self.gradient_as_bucket_view,
            self.find_unused_parameters,
            self._compressor,
        )
        if self._pending_state is not None:
            self.bucketer.load_state_dict(self._pending_state)
            self._pending_state = None
        rank_zero_info(
            f"{type(self).__name__}: {len(self.bucketer.params)} parameters in "
            f"{len(self.bucketer.buckets)} buckets (cap {self.bucket_cap_mb} MiB, first "
            f"{self.first_bucket_mb} MiB), compression={self.compression}, all-reduce: {self.comm_algorithm}"
        )

    @override
    def teardown(self) -> None:
        if self.bucketer is not None:
            self.bucketer.close()
            self.bucketer = None
        if self.comm_algorithm == "hierarchical":  # no gloo sub-group outlives the fit (algorithms.release_node_groups)
            self.comm.release_node_groups()
        super().teardown()

    # ------------------------------------------------------------------ training hooks
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self.model is not None:
            model = self.model
            if self.live is not None:
                self.live.guarded(lambda: broadcast_buffers(model, self.comm), lambda: None)
            else:
                broadcast_buffers(model, self.comm)
        return super().training_step(*args, **kwargs)

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        if self.bucketer is not None:
            self.bucketer.prepare_for_backward()

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        return None  # the bucketer's end-of-backward callback has already averaged the gradients

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation micro-steps: gradients accumulate locally, no collective is issued."""
        with no_sync_of(self.bucketer):
            yield None

    @override
    def _comm_gauges(self) -> dict[str, float]:
        return {BUCKETS: float(len(self.bucketer.buckets))} if self.bucketer is not None else {}

    # ------------------------------------------------------------------ live fault tolerance
    @override
    def _live_state(self) -> dict[str, Any]:
        """The bucket layout, and PowerSGD's shared low-rank factors Q (its error feedback is each rank's own: a
        replacement starts it at zero, as a lost rank's residual is lost with it)."""
        state = {"bucketer": self.bucketer.live_state()} if self.bucketer is not None else {}
        if self._compressor is not None and self.compression == "powersgd":
            state["powersgd_q"] = self._compressor.state_dict()["q"]
        return state

    @override
    def _live_load(self, state: dict[str, Any]) -> None:
        if self.bucketer is not None and "bucketer" in state:
            self.bucketer.adopt(state["bucketer"])
        if "powersgd_q" in state and self._compressor is not None:
            self._compressor.load_state_dict({"q": state["powersgd_q"]})

    @override
    def _live_mark(self) -> None:
        """A window starts: keep the compressor's state, which a failed all-reduce may leave half updated, and on
        each rank at another point (PowerSGD's error feedback, and its factors, meant to be the same everywhere)."""
        if self._compressor is not None:
            self._live_compressor = self._compressor.snapshot()

    @override
    def _live_reset(self) -> None:
        if self.bucketer is not None:
            self.bucketer.abort_backward()
        if self._live_compressor is not None and self._compressor is not None:
            self._compressor.restore(self._live_compressor)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        extra = {"bucketer": self.bucketer.state_dict()} if self.bucketer is not None else None
        if self._save_rank_states(checkpoint, filepath, extra):
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Weights-only unless ``weights_only=False`` (``trainer.fit(..., weights_only=False)``); a
        checkpoint that needs more raises :class:`~lightning_sync.checkpoint.reading.UntrustedCheckpointError`."""
        if self.live is not None and self.live.replacement:  # what a live peer sent, not the file
            return next_restored(self.lightning_module.trainer)
        checkpoint = guarded_load(
            lambda wo: super(BucketedDDPStrategy, self).load_checkpoint(checkpoint_path, wo),
            checkpoint_path,
            weights_only,
        )
        mine = self.exact_data.take_rank_state(checkpoint)
        if mine is not None:
            state = mine.get("bucketer")
        else:
            state = self._shared_bucketer_state(checkpoint.get(RANK_STATES) or [])
        if state is not None:
            if self.bucketer is not None:
                self.bucketer.load_state_dict(state)
            else:
                self._pending_state = state
        return checkpoint

    def _shared_bucketer_state(self, states: list[dict[str, Any]]) -> dict[str, Any] | None:
        """From a checkpoint of another world size: the step and bucket order (the same on every rank), not
        the compressor's state, which is per rank (PowerSGD's error feedback)."""
        first = states[0].get("bucketer") if states else None
        if first is None:
            return None
        rank_zero_info(
            f"{type(self).__name__}: checkpoint has compressor state for {len(states)} ranks, "
            f"this run has {self.world_size}; starting compression state afresh"
        )
        return {"step": first.get("step", 0), "ready_order": first.get("ready_order", [])}

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "bucketed_ddp",
            cls,
            description="explicit bucketed, overlapped gradient all-reduce (lightning_sync)",
            override=True,
        )
        strategy_registry.register(
            "bucketed_ddp_spawn",
            cls,
            description="bucketed_ddp, processes started with multiprocessing spawn",
            start_method="spawn",
            override=True,
        )
