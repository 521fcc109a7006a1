"""``PeriodicStrategy``: what LocalSGD and DiLoCo share. Every rank steps its own replica with its own
optimizer, and a syncer (:mod:`lightning_sync.sync.periodic`) brings the replicas together every ``sync_every``
optimizer steps; between two syncs they drift apart.

A subclass says how the replicas meet: :meth:`PeriodicStrategy._make_syncer` builds the syncer,
:meth:`~PeriodicStrategy._after_step` counts an optimizer step with it, :meth:`~PeriodicStrategy._drifted`
says whether the replicas may differ now and :meth:`~PeriodicStrategy._synchronize` turns a copy of them into
the synchronized model. The rest is here, once:

* **Evaluation** runs on the synchronized model: while the replicas have drifted it is built for the
  evaluation, and each rank's own replica is put back after, so evaluating does not change training (also for
  ``trainer.validate``/``test`` after a fit that ended inside a period).
* **Checkpoints:** ``state_dict`` is the synchronized model (a collective when saving); the syncer's state
  rides under the subclass's key; each rank's per-rank state adds its replica where it differs from the saved
  model (every optimizer's state of a rank other than 0 is added by the strategy's ``exact_data``), and each
  rank puts both back on resume once Lightning has loaded the synchronized model and rank 0's optimizer state.
* **Export:** :meth:`PeriodicStrategy.full_state_dict`.

What it holds: ``self.averager``, the subclass's syncer (built at ``setup_optimizers``), besides the
``comm``, ``telemetry`` and ``exact_data`` of :class:`~lightning_sync.strategies._base.SyncStrategy`. The
syncer counts a step from :meth:`PeriodicStrategy._after_optimizer_step`, which ``SyncStrategy.optimizer_step``
calls inside the step, so the telemetry counts the sync's bytes.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_sync.resume import RANK_STATES
from lightning_sync.strategies._base import ProcessGroupStrategy, check_own_arguments
from lightning_sync.strategies._common import as_timedelta, check_launch_args
from lightning_sync.sync.periodic import check_int

__all__ = ["PeriodicStrategy"]


def mean_replica(states: list[dict[str, Any]], saved: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The mean over the checkpoint's ranks of every tensor some rank's replica holds (a rank that does not
    hold it had the saved value); integer tensors (step counters of buffers) are rank 0's."""
    keys = {k for s in states for k in s.get("replica", {})}
    out = {}
    for key in sorted(keys):
        values = [s.get("replica", {}).get(key, saved.get(key)) for s in states]
        if any(v is None for v in values):
            raise ValueError(f"the checkpoint's replicas hold {key!r}, but not every rank's nor its state_dict")
        if values[0].is_floating_point():
            out[key] = torch.stack([v.to(torch.float64) for v in values]).mean(0).to(values[0].dtype)
        else:
            out[key] = values[0].clone()
    return out


