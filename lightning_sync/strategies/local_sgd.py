"""``LocalSGDStrategy``: every rank steps its own replica; the replicas are averaged every H steps.

The Lightning adapter of :class:`lightning_sync.sync.periodic.PeriodicAverager` (post-local SGD; Lin
et al., ICLR 2020; torch's ``PeriodicModelAverager``), on the plumbing it shares with DiLoCo
(:mod:`lightning_sync.strategies._periodic`). For the warm-up phase, which is ordinary synchronous data
parallelism, it holds a :class:`~lightning_sync.sync.bucketing.GradBucketer`; without a warm-up it holds
none, and it takes only the bucketer arguments that shape the warm-up's all-reduce.

What is synchronized, and when:

* **Setup:** parameters and buffers are broadcast from rank 0 (every replica starts equal).
* **The first** ``warmup_steps`` **optimizer steps:** gradients are averaged in buckets during
  backward, exactly as ``bucketed_ddp``.
* **After that:** no gradient is synchronized; every ``sync_every`` (H) optimizer steps the
  parameters and floating-point buffers (and, with ``average_optimizer_state``, the optimizer's
  per-parameter state) are all-reduce-averaged, one flat message per dtype. With H = 1 and plain SGD
  this is DDP exactly.
* **Validation / test** run on the *averaged* model: if the replicas have drifted since the last
  sync, the parameters are averaged for the evaluation and each rank's own replica is restored after,
  so evaluating does not change training. The same holds for ``trainer.validate``/``test`` after a fit
  that ended inside a period (Lightning's setup would otherwise give every rank rank 0's replica).
* **Export:** :meth:`LocalSGDStrategy.full_state_dict` returns the averaged model on rank 0, during
  and after ``fit``, ``validate`` and ``test`` (each rank's module holds its own replica).
* **Checkpoints** resume exactly, inside a period too: each rank continues its own replica with its
  own optimizer state (:mod:`lightning_sync.resume`). What one holds:

  - ``state_dict``: one consistent model, the average of the replicas (a collective when saving): what
    a user exports. Lightning's ``optimizer_states`` are rank 0's; ``lightning_sync/local_sgd`` holds
    the schedule's counters, so a resumed run syncs on the same steps.
  - per rank (the per-rank states): the rank's replica where it differs from that average (every
    parameter and buffer inside a period, nothing right after a sync; a tied parameter once) and, on
    ranks other than 0, its own optimizer state; with a warm-up, its bucketer's step count and bucket
    order. On resume each rank puts both back once Lightning
    has loaded the average and rank 0's optimizer state (``load_optimizer_state_dict``).

  Size, K ranks, Ψ values per model, Adam's 2Ψ of state: inside a period (K + 1)Ψ + 2KΨ, right after
  a sync Ψ + 2KΨ, against Ψ + 2Ψ for the average and rank 0's state alone. At another world size
  every replica starts from the mean of the checkpoint's replicas (the saved average), from a checkpoint
  without per-rank states from the saved average, with rank 0's optimizer state, and the counters
  continue. A weights-only checkpoint holds the average alone.
* **Metrics:** ``reduce``/``all_gather``/``broadcast``/``barrier`` go through ``lightning_sync.comms``.
* **Failure:** if a rank fails, its peers raise in the next collective (a warm-up gradient bucket, or the
  next sync's all-reduce) once the process group notices (connection closed, or ``timeout``).

Lightning's ``global_step`` counts optimizer steps as usual, and LR schedulers step on it.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_sync.resume import RANK_STATES
from lightning_sync.strategies._common import check_bool, no_sync_of
from lightning_sync.strategies._periodic import PeriodicStrategy
from lightning_sync.strategies._telemetry import BUCKETS
from lightning_sync.sync.bucketing import GradBucketer, check_mib
from lightning_sync.sync.periodic import PeriodicAverager, average_tensors, check_int

__all__ = ["LocalSGDStrategy"]


class LocalSGDStrategy(PeriodicStrategy):
    """LocalSGD / post-local SGD (see the module docstring).

    Args:
        sync_every: H, optimizer steps between parameter averages (>= 1).
        warmup_steps: optimizer steps of synchronous (gradient-averaging) training first (>= 0).
        average_optimizer_state: also average the optimizer's per-parameter state at every sync.
        bucket_cap_mb: warm-up only: bucket size limit in MiB of the gradient all-reduce (25).
        first_bucket_mb: warm-up only: size limit of the first bucket in MiB (1).
        gradient_as_bucket_view: warm-up only: ``param.grad`` are views into the buckets.
        find_unused_parameters: warm-up only: allow parameters without a gradient (zero-filled).
        process_group_backend: ``"gloo"``, ``"nccl"`` or None (Lightning picks for the accelerator).
        timeout: collective timeout in seconds (or a ``timedelta``).
        start_method: ``"popen"`` (re-run the script per rank), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        fault_tolerant: keep training when a rank is lost, a period at a time (the ranks must be started by the
            fault-tolerance agent); None: on exactly when they were.

    ``bucketed_ddp``'s other arguments raise a ``ValueError``: the warm-up is the exact synchronous phase of
    post-local SGD (no ``compression``, no ``powersgd_*``), the syncs use the backend's all-reduce (no
    ``comm_algorithm``), and buffers are averaged at every sync (no ``broadcast_buffers``).
    """

    strategy_name = "local_sgd"
    _ckpt_key = "lightning_sync/local_sgd"

    def __init__(
        self,
        sync_every: int = 8,
        warmup_steps: int = 0,
        average_optimizer_state: bool = False,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        gradient_as_bucket_view: bool = True,
        find_unused_parameters: bool = False,
        process_group_backend: str | None = None,
        timeout: float | timedelta = 1800.0,
        start_method: str = "popen",
        fault_tolerant: bool | None = None,
        **kwargs: Any,
    ) -> None:
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.average_optimizer_state = check_bool("average_optimizer_state", average_optimizer_state)
        check_mib("bucket_cap_mb", bucket_cap_mb)
        check_mib("first_bucket_mb", first_bucket_mb)
        self.bucket_cap_mb, self.first_bucket_mb = bucket_cap_mb, first_bucket_mb
        self.gradient_as_bucket_view = check_bool("gradient_as_bucket_view", gradient_as_bucket_view)
        self.find_unused_parameters = check_bool("find_unused_parameters", find_unused_parameters)
        super().__init__(sync_every, process_group_backend, timeout, start_method, fault_tolerant, **kwargs)
        self.bucketer: GradBucketer | None = None  # the warm-up's; built at setup when warmup_steps > 0
        self._pending_bucketer: dict[str, Any] | None = None  # loaded before configure_ddp built the bucketer

    # ------------------------------------------------------------------ the warm-up's gradient bucketer
    @override
    def configure_ddp(self) -> None:
        """Broadcast rank 0's parameters and buffers; with a warm-up, bucket the gradients for it."""
        super().configure_ddp()
        if not self.warmup_steps:
            return
        assert self.model is not None
        self.bucketer = GradBucketer(
            self.model.named_parameters(),
            self.comm,
            self.bucket_cap_mb,
            self.first_bucket_mb,
            self.gradient_as_bucket_view,
            self.find_unused_parameters,
        )
        if self._pending_bucketer is not None:
            self.bucketer.load_state_dict(self._pending_bucketer)
            self._pending_bucketer = None
        rank_zero_info(
            f"{type(self).__name__}: the {self.warmup_steps} warm-up steps average the gradients of "
            f"{len(self.bucketer.params)} parameters in {len(self.bucketer.buckets)} buckets "
            f"(cap {self.bucket_cap_mb} MiB, first {self.first_bucket_mb} MiB)"
        )

    @override
    def teardown(self) -> None:
        if self.bucketer is not None:
            self.bucketer.close()
            self.bucketer = None
        super().teardown()

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        if self.bucketer is not None:
            self.bucketer.prepare_for_backward()

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Local steps: backward without any gradient collective (warm-up steps average as DDP does)."""
        with no_sync_of(self.bucketer if self._local_step() else None):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _local_step(self) -> bool:
        """Whether this step sends no gradient (after the warm-up)."""
        return self.averager is not None and not self.averager.in_warmup

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation micro-steps: gradients accumulate locally, no collective is issued."""
        with no_sync_of(self.bucketer):
            yield None

    @override
    def _comm_gauges(self) -> dict[str, float]:
        return {BUCKETS: float(len(self.bucketer.buckets))} if self.bucketer is not None else {}

    # ------------------------------------------------------------------ the periodic average
    @override
    def _make_syncer(self) -> PeriodicAverager:
        if self.average_optimizer_state and len(self.optimizers) != 1:
            raise ValueError(f"average_optimizer_state=True needs exactly one optimizer, got {len(self.optimizers)}")
        return PeriodicAverager(
            self._averaged_tensors(),
            self.comm,
            self.sync_every,
            self.warmup_steps,
            self.optimizers[0] if self.optimizers else None,
            self.average_optimizer_state,
        )

    @override
    def _drifted(self) -> bool:
        a = self.averager
        return a is not None and not a.in_warmup and (a.steps - a.warmup_steps) % a.sync_every != 0

    @override
    def _synchronize(self, tensors: list[torch.Tensor]) -> None:
        """The average of the replicas (a collective)."""
        average_tensors(tensors, self.comm)

    # ------------------------------------------------------------------ live fault tolerance
    @override
    def _live_state(self) -> dict[str, Any]:
        state = super()._live_state()
        if self.bucketer is not None:  # the warm-up's bucket layout, which a replacement takes without a collective
            state["bucketer"] = self.bucketer.live_state()
        return state

    @override
    def _live_load(self, state: dict[str, Any]) -> None:
        super()._live_load(state)
        if self.bucketer is not None and "bucketer" in state:
            self.bucketer.adopt(state["bucketer"])

    @override
    def _live_reset(self) -> None:
        if self.bucketer is not None:  # a warm-up step's all-reduce in flight holds the failed group
            self.bucketer.abort_backward()
        super()._live_reset()

    # ------------------------------------------------------------------ checkpoints
    @override
    def _rank_state(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        state = super()._rank_state(checkpoint)
        if self.bucketer is not None:
            state["bucketer"] = self.bucketer.state_dict()
        return state

    @override
    def _restore_rank_state(self, mine: dict[str, Any] | None, checkpoint: dict[str, Any]) -> None:
        """Besides the replica: the warm-up bucketer's step count and bucket order, the same on every rank
        (so one from another world size does too)."""
        super()._restore_rank_state(mine, checkpoint)
        states = [mine] if mine is not None else checkpoint.get(RANK_STATES) or []
        state = states[0].get("bucketer") if states else None
        if state is None:
            return
        state = {"step": state.get("step", 0), "ready_order": state.get("ready_order", [])}
        if self.bucketer is not None:
            self.bucketer.load_state_dict(state)
        else:
            self._pending_bucketer = state

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "local_sgd",
            cls,
            description="LocalSGD: local steps, parameters averaged every sync_every steps (lightning_sync)",
            override=True,
        )
