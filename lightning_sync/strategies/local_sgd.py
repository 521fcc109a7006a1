"""``LocalSGDStrategy``: every rank steps its own replica; the replicas are averaged every H steps.

The Lightning adapter of :class:`lightning_sync.sync.periodic.PeriodicAverager` (post-local SGD; Lin
et al., ICLR 2020; torch's ``PeriodicModelAverager``). It extends ``BucketedDDPStrategy`` for the
warm-up phase, which is ordinary synchronous data parallelism.

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
    ranks other than 0, its own optimizer state. On resume each rank puts both back once Lightning
    has loaded the average and rank 0's optimizer state (``load_optimizer_state_dict``).

  Size, K ranks, Ψ values per model, Adam's 2Ψ of state: inside a period (K + 1)Ψ + 2KΨ, right after
  a sync Ψ + 2KΨ, against Ψ + 2Ψ for the average and rank 0's state alone. At another world size,
  or from a checkpoint without per-rank states, every replica starts from the average with rank 0's
  optimizer state, and the counters continue. A weights-only checkpoint holds the average alone.
* **Metrics:** ``reduce``/``all_gather``/``broadcast``/``barrier`` go through ``lightning_sync.comms``.

Lightning's ``global_step`` counts optimizer steps as usual, and LR schedulers step on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_sync.resume import RANK_STATES
from lightning_sync.strategies._common import check_bool, no_sync_of
from lightning_sync.strategies.bucketed_ddp import BucketedDDPStrategy
from lightning_sync.sync.communicator import ProcessGroupCommunicator
from lightning_sync.sync.periodic import PeriodicAverager, average_tensors, check_int

__all__ = ["LocalSGDStrategy"]

_CKPT_KEY = "lightning_sync/local_sgd"


class LocalSGDStrategy(BucketedDDPStrategy):
    """LocalSGD / post-local SGD (see the module docstring).

    Args:
        sync_every: H, optimizer steps between parameter averages (>= 1).
        warmup_steps: optimizer steps of synchronous (gradient-averaging) training first (>= 0).
        average_optimizer_state: also average the optimizer's per-parameter state at every sync.
        **kwargs: ``BucketedDDPStrategy``'s arguments (used during warm-up), e.g. ``bucket_cap_mb``,
            ``process_group_backend``, ``timeout``. ``broadcast_buffers`` defaults to False here:
            buffers are averaged at every sync instead.
    """

    strategy_name = "local_sgd"
    _per_rank_optimizer_state = True  # every rank steps an optimizer of its own

    def __init__(
        self, sync_every: int = 8, warmup_steps: int = 0, average_optimizer_state: bool = False, **kwargs: Any
    ) -> None:
        self.sync_every = check_int("sync_every", sync_every, 1)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.average_optimizer_state = check_bool("average_optimizer_state", average_optimizer_state)
        kwargs.setdefault("broadcast_buffers", False)
        super().__init__(**kwargs)
        self.averager: Any = None  # PeriodicAverager (DiLoCoOuter in the DiLoCo subclass)
        self._pending_averager: dict[str, Any] | None = None
        self._stashed: list[torch.Tensor] | None = None
        self._own_pending: dict[str, Any] | None = None  # this rank's replica, to put back

    def _averaged_tensors(self) -> list[torch.Tensor]:
        assert self.model is not None
        buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        return [*self.model.parameters(), *buffers]

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if self.average_optimizer_state and len(self.optimizers) != 1:
            raise ValueError(f"average_optimizer_state=True needs exactly one optimizer, got {len(self.optimizers)}")
        self.averager = self._make_syncer()
        if self._pending_averager is not None:
            self.averager.load_state_dict(self._pending_averager)
            self._pending_averager = None

    def _make_syncer(self) -> Any:
        return PeriodicAverager(
            self._averaged_tensors(),
            ProcessGroupCommunicator(),
            self.sync_every,
            self.warmup_steps,
            self.optimizers[0] if self.optimizers else None,
            self.average_optimizer_state,
        )

    # ------------------------------------------------------------------ training
    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Local steps: backward without any gradient collective (warm-up steps average as DDP does)."""
        with no_sync_of(self.bucketer if self._local_step() else None):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _local_step(self) -> bool:
        """Whether this step sends no gradient (after the warm-up)."""
        return self.averager is not None and not self.averager.in_warmup

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.averager is not None:
            self._after_step()
        return out

    def _after_step(self) -> None:
        """Count the optimizer step; average when a period ends."""
        self.averager.step()

    # ------------------------------------------------------------------ evaluation on the averaged model
    def _drifted(self) -> bool:
        a = self.averager
        return a is not None and not a.in_warmup and (a.steps - a.warmup_steps) % a.sync_every != 0

    def _synchronize(self, tensors: list[torch.Tensor]) -> None:
        """Turn ``tensors`` (parallel to :meth:`_averaged_tensors`) into the synchronized model, in place:
        here the average of the replicas (a collective)."""
        average_tensors(tensors, ProcessGroupCommunicator())

    def _average_for_evaluation(self) -> None:
        if self._drifted() and self._stashed is None:
            tensors = self._averaged_tensors()
            self._stashed = [t.detach().clone() for t in tensors]
            self._synchronize(tensors)

    def _restore_after_evaluation(self) -> None:
        if self._stashed is not None:
            self._put_back(self._stashed)
            self._stashed = None

    def _put_back(self, saved: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for t, value in zip(self._averaged_tensors(), saved):
                t.copy_(value)

    @override
    def setup(self, trainer: Any) -> None:
        """``validate``/``test`` after a fit that ended inside a period: Lightning's setup gives every rank
        rank 0's weights (a broadcast), which would drop the other replicas; each rank keeps its own, and the
        evaluation runs on their average as it does during fit."""
        keep = None
        if trainer.state.fn != TrainerFn.FITTING and self._drifted():
            keep = [t.detach().clone() for t in self._averaged_tensors()]
        super().setup(trainer)
        if keep is not None:
            self._put_back(keep)

    @override
    def on_validation_start(self) -> None:
        self._average_for_evaluation()

    @override
    def on_validation_end(self) -> None:
        self._restore_after_evaluation()

    @override
    def on_test_start(self) -> None:
        self._average_for_evaluation()

    @override
    def on_test_end(self) -> None:
        self._restore_after_evaluation()

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The average of the replicas (a collective; every rank computes it, rank 0 saves it)."""
        state = super().lightning_module_state_dict()
        if not self._drifted() or not torch.distributed.is_initialized():
            return state
        assert self.model is not None
        live = self.model.state_dict(keep_vars=True)
        averaged = {id(t): t.detach().clone() for t in self._averaged_tensors()}
        self._synchronize(list(averaged.values()))
        return {k: averaged.get(id(live.get(k)), v) for k, v in state.items()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The synchronized model as a ``state_dict`` on rank 0 (``{}`` on the others): the replicas' average
        (DiLoCo: the global model of the last outer step), what a checkpoint's ``state_dict`` holds and the
        model to export; after a fit that ended inside a period each rank's module is its own replica. A
        collective while the replicas differ: every rank must call it. Raises ``RuntimeError`` before setup."""
        if self.lightning_module is None:
            raise RuntimeError(
                f"{type(self).__name__}.full_state_dict() was called before the strategy was set up: "
                f"call it during or after trainer.fit, validate or test"
            )
        state = self.lightning_module_state_dict()
        return {k: v.detach().clone() for k, v in state.items()} if self.global_rank == 0 else {}

    _ckpt_key = _CKPT_KEY

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self.averager is not None:
            checkpoint[self._ckpt_key] = self.averager.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def _save_rank_states(self, checkpoint: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
        """Each rank's entry adds what only this rank holds (see the module docstring)."""
        super()._save_rank_states(checkpoint, {**(extra or {}), **self._own_state(checkpoint)})

    def _own_state(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """This rank's replica where it differs from the saved synchronized model (all of it inside a period,
        nothing right after a sync; its optimizer states are added by :meth:`_save_rank_states` itself). A
        weights-only checkpoint cannot resume training, so it gets none."""
        if "optimizer_states" not in checkpoint or self.lightning_module is None:
            return {}
        saved = checkpoint.get("state_dict", {})
        replica: dict[str, torch.Tensor] = {}
        seen: set[int] = set()  # a tied parameter once: putting it back under one name restores every name
        for key, value in self.lightning_module.state_dict(keep_vars=True).items():
            if not isinstance(value, torch.Tensor) or id(value) in seen:
                continue
            seen.add(id(value))
            if not (key in saved and torch.equal(value, saved[key])):
                # no copy: the entry is pickled for the gather at once (one process has nothing to add)
                replica[key] = value.detach()
        return {"replica": replica}

    @override
    def _take_rank_state(self, checkpoint: dict[str, Any]) -> dict[str, Any] | None:
        mine = super()._take_rank_state(checkpoint)
        self._own_pending = mine if mine is not None and "replica" in mine else None
        states = checkpoint.get(RANK_STATES) or []
        if mine is None and any("replica" in s for s in states):
            rank_zero_info(
                f"{type(self).__name__}: the checkpoint holds the replicas of {len(states)} ranks, this "
                f"run has {self.world_size}: every replica starts from the saved synchronized model with "
                f"rank 0's optimizer state; the period's counters continue"
            )
        return mine

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """After Lightning put the synchronized model into every replica (before setup) and now loads rank
        0's optimizer state: this rank's own optimizer state instead, and its own replica (the last step of
        a resume that touches them)."""
        own, self._own_pending = self._own_pending, None
        super().load_optimizer_state_dict(checkpoint)  # this rank's own optimizer state (ExactDataHooks)
        if own is None:
            return
        assert self.lightning_module is not None
        live = self.lightning_module.state_dict(keep_vars=True)
        unknown = sorted(set(own["replica"]) - set(live))
        if unknown:
            raise ValueError(
                f"the checkpoint's replica of rank {self.global_rank} holds {unknown[:3]}, which this "
                f"model does not have"
            )
        with torch.no_grad():
            for key, value in own["replica"].items():
                live[key].copy_(value)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        state = checkpoint.get(self._ckpt_key)
        if state is not None:
            if self.averager is not None:
                self.averager.load_state_dict(state)
            else:
                self._pending_averager = state
        return checkpoint

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "local_sgd",
            cls,
            description="LocalSGD: local steps, parameters averaged every sync_every steps (lightning_sync)",
            override=True,
        )