class PeriodicStrategy(ProcessGroupStrategy):
    """Replicas trained apart and synchronized every ``sync_every`` optimizer steps (see the module docstring).

    Args:
        sync_every: H, optimizer steps between two syncs (>= 1).
        process_group_backend: ``"gloo"``, ``"nccl"`` or None (Lightning picks for the accelerator).
        timeout: collective timeout in seconds (or a ``timedelta``).
        start_method: ``"popen"`` (re-run the script per rank), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        fault_tolerant: keep training when a rank is lost (live membership; the ranks must be started by the
            fault-tolerance agent, ``lightning-sync launch``); None: on exactly when they were.
        **kwargs: Lightning's components only (``accelerator``, ``cluster_environment``, ...); any other
            argument raises a ``ValueError`` naming it.

    If a rank fails, its peers raise in the next sync's all-reduce once the process group notices
    (connection closed, or ``timeout``). Started by the fault-tolerance agent they keep training instead: a
    period is the unit the members commit, and one that lost a member is trained again from its start by the
    survivors, on the same samples (:mod:`lightning_sync.strategies._live_window`).
    """

    _per_rank_optimizer_state = True  # every rank steps an optimizer of its own
    _ckpt_key: str  # where the syncer's state goes in Lightning's checkpoint
    _live_capable = True
    _live_step_in_vote = True  # the period's sync is what the members commit

    def __init__(
        self,
        sync_every: int,
        process_group_backend: str | None = None,
        timeout: float | timedelta = 1800.0,
        start_method: str = "popen",
        fault_tolerant: bool | None = None,
        **kwargs: Any,
    ) -> None:
        self.sync_every = check_int("sync_every", sync_every, 1)
        check_own_arguments(type(self), kwargs)
        check_launch_args(type(self).__name__, process_group_backend, start_method, kwargs)
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=as_timedelta(timeout),
            start_method=start_method,
            **kwargs,
        )
        self.averager: Any = None  # the syncer: PeriodicAverager or DiLoCoOuter
        self._pending_averager: dict[str, Any] | None = None  # loaded before setup_optimizers built the syncer
        self._stashed: list[torch.Tensor] | None = None  # this rank's replica during an evaluation
        self._own_pending: dict[str, Any] | None = None  # this rank's replica, to put back
        self._period_start: tuple[Any, ...] | None = None  # live: the state a replayed period starts from
        self._go_live(fault_tolerant, process_group_backend, start_method, **self._live_settings())

    # ------------------------------------------------------------------ what a subclass says
    def _make_syncer(self) -> Any:
        """The syncer over this rank's replica, built once the optimizers exist."""
        raise NotImplementedError

    def _after_step(self) -> None:
        """Count one optimizer step with the syncer (which syncs when a period ends)."""
        self.averager.step()

    def _drifted(self) -> bool:
        """Whether the replicas may differ now (the last step did not end a period)."""
        raise NotImplementedError

    def _synchronize(self, tensors: list[torch.Tensor]) -> None:
        """Turn ``tensors`` (copies, parallel to :meth:`_averaged_tensors`) into the synchronized model, in place."""
        raise NotImplementedError

    def _live_settings(self) -> dict[str, tuple[Any, tuple[Any, ...]]]:
        """The subclass's settings live training supports only some values of: name -> (value, those values)."""
        return {}

    def _averaged_tensors(self) -> list[torch.Tensor]:
        """The tensors a replica is made of: the parameters and the floating-point buffers."""
        assert self.model is not None
        buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        return [*self.model.parameters(), *buffers]

    # ------------------------------------------------------------------ training
    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        self.averager = self._make_syncer()
        if self._pending_averager is not None:
            self.averager.load_state_dict(self._pending_averager)
            self._pending_averager = None

    @override
    def _after_optimizer_step(self) -> None:
        if self.averager is not None:
            self._after_step()

    # ------------------------------------------------------------------ live fault tolerance: a period at a time
    @override
    def _live_commits_step(self) -> bool:
        """A period's last step commits it (so does each warm-up step, a period of its own)."""
        return self.averager is None or self.averager.period_ends_next()

    @override
    def _live_mark(self) -> None:
        """A period starts: keep what its replay starts from, the module, every optimizer's state and the syncer's
        (a copy: a replay would otherwise step the very tensors kept)."""
        module = self.lightning_module
        self._period_start = (
            {k: v.detach().clone() for k, v in module.state_dict().items()},
            [copy.deepcopy(o.state_dict()) for o in self.optimizers],
            copy.deepcopy(self.averager.state_dict()) if self.averager is not None else None,
        )

    @override
    def _live_reset(self) -> None:
        """Back to the period's start: an aborted period's inner steps, and a sync that completed on some members
        only, are undone on every member before the survivors train it again."""
        if self._period_start is None:
            return
        module_state, optimizer_states, syncer = self._period_start
        self.lightning_module.load_state_dict(module_state)
        for optimizer, state in zip(self.optimizers, optimizer_states):
            optimizer.load_state_dict(copy.deepcopy(state))
        if syncer is not None:
            self.averager.load_state_dict(copy.deepcopy(syncer))

    @override
    def _live_state(self) -> dict[str, Any]:
        """The syncer's state (DiLoCo's global model and outer momentum, the step counters), the same on every
        member; a replacement takes the rest (its replica, the inner optimizer's state) from the checkpoint its
        peer sends, at a period's start, where every replica is the synchronized model."""
        return {"syncer": self.averager.state_dict()} if self.averager is not None else {}

    @override
    def _live_load(self, state: dict[str, Any]) -> None:
        if "syncer" in state:
            self.averager.load_state_dict(state["syncer"])

    def _synchronize_guarded(self, tensors: list[torch.Tensor]) -> None:
        """:meth:`_synchronize` outside a committed period (an evaluation, a checkpoint): live, a loss leaves the
        values as they are, and the failure passes the checkpoint over and aborts the period."""
        if self.live is not None:
            self.live.guarded(lambda: self._synchronize(tensors), lambda: None)
        else:
            self._synchronize(tensors)

    # ------------------------------------------------------------------ evaluation on the synchronized model
    def _average_for_evaluation(self) -> None:
        if self._drifted() and self._stashed is None:
            tensors = self._averaged_tensors()
            self._stashed = [t.detach().clone() for t in tensors]
            self._synchronize_guarded(tensors)

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
        evaluation runs on the synchronized model as it does during fit."""
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

    # ------------------------------------------------------------------ checkpoints and export
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The synchronized model (a collective while the replicas differ; every rank computes it, rank 0
        saves it)."""
        state = super().lightning_module_state_dict()
        if not self._drifted() or not torch.distributed.is_initialized():
            return state
        assert self.model is not None
        live = self.model.state_dict(keep_vars=True)
        averaged = {id(t): t.detach().clone() for t in self._averaged_tensors()}
        self._synchronize_guarded(list(averaged.values()))
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

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self.averager is not None:
            checkpoint[self._ckpt_key] = self.averager.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def _rank_state(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """This rank's replica where it differs from the saved synchronized model (all of it inside a period,
        nothing right after a sync). A weights-only checkpoint cannot resume training, so it gets none."""
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
                # no copy: the gather packs the entry into its own buffer at once (one process alone too)
                replica[key] = value.detach()
        return {"replica": replica}

    @override
    def _restore_rank_state(self, mine: dict[str, Any] | None, checkpoint: dict[str, Any]) -> None:
        self._own_pending = mine if mine is not None and "replica" in mine else None
        states = checkpoint.get(RANK_STATES) or []
        if mine is None and any("replica" in s for s in states):
            # another world size: no replica maps to a rank one to one, but their mean is the model the next
            # sync would average, so the period's progress is kept (LocalSGD's saved model is that mean)
            self._own_pending = {"replica": mean_replica(states, checkpoint.get("state_dict", {}))}
            rank_zero_info(
                f"{type(self).__name__}: the checkpoint holds the replicas of {len(states)} ranks, this "
                f"run has {self.world_size}: every replica starts from their mean with rank 0's optimizer "
                f"state; the period's counters continue"
            )

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """After Lightning put the synchronized model into every replica (before setup) and now loads rank
        0's optimizer state: this rank's own optimizer state instead, and its own replica (the last step of
        a resume that touches them)."""
        own, self._own_pending = self._own_pending, None
        super().load_optimizer_state_dict(checkpoint)  # this rank's own optimizer state (``exact_data``)
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
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        state = checkpoint.get(self._ckpt_key)
        if state is not None:
            if self.averager is not None:
                self.averager.load_state_dict(state)
            else:
                self._pending_averager = state
        return checkpoint
