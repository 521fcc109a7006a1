"""The one base of the lightning_sync strategies on a process group, and the check that each strategy takes
only the arguments it uses.

:class:`SyncStrategy` keeps Lightning's ``DDPStrategy`` for what is not about synchronization (launchers,
cluster environments, process-group setup, device placement), never wraps the model in torch's
``DistributedDataParallel``, and holds the pieces every such strategy uses, each an object of its own:

* ``comm``: its :class:`~lightning_sync.comms.CommContext`, through which Lightning's own collectives
  (``reduce``/``all_gather``/``broadcast``/``barrier``: synced metrics, ``self.all_gather``, checkpoint-path
  broadcasts) go, so that they are counted and watched like everything else;
* ``telemetry``: the per-step communication figures (:class:`~lightning_sync.strategies._telemetry.CommTelemetry`);
* ``exact_data``: exact resume and exact evaluation (:class:`~lightning_sync.strategies._exact_data.ExactData`);
* its ``checkpoint_io``: atomic files unless the user passes another
  (:class:`~lightning_sync.strategies._checkpoint_io.AtomicCheckpointIO`).

Its Lightning hooks call them, explicitly, in one place. What of this the strategies without a process group
share too (``comm``, ``telemetry``, the ``checkpoint_io`` and the hooks that call them) is written once, in
:class:`~lightning_sync.strategies._parts.StrategyParts`, the first base of both.

:class:`ProcessGroupStrategy` adds what the strategies that bucket no gradients share: the start-up broadcast
and one pair of per-rank checkpoint state hooks.

:func:`check_own_arguments` turns an argument a strategy would silently ignore into a ``ValueError`` that
names it, says which strategies take it and lists the ones this strategy accepts.
"""

from __future__ import annotations

import inspect
from collections.abc import Generator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from typing_extensions import override

from lightning_sync._lightning import next_restored, trainer_of
from lightning_sync.checkpoint.reading import guarded_load
from lightning_sync.strategies._common import PASSTHROUGH
from lightning_sync.strategies._exact_data import ExactData
from lightning_sync.strategies._lightning_collectives import LightningCollectives
from lightning_sync.strategies._live import LiveTraining
from lightning_sync.strategies._live_env import check_live_settings, live_requested
from lightning_sync.strategies._parts import StrategyParts
from lightning_sync.strategies._rebalance import Rebalancing
from lightning_sync.sync.replicas import broadcast_module_states

__all__ = [
    "ProcessGroupStrategy",
    "SyncStrategy",
    "check_own_arguments",
    "own_arguments",
    "registered_strategies",
]


def own_arguments(cls: type) -> list[str]:
    """The named keyword arguments ``cls`` takes, in signature order: its ``__init__``'s and those of the
    lightning_sync bases it forwards ``**kwargs`` to (Lightning's components, :data:`PASSTHROUGH`, not included)."""
    names: list[str] = []
    for base in cls.__mro__:
        if base.__module__.startswith("lightning_sync.") and "__init__" in vars(base):
            for p in inspect.signature(base.__init__).parameters.values():
                if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in names:
                    names.append(p.name)
    return names


