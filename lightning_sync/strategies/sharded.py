"""``ShardedStrategy``: ZeRO stages 1, 2 and 3 (FSDP-style), every all-gather and reduce-scatter explicit.

The Lightning adapter of :class:`lightning_sync.sync.zero.ZeroEngine` (Rajbhandari et al., SC 2020;
torch FSDP2 and DeepSpeed ZeRO are the anchors). Like ``BucketedDDPStrategy`` it subclasses Lightning's
``DDPStrategy`` only for launching, cluster environments and process-group setup; the model is never
wrapped.

What is sharded, and what is synchronized when (K ranks):

* **Setup** (after ``configure_optimizers``): rank 0's parameters and buffers are broadcast, the
  trainable parameters are flattened and sharded 1/K per rank, and each optimizer is rewritten in place
  to step this rank's fp32 master shards of its parameters (same object, groups and hyperparameters, so LR
  schedulers keep working). Stage 1/2 units are gradient buckets of ``bucket_cap_mb``; stage 3 units are chosen
  by ``wrap_policy``.
* **Several optimizers** (manual optimization, a GAN): each flat parameter belongs to one group of one optimizer
  (a parameter in two is refused). ``toggle_optimizer`` turns the other optimizers' masters off: the gradients
  their parameters get in that backward are dropped and not reduced, and they do not count as unused. Stage 3
  gathers the root unit again after each such backward, for the step function's next forward.
* **Deferred initialization** (stage 3): ``configure_model`` and ``trainer.init_module()`` build on the meta
  device, and the setup initializes the model unit by unit with each module's ``reset_parameters()``, from
  rank 0's random state, keeping only this rank's shards (:mod:`lightning_sync.sync.zero.materialize`).
* **Stage 1:** full gradients accumulate locally; at the end of backward each bucket is
  reduce-scattered; after ``optimizer.step()`` the shards are all-gathered into the full parameters.
* **Stage 2:** as stage 1, but each bucket is reduce-scattered *during* backward as soon as its
  gradients are ready, and only the shard is kept.
* **Stage 3:** parameters live only as shards. Each unit is all-gathered right before its forward
  (with ``prefetch``, the next unit's gather is already in flight, and the optimizer step issues the next
  forward's first gathers so that they run between the steps), freed after it
  (``reshard_after_forward``), gathered again before its backward, and its gradient reduce-scattered
  right after. The root unit (parameters no wrapped module owns) is gathered at the start of each
  step function and freed after backward: per micro-step one all-gather of the root unit and two of
  every other (one with ``reshard_after_forward=False``), and once, in the first step, the order check.
* **Accumulation** (Lightning's non-boundary micro-steps): no collective at all; *unsharded*
  gradients accumulate locally (stage 2/3 then hold a full gradient, like DDP, for the window), and
  the boundary micro-step reduce-scatters their sum once.
* **Mixed precision:** ``param_dtype`` is what is gathered and computed in (wrapped units cast their
  floating-point inputs to it), ``reduce_dtype`` what gradients are reduced in; master shards are fp32.
  Lightning's ``precision="bf16-mixed"`` autocasts as usual. ``"16-mixed"``'s ``GradScaler`` is replaced at
  setup by a :class:`~lightning_sync.sync.zero.grad_scaler.ShardedGradScaler` with the same settings and
  state, whose inf/NaN check is all-reduced (MAX, one float per optimizer and step): an overflow in one
  rank's gradient shard skips the step on every rank, and every rank's scale changes alike.
* **CPU offload** (``offload=True``, any stage; ZeRO-Offload): the fp32 master shards, their gradients and the
  optimizer state live in host memory and the optimizer steps there; the copies run on a side CUDA stream,
  overlapped with backward and with the next forward (:mod:`lightning_sync.sync.zero.offload`). On a CPU-only
  machine training is bit-identical to ``offload=False``; ``engine.memory_report()`` says what lives where.
* **Activation checkpointing** (``activation_checkpointing=True``): the modules ``wrap_policy`` selects (stage 3:
  every unit but the root) recompute their activations in backward, with the first run's random state (same
  gradients, dropout included): one more forward of them per step, no more all-gathers
  (:mod:`lightning_sync.sync.zero.recompute`).
* **Metrics:** ``reduce``/``all_gather``/``broadcast``/``barrier`` go through ``lightning_sync.comms``.
* **Checkpoints** take one of two forms (``state_dict_type``): ``"full"`` (the default at stages 1/2), one file
  in Lightning's ``ddp`` format, and ``"sharded"`` (the default at stage 3), a directory of shards; both load at
  any world size and stage (:mod:`lightning_sync.strategies._sharded_checkpoint` says what each holds).
* **After fit** (teardown; also after ``validate`` and ``test``) every rank's module holds the full
  trained parameters again, and :meth:`ShardedStrategy.full_state_dict` copies rank 0's module;
  ``trainer.save_checkpoint`` writes the form ``state_dict_type`` names, from the shards the fit left.

Lightning's callbacks that read or write ``pl_module.parameters()`` during fit (weight averaging and EMA,
``StochasticWeightAveraging``, ``ModelPruning``; others through ``gathered_callbacks``) run their hooks with the
module's full parameters, gathered from the master shards, and what they change is written back into the
shards (:mod:`lightning_sync.strategies._gathered_callbacks`). ``BaseFinetuning`` is refused at setup.

The model's own ``param.grad`` stay ``None``: gradients live in the engine's buffers and the masters'
``.grad``. Gradient clipping by norm uses the global norm over all shards. Buffers (e.g. BatchNorm
statistics) are broadcast at setup only, as in FSDP.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_sync._checks import check_int
from lightning_sync._lightning import hidden_from_setup_broadcast
from lightning_sync.strategies._base import SyncStrategy
from lightning_sync.strategies._common import as_timedelta, check_bool, check_launch_args, no_sync_of
from lightning_sync.strategies._gathered_callbacks import GatheredCallbacks, resolve_gathered_callbacks
from lightning_sync.strategies._sharded_checkpoint import ShardedCheckpointing
from lightning_sync.strategies._sharded_live import FT_SNAPSHOT_MIB, ShardedLive
from lightning_sync.strategies._telemetry import BUCKETS
from lightning_sync.sync import zero
from lightning_sync.sync.bucketing import check_mib
from lightning_sync.sync.zero import (
    ZERO_STAGES,
    ZeroEngine,
    check_stage,
    resolve_dtype,
    resolve_wrap_policy,
)
from lightning_sync.sync.zero.engine import DEFAULT_COALESCE_MB
from lightning_sync.sync.zero.full_checkpoint import (
    full_model_state,
    resolve_state_dict_type,
)
from lightning_sync.sync.zero.grad_scaler import ShardedGradScaler
from lightning_sync.sync.zero.materialize import check_no_hidden_meta, has_meta, meta_hidden

__all__ = ["ShardedStrategy"]


class ShardedStrategy(ShardedLive, ShardedCheckpointing, SyncStrategy):
    """ZeRO-1/2/3 data parallelism with explicit all-gather and reduce-scatter (see the module docstring).

    Args:
        stage: 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters).
        wrap_policy: stage 3 units: None (the whole model), module classes / dotted class paths /
            class names (``["torch.nn.Linear"]``), an int or ``{"min_num_params": N}``, or a callable.
        prefetch: stage 3: issue the next unit's all-gather while the current unit computes, and the next
            forward's first ones as soon as the optimizer has stepped (single optimizer).
        coalesce_mb: stage 3: consecutive units whose parameters add up to at most this many MiB are gathered,
            and reduce-scattered, in one call each (fewer waits; two groups gathered at a time instead of two
            units); 0: one call per unit, as FSDP2.
        reshard_after_forward: stage 3: free a unit's parameters after its forward (gather again for
            backward: 1.5x DDP's bytes); False keeps them until its backward (1x, more memory).
        param_dtype: gather/compute dtype (``"bf16"``, ``"fp16"``, ``"fp32"``, a torch dtype, or None).
        reduce_dtype: gradient reduce-scatter dtype (None: the compute dtype).
        bucket_cap_mb: stages 1/2: gradient bucket size in MiB.
        offload: keep the fp32 master shards, their gradients and the optimizer state in host memory and run
            the optimizer step there (the device holds only what is gathered and computed).
        activation_checkpointing: recompute the activations of the modules ``wrap_policy`` selects in
            backward instead of keeping them (needs a ``wrap_policy`` that selects submodules).
        find_unused_parameters: train parameters that get no gradient on zero gradients (momentum and weight
            decay still move them); False (default) raises naming them, on every rank, as DDP does.
        gathered_callbacks: callback classes (or dotted class paths) whose every overridden hook runs with the
            module's full parameters, written back into the shards after it (Lightning's weight averaging,
            SWA and pruning always do); each such hook call costs one all-gather of the model.
        process_group_backend: ``"gloo"``, ``"nccl"`` or None (Lightning picks for the accelerator).
        timeout: collective timeout in seconds (or a ``timedelta``).
        start_method: ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        state_dict_type: ``"full"`` (one file, Lightning's format), ``"sharded"`` (a directory of shards) or
            None: ``"full"`` at stages 1/2, whose ranks hold the full parameters anyway and where every Lightning
            convention (``best_model_path``, ``load_from_checkpoint``, moving between ``ddp`` and ZeRO) assumes
            one file; ``"sharded"`` at stage 3, which is chosen when one rank cannot hold the model, so rank 0
            could not hold a full checkpoint either.
        fault_tolerant: keep training when a rank is lost (live membership; the ranks must be started by the
            fault-tolerance agent, ``lightning-sync launch``); None: on exactly when they were. The survivors go
            back to the last buddy snapshot and train the steps since again (:mod:`._sharded_live`).
        snapshot_every: with ``fault_tolerant``: optimizer steps between two buddy snapshots of every rank's
            shards (>= 1): a loss costs at most that many steps, plus one with ``snapshot_async``.
        snapshot_async: send each snapshot to the buddies while the next step trains, off the critical path (a
            loss in that step goes back to the snapshot before); False: inside the vote of the step that takes it.
        rebalance: split each global batch over the ranks by their measured speed, the gradient still the exact
            global mean (:mod:`lightning_sync.strategies._rebalance`); the sharding does not depend on the batch.
        rebalance_every: optimizer steps between two measurements of the ranks' speeds.
    """

    strategy_name = "sharded"

    def __init__(
        self,
        stage: int = 3,
        wrap_policy: Any = None,
        prefetch: bool = True,
        coalesce_mb: float = DEFAULT_COALESCE_MB,
        reshard_after_forward: bool = True,
        param_dtype: Any = None,
        reduce_dtype: Any = None,
        bucket_cap_mb: float = 25.0,
        offload: bool = False,
        activation_checkpointing: bool = False,
        find_unused_parameters: bool = False,
        gathered_callbacks: Sequence[type | str] | None = None,
        process_group_backend: str | None = None,
        timeout: float | timedelta = 1800.0,
        start_method: str = "popen",
        state_dict_type: str | None = None,
        fault_tolerant: bool | None = None,
        snapshot_every: int = 10,
        snapshot_async: bool = True,
        rebalance: bool = False,
        rebalance_every: int = 10,
        **kwargs: Any,
    ) -> None:
        check_stage(stage)
        self.snapshot_every = check_int("snapshot_every", snapshot_every, 1)
        self.snapshot_async = check_bool("snapshot_async", snapshot_async)
        self.state_dict_type = resolve_state_dict_type(state_dict_type, stage)
        check_mib("bucket_cap_mb", bucket_cap_mb)
        self.coalesce_mb = check_mib("coalesce_mb", coalesce_mb, zero=True)
        for name, value in (
            ("prefetch", prefetch),
            ("reshard_after_forward", reshard_after_forward),
            ("offload", offload),
            ("activation_checkpointing", activation_checkpointing),
            ("find_unused_parameters", find_unused_parameters),
        ):
            check_bool(name, value)
        if resolve_wrap_policy(wrap_policy) is None and activation_checkpointing:
            raise ValueError(
                "activation_checkpointing=True checkpoints the modules the wrap_policy selects; got "
                "wrap_policy=None: give one (e.g. the model's block class, or ['torch.nn.Linear'])"
            )
        gathered = resolve_gathered_callbacks(gathered_callbacks)
        self.param_dtype = resolve_dtype(param_dtype, "param_dtype")
        self.reduce_dtype = resolve_dtype(reduce_dtype, "reduce_dtype")
        check_launch_args(type(self).__name__, process_group_backend, start_method, kwargs)
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=as_timedelta(timeout),
            start_method=start_method,
            **kwargs,
        )
        self.stage, self.wrap_policy, self.prefetch = stage, wrap_policy, prefetch
        self.reshard_after_forward, self.bucket_cap_mb = reshard_after_forward, bucket_cap_mb
        self.offload, self.activation_checkpointing = offload, activation_checkpointing
        self.find_unused_parameters, self.gathered_callbacks = find_unused_parameters, gathered_callbacks
        self._callbacks = GatheredCallbacks(
            self._full_params, gathered, run=lambda hook: self._guard(hook, lambda: None)
        )
        self.engine: ZeroEngine | None = None
        # the engine a teardown closed, once it gave the module its full parameters back: its shards and the
        # optimizer's state in them, for checkpoints written after fit
        self._finished: ZeroEngine | None = None
        self._init_live()
        self._go_live(fault_tolerant, process_group_backend, start_method)
        self._rebalance(rebalance, rebalance_every)

    # ------------------------------------------------------------------ setup / teardown
    @override
    def configure_ddp(self) -> None:
        """No wrapper: the engine is built once the optimizer exists (:meth:`setup_optimizers`)."""

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Stage 3: on the meta device, unless ``empty_init=False`` (the engine initializes the model at setup).
        Stages 1/2 and ``empty_init=False``: Lightning's (on the device, with values), as under DDP."""
        if self.stage == 3 and empty_init is not False:
            with torch.device("meta"), self.precision_plugin.tensor_init_context():
                yield
        else:
            with super().tensor_init_context(empty_init):
                yield

    @override
    def model_to_device(self) -> None:
        """Lightning's move (it also sets the module's ``device``) of what has storage; tensors still on the meta
        device get theirs on the root device when the engine is built."""
        assert self.model is not None
        check_no_hidden_meta(self.model)  # before Lightning's move fails on them with a less helpful error
        with meta_hidden(self.model):
            super().model_to_device()

    @override
    def setup(self, trainer: Any) -> None:
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and not isinstance(scaler, ShardedGradScaler):
            # a GradScaler decides from this rank's gradient shard alone whether to skip a step: ranks would
            # disagree, and the ones that step would wait in the all-gather for the ones that skipped
            self.precision_plugin.scaler = ShardedGradScaler.like(scaler, self.comm)
        self._callbacks.install(trainer.callbacks, type(self).__name__, trainer.state.fn == TrainerFn.FITTING)
        assert self.model is not None
        meta = [n for n, t in (*self.model.named_parameters(), *self.model.named_buffers()) if t.is_meta]
        with hidden_from_setup_broadcast(self.model, meta):  # no values yet: the engine initializes them alike
            super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:  # evaluation: shard the parameters, no optimizer
            self._build_engine(None)
        self._route_clipping()

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        replacement = self._live_join_first()  # a live replacement shards over the membership that admits it
        self._build_engine(self.optimizers or None, broadcast=not replacement)  # its values: _live_load

    def _build_engine(self, optimizers: list[torch.optim.Optimizer] | None, broadcast: bool = True) -> None:
        assert self.model is not None
        if self.engine is not None:
            self.engine.unshard()
        self.engine = ZeroEngine(
            self.model,
            optimizers,
            self.comm,
            stage=self.stage,
            wrap_policy=self.wrap_policy,
            prefetch=self.prefetch,
            coalesce_mb=self.coalesce_mb,
            reshard_after_forward=self.reshard_after_forward,
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            bucket_cap_mb=self.bucket_cap_mb,
            init_device=self.root_device if has_meta(self.model) else None,  # deferred init: its storage
            offload=self.offload,
            activation_checkpointing=self.activation_checkpointing,
            find_unused_parameters=self.find_unused_parameters,
            broadcast=broadcast,
        )
        units = [u for u in self.engine.units if u.numel]
        rank_zero_info(
            f"{type(self).__name__}: ZeRO stage {self.stage}, {sum(u.numel for u in units)} trainable "
            f"parameters in {len(units)} {'units' if self.stage == 3 else 'buckets'} "
            f"(largest {self.engine.largest_unit_numel}), {self.world_size} shards"
        )

    def _route_clipping(self) -> None:
        """Norm clipping must see the global norm of all shards, not this rank's."""
        plugin = self.precision_plugin

        def clip_grad_by_norm(optimizer: Any, clip_val: int | float) -> None:
            if self.engine is None:
                raise RuntimeError("gradient clipping before the sharding engine was set up")
            self.engine.clip_grad_norm_(float(clip_val))

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    def _full_params(self) -> AbstractContextManager[None]:
        """The module's full parameters, written back into the shards at exit (nothing before the engine exists)."""
        return zero.summon_full_params(self.engine) if self.engine is not None else nullcontext()

    @override
    def teardown(self) -> None:
        self._callbacks.remove()
        if self.engine is not None:
            if self._live_whole():
                self.engine.unshard()  # the module holds the full trained parameters again
            else:  # a loss the survivors could not recover from: their group cannot gather the shards
                self.engine.close()
            self._finished, self.engine = self.engine, None
        super().teardown()

    # ------------------------------------------------------------------ step functions
    def _gathered(self, fn: Any, *args: Any, evaluation: bool, **kwargs: Any) -> Any:
        """A step function with the root unit gathered (an evaluation's resharded after); live, outside the vote,
        a failure in it is recorded and the step is skipped (:meth:`_skipped_step`; an evaluation's returns None)."""

        def run() -> Any:
            if self.engine is not None:
                self.engine.gather_root()
            try:
                return fn(*args, **kwargs)
            finally:
                if evaluation and self.engine is not None:
                    self.engine.reshard()

        return self._guard(run, (lambda: None) if evaluation else self._skipped_step)

    @override
    def _run_training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._gathered(super()._run_training_step, *args, evaluation=False, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._gathered(super().validation_step, *args, evaluation=True, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._gathered(super().test_step, *args, evaluation=True, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._gathered(super().predict_step, *args, evaluation=True, **kwargs)

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        return None  # the engine's gradient hooks do everything

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """Manual optimization may run another forward in the same step function (a GAN's second optimizer): stage 3
        gathers the root unit again, which backward freed (an optimizer step refreshes it while it is gathered)."""
        module = self.lightning_module
        if self.engine is not None and module is not None and not module.automatic_optimization:
            self.engine.gather_root()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation micro-steps: unsharded gradients accumulate locally, no collective is issued."""
        with no_sync_of(self.engine):
            yield None

    @override
    def _comm_gauges(self) -> dict[str, float]:
        gauges = {BUCKETS: float(sum(1 for u in self.engine.units if u.numel))} if self.engine is not None else {}
        if self.live is not None:
            gauges[FT_SNAPSHOT_MIB] = self.snapshot_bytes() / 2**20
        return gauges

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The consolidated full ``state_dict`` on rank 0 (``{}`` on the others): the module's keys, shapes and
        original dtypes. While the module is sharded (inside ``fit``, ``validate``, ``test``) it is gathered to
        rank 0's CPU from the master shards, one flat parameter at a time, a collective every rank must call; after
        them teardown has left every rank's module whole, so it is a copy of rank 0's. Raises ``RuntimeError``
        before the strategy was ever set up."""
        if self.engine is not None:
            return full_model_state(self.engine)
        module = self.lightning_module
        if module is None or self._finished is None:
            raise RuntimeError(
                f"{type(self).__name__}.full_state_dict() was called before the strategy was set up: "
                f"call it during or after trainer.fit, validate or test"
            )
        return {k: v.detach().clone() for k, v in module.state_dict().items()} if self.global_rank == 0 else {}

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for stage in ZERO_STAGES:
            strategy_registry.register(
                f"zero{stage}",
                cls,
                description=f"ZeRO stage {stage} with explicit all-gather/reduce-scatter (lightning_sync)",
                stage=stage,
                override=True,
            )
