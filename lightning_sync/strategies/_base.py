"""What the lightning_sync strategies on a process group share when no gradient bucketing is involved, and the
check that each strategy takes only the arguments it uses.

:class:`ProcessGroupStrategy` keeps Lightning's ``DDPStrategy`` for what is not about synchronization
(launchers, cluster environments, process-group setup, device placement) and never wraps the model in torch's
``DistributedDataParallel``: a subclass decides what crosses the wire, and when. Every rank's per-rank
checkpoint state (RNG streams, place in the data, and whatever the subclass adds) goes through one pair of
hooks, so a subclass never gathers or loads it by hand.

:func:`check_own_arguments` turns an argument a strategy would silently ignore into a ``ValueError`` that
names it, says which strategies take it and lists the ones this strategy accepts.
"""

from __future__ import annotations

import inspect
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from typing_extensions import override

from lightning_sync.checkpoint.reading import guarded_load
from lightning_sync.strategies._common import PASSTHROUGH, CommsCollectivesMixin
from lightning_sync.sync.replicas import broadcast_module_states

__all__ = [
    "ProcessGroupStrategy",
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


class ProcessGroupStrategy(CommsCollectivesMixin, DDPStrategy):
    """A ``DDPStrategy`` that never wraps the model: the subclass synchronizes explicitly (module docstring).

    What it synchronizes itself:

    * **Setup** (:meth:`configure_ddp`): rank 0's parameters and buffers are broadcast, so every replica
      starts equal. A subclass whose processes share one model (Hogwild) skips that.
    * **Backward:** nothing; ``block_backward_sync`` (Lightning's accumulation micro-steps) has nothing to
      hold back. A subclass that averages gradients overrides both.
    * **Metrics:** ``reduce``/``all_gather``/``broadcast``/``barrier`` go through ``lightning_sync.comms``.
    * **Checkpoints:** every rank's RNG states, its place in the data and what :meth:`_rank_state` adds are
      gathered on rank 0 (a collective, when saving); on resume each rank gets its entry back through
      :meth:`_restore_rank_state` (``None`` from a checkpoint of another world size). Loading is weights-only
      unless asked otherwise (:mod:`lightning_sync.checkpoint.reading`).

    If a rank fails, its peers raise at their next collective once the process group notices (connection
    closed, or ``timeout``).
    """

    @property
    def is_distributed(self) -> bool:
        """Always True: Lightning then adds the DistributedSampler and turns ``sync_dist`` on (without the
        deprecation warning ``DDPStrategy``'s own property emits)."""
        return True

    @override
    def configure_ddp(self) -> None:
        """Broadcast rank 0's parameters and buffers (no DDP wrapper)."""
        assert self.model is not None
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
        self._save_rank_states(checkpoint, self._rank_state(checkpoint))
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Weights-only unless ``weights_only=False`` (``trainer.fit(..., weights_only=False)``); a
        checkpoint that needs more raises :class:`~lightning_sync.checkpoint.reading.UntrustedCheckpointError`."""
        checkpoint = guarded_load(
            lambda wo: super(ProcessGroupStrategy, self).load_checkpoint(checkpoint_path, wo),
            checkpoint_path,
            weights_only,
        )
        self._restore_rank_state(self._take_rank_state(checkpoint), checkpoint)
        return checkpoint