def _join(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def registered_strategies() -> list[type]:
    """Every lightning_sync strategy class, by name: those registered in Lightning's ``StrategyRegistry``
    (importing :mod:`lightning_sync.strategies` registers each of them, so they are all there by the time one
    is constructed). Read from the registry rather than imported, because the strategies package imports this
    module."""
    registered = {entry["strategy"] for entry in StrategyRegistry.values()}
    ours = [c for c in registered if isinstance(c, type) and c.__module__.startswith("lightning_sync.")]
    return sorted(ours, key=lambda c: c.__name__)


def check_own_arguments(cls: type, kwargs: Mapping[str, Any]) -> None:
    """Raise a ``ValueError`` for every keyword argument in ``kwargs`` that ``cls`` does not take (Lightning's
    components, :data:`PASSTHROUGH`, excepted): it names them, says which lightning_sync strategies take them,
    so a configuration copied from another strategy is caught at once, and lists what ``cls`` accepts."""
    foreign = sorted(set(kwargs) - set(PASSTHROUGH))
    if not foreign:
        return
    others = registered_strategies()
    takers: dict[tuple[str, ...], list[str]] = {}
    for name in foreign:
        who = tuple(c.__name__ for c in others if c is not cls and name in own_arguments(c))
        takers.setdefault(who, []).append(repr(name))
    where = "; ".join(
        f"{_join(list(who))} {'takes' if len(who) == 1 else 'take'} {_join(names)}"
        if who
        else f"no lightning_sync strategy takes {_join(names)}"
        for who, names in takers.items()
    )
    raise ValueError(
        f"{cls.__name__} does not take {foreign} ({where}); it accepts {[*own_arguments(cls), *PASSTHROUGH]}"
    )


class SyncStrategy(StrategyParts, LightningCollectives, DDPStrategy):
    """What every lightning_sync strategy on a process group holds and does (module docstring).

    ``comm``, ``telemetry``, pickling, the atomic ``checkpoint_io`` and the per-step hooks come from
    :class:`~lightning_sync.strategies._parts.StrategyParts`, which a subclass tells what it adds to a step
    (``_after_optimizer_step``, ``_comm_counters``, ``_comm_gauges``). This class adds ``exact_data`` and
    sends Lightning's collectives through ``comm``.
    """

    #: True where every rank steps an optimizer of its own (see :class:`ExactData`)
    _per_rank_optimizer_state = False

    def __init__(self, **kwargs: Any) -> None:
        self.exact_data = ExactData(self, self._per_rank_optimizer_state)
        #: the rank's part in live fault tolerance, where a subclass switches it on (:meth:`_go_live`)
        self.live: LiveTraining | None = None
        #: each rank's share of the global batch by measured speed, where a subclass switches it on (:meth:`_rebalance`)
        self.rebalance: Rebalancing | None = None
        super().__init__(**kwargs)

    def _rebalance(self, rebalance: bool, every: int, deadline: float | None = None) -> None:
        """Where ``rebalance`` asks for it, split each global batch over the ranks by their measured speed
        (:meth:`Rebalancing.make <lightning_sync.strategies._rebalance.Rebalancing.make>` checks the settings)."""
        self.rebalance = Rebalancing.make(self, rebalance, every, deadline)

    def _go_live(
        self,
        fault_tolerant: bool | None,
        process_group_backend: str | None,
        start_method: str,
        **settings: tuple[Any, tuple[Any, ...]],
    ) -> None:
        """Where ``fault_tolerant`` asks for it (None: where the fault-tolerance agent started this process), join the
        agent's membership instead of Lightning's process group: ranks follow the membership epochs, failures stay
        inside the strategy (:mod:`lightning_sync.strategies._live`). Refuses first what live training does not
        support: a backend other than gloo or NCCL, a start method other than popen, and the strategy's own
        ``settings`` (name -> (value, allowed values))."""
        name = type(self).__name__
        if not live_requested(name, fault_tolerant):
            return
        check_live_settings(
            name,
            process_group_backend=(process_group_backend, (None, "gloo", "nccl")),
            start_method=(start_method, ("popen",)),
            **settings,
        )
        self.live = LiveTraining(self, self._timeout.total_seconds())
        self.cluster_environment = self.live.environment

    # ------------------------------------------------------------------ live fault tolerance
    @override
    def setup_distributed(self) -> None:
        if self.live is None:
            super().setup_distributed()
            return
        reset_seed()
        self.set_world_ranks()  # the nominal size, until the membership says who is here
        self._process_group_backend = self._get_process_group_backend()
        self.live.connect()

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """A replacement restores the state a live peer sent once its model and optimizers exist."""
        return self.live is not None and self.live.replacement

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if self.live is not None:
            self.live.setup(trainer)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.rebalance is not None:  # this rank's share of the micro-batch by speed
            args = self.rebalance.training_step_args(args)
        if self.live is not None:  # this member's share of the micro-batch, for the membership current now
            args = self.live.training_step_args(args)
            if self.live.failure is not None:  # the window is trained again whole after its vote: nothing counts
                return self._skipped_step()
        return self._run_training_step(*args, **kwargs)

    def _skipped_step(self) -> torch.Tensor:
        """What a live training step skipped after a failure returns: Lightning refuses None in distributed training,
        so a zero that requires a gradient, whose backward :meth:`backward` skips."""
        return torch.zeros((), device=self.root_device, requires_grad=True)

    def _run_training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The training step itself (Lightning's), on the arguments :meth:`training_step` settled."""
        return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.live is not None and self.live.failure is not None:  # a skipped step (or one that just failed)
            return closure_loss
        shared = self.live or self.rebalance
        if self.rebalance is not None and self.rebalance.late():  # past the deadline: zeros, every bucket still sent
            closure_loss = self.rebalance.nothing(self.lightning_module)
        elif shared is not None and shared.weight != 1.0:  # an uneven share of the micro-batch
            closure_loss = closure_loss * shared.weight
        out = super().backward(closure_loss, *args, **kwargs)
        if self.rebalance is not None:
            self.rebalance.backward_done()
        return out

    @override
    def _after_optimizer_step(self) -> None:
        if self.rebalance is not None:
            self.rebalance.step_done()

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.rebalance is not None:
            closure = self.rebalance.reweighed(closure)
        if self.live is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def step(run: Any) -> Any:
            return super(SyncStrategy, self).optimizer_step(optimizer, run, model, **kwargs)

        return self.live.optimizer_step(optimizer, closure, step)

    #: live: the optimizer step (and what follows it) runs inside the commit vote, and a replay starts from the
    #: window's start (:meth:`_live_mark`); False: the vote comes first and only a committed step is applied
    _live_step_in_vote = False

    #: live: a window's inner optimizer steps communicate (ZeRO's gathers), so a failure in one is recorded and the
    #: rest of the window skipped; False: they run no collective, and run whatever happened
    _live_guards_inner_steps = False

    def _live_commits_step(self) -> bool:
        """Whether the coming optimizer step ends a live window, which the members then commit (every step here)."""
        return True

    def _live_inner_step(self, optimizer: Any, closure: Any) -> Any:
        """One of a window's earlier optimizer steps, replayed: the step and what the strategy counts with it."""
        out = DDPStrategy.optimizer_step(self, optimizer, closure)
        self._after_optimizer_step()
        return out

    def _save_rank_states(self, checkpoint: dict[str, Any], filepath: Any, extra: dict[str, Any] | None) -> bool:
        """Every rank's state gathered into ``checkpoint`` (a collective); False: a member was lost while it ran,
        and this checkpoint is passed over (nothing is written, and the window's vote aborts)."""
        if self.live is None:
            self.exact_data.save_rank_states(checkpoint, extra)
            return True
        self.live.save(filepath, lambda: self.exact_data.save_rank_states(checkpoint, extra))
        return self.live.failure is None

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.live is not None and self.live.failure is not None:
            return  # the checkpoint meant to replace it was passed over: keep it
        super().remove_checkpoint(filepath)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.live is not None:
            self.live.flush_logs()

    @override
    def on_train_end(self) -> None:
        if self.live is not None and self.optimizers:  # a window left open by the fit's end is committed too
            self.live.finish_fit(self.optimizers[0])
        super().on_train_end()

    def _live_state(self) -> dict[str, Any]:
        """What a replacement takes of this strategy's own state from a live peer (nothing here)."""
        return {}

    def _live_load(self, state: dict[str, Any]) -> None:
        """Take :meth:`_live_state` from a live peer."""

    def _live_mark(self) -> None:
        """At an accumulation window's start: keep what a replay must start from again (nothing here)."""

    def _live_reset(self) -> None:
        """Before a replay: forget what the failed attempt left half done (nothing here)."""

    def _live_abort(self) -> None:
        """An attempt failed: drop what holds its group, before the membership tears the group down."""
        self._live_reset()

    def _live_closes_window(self) -> bool:
        """Whether the committed step that comes ends the window (every one here): else the window goes on after it,
        and a later loss replays it from the window's start."""
        return True

    def _live_admits(self) -> bool:
        """Whether the step this member just ran may admit replacements once committed (always here)."""
        return True

    def _live_admitted(self) -> None:
        """The members entered an epoch that admitted replacements and healed them (nothing more here)."""

    def _live_handing_over(self) -> AbstractContextManager[None]:
        """Around the checkpoint dump a replacement heals from (nothing changes here)."""
        return nullcontext()

    def _live_before_vote(self) -> None:
        """The window's last step ran in this attempt: what else the members commit with it (nothing here)."""

    def _live_committed(self) -> None:
        """The members committed the window (nothing more here)."""

    # ------------------------------------------------------------------ Lightning's hooks
    @override
    def setup_environment(self) -> None:
        self.exact_data.install_warnings_filter()
        super().setup_environment()

    @override
    def teardown(self) -> None:
        self.exact_data.remove_warnings_filter()
        super().teardown()

    @override
    def process_dataloader(self, dataloader: object) -> object:
        loader = self.exact_data.process_dataloader(super().process_dataloader(dataloader))
        trainer = trainer_of(self.lightning_module)
        if self.live is not None and trainer is not None and trainer.training:
            loader = self.live.install(loader)
        if self.rebalance is not None and trainer is not None and trainer.training:
            loader = self.rebalance.install(loader)
        return loader

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self.exact_data.on_train_start()

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """This rank's own optimizer state where the checkpoint has it, else Lightning's (rank 0's)."""
        super().load_optimizer_state_dict(self.exact_data.optimizer_checkpoint(checkpoint))


class ProcessGroupStrategy(SyncStrategy):
    """A ``DDPStrategy`` that never wraps the model: the subclass synchronizes explicitly (module docstring).

    What it synchronizes itself:

    * **Setup** (:meth:`configure_ddp`): rank 0's parameters and buffers are broadcast, so every replica
      starts equal. A subclass whose processes share one model (Hogwild) skips that.
    * **Backward:** nothing; ``block_backward_sync`` (Lightning's accumulation micro-steps) has nothing to
      hold back. A subclass that averages gradients overrides both.
    * **Metrics, telemetry, exact data, atomic files:** :class:`SyncStrategy`'s.
    * **Checkpoints:** every rank's RNG states, its place in the data and what :meth:`_rank_state` adds are
      gathered on rank 0 (a collective, when saving); on resume each rank gets its entry back through
      :meth:`_restore_rank_state` (``None`` from a checkpoint of another world size). Loading is weights-only
      unless asked otherwise (:mod:`lightning_sync.checkpoint.reading`).

    If a rank fails, its peers raise at their next collective once the process group notices (connection
    closed, or ``timeout``).
    """

    @override
    def configure_ddp(self) -> None:
        """Broadcast rank 0's parameters and buffers (no DDP wrapper); a live replacement has its peers' state."""
        assert self.model is not None
        if self.live is None or not self.live.replacement:
            broadcast_module_states(self.model, self.comm)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        yield None  # backward never communicates here: accumulation needs nothing

    # ------------------------------------------------------------------ checkpoints
    def _rank_state(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """What this rank adds to its entry of the per-rank states when ``checkpoint`` is saved (nothing)."""
        return {}

    def _restore_rank_state(self, mine: dict[str, Any] | None, checkpoint: dict[str, Any]) -> None:
        """Take back this rank's entry of a loaded ``checkpoint`` (``None``: none for this rank)."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self._save_rank_states(checkpoint, filepath, self._rank_state(checkpoint)):
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Weights-only unless ``weights_only=False`` (``trainer.fit(..., weights_only=False)``); a
        checkpoint that needs more raises :class:`~lightning_sync.checkpoint.reading.UntrustedCheckpointError`."""
        if self.live is not None and self.live.replacement:  # what a live peer sent, not the file
            return next_restored(self.lightning_module.trainer)
        checkpoint = guarded_load(
            lambda wo: super(ProcessGroupStrategy, self).load_checkpoint(checkpoint_path, wo),
            checkpoint_path,
            weights_only,
        )
        self._restore_rank_state(self.exact_data.take_rank_state(checkpoint), checkpoint)
        return checkpoint
