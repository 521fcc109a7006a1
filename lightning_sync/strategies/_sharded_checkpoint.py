"""How ``ShardedStrategy`` writes and reads its checkpoints.

A ``ShardedStrategy`` checkpoint takes one of two forms (``state_dict_type``); both load at any world size and
stage, and a save replaces whatever is at its path, file or directory, atomically
(:mod:`lightning_sync.checkpoint.atomic`).

- ``"full"`` (the default at stages 1/2): one file, rank 0's, in Lightning's ``ddp`` format: the module's
  ``state_dict`` and the unsharded optimizers' ``state_dict()``, gathered one flat parameter at a time
  (:mod:`lightning_sync.sync.zero.full_checkpoint`). ``torch.load(weights_only=True)``,
  ``Model.load_from_checkpoint`` and a plain ``ddp`` resume read it; a ``ddp`` file resumes here, resharded.
- ``"sharded"`` (the default at stage 3): a directory. Every rank writes its shards (keyed by parameter name
  and element offset) through ``torch.distributed.checkpoint``, rank 0 the replicated tensors,
  ``lightning_sync_meta.json``, ``README.txt`` and Lightning's state (``lightning.pt``). Atomic: it is
  written as a hidden ``.<name>.tmp``, and after every shard rank 0 adds ``lightning.pt`` and the
  ``COMPLETE`` marker, fsyncs and renames it into place; a directory without the marker is refused.
  ``lightning-sync consolidate`` makes one plain Lightning file of it (``load_from_checkpoint`` opens a
  path as a file, and stops at a directory).

Everything is read back weights-only (see :mod:`lightning_sync.checkpoint.reading`) unless
``trainer.fit(..., weights_only=False)`` opts in. :meth:`ShardedStrategy.full_state_dict` consolidates in memory.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_sync._lightning import unwrap_optimizer
from lightning_sync.checkpoint.atomic import publish_path, recover_path, remove_path
from lightning_sync.checkpoint.reading import contained_path, load_file, read_dcp_metadata
from lightning_sync.sync import zero
from lightning_sync.sync.zero import ZeroEngine, read_meta
from lightning_sync.sync.zero.checkpoint import check_compatible, replicated_state
from lightning_sync.sync.zero.format import COMPLETE_MARKER, LIGHTNING_STATE
from lightning_sync.sync.zero.full_checkpoint import (
    full_model_state,
    full_optimizer_state,
    is_plain_optimizer_state,
    load_full_optimizer_state,
)

__all__ = [
    "ShardedCheckpointing",
    "load_checkpoint_at",
    "load_optimizer_states",
    "optimizer_state_of",
    "save_directory",
]


class _Strategy(Protocol):
    """What the checkpoint functions use of the strategy."""

    global_rank: int
    world_size: int
    exact_data: Any

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def barrier(self, name: str | None = None) -> None: ...


def save_directory(strategy: _Strategy, engine: ZeroEngine, checkpoint: dict[str, Any], filepath: Any) -> None:
    """Write ``checkpoint`` as a sharded directory at ``filepath``; a collective. Atomic: every rank writes its
    shards into a hidden temporary directory; once all are written, rank 0 adds Lightning's state and the
    completion marker, fsyncs, and renames it into place (whatever was at the path, file or directory, goes)."""
    path = Path(strategy.broadcast(str(filepath)))
    tmp = path.with_name(f".{path.name}.tmp")
    if strategy.global_rank == 0:
        remove_path(tmp)  # a save killed earlier
    strategy.barrier()
    if not checkpoint.get("state_dict"):  # the model is in the shards
        checkpoint = {k: v for k, v in checkpoint.items() if k != "state_dict"}
    # else a callback put a model of its own there, which Lightning's format keeps in the state_dict: weight
    # averaging's average (the model itself goes to "current_model_state", {} here: it is in the shards), or
    # pruning's permanent form of the model. Rank 0 writes it whole: a full-size copy beside the shards, which
    # the callback built on every rank anyway
    zero.save_sharded(engine, tmp)
    strategy.barrier()  # every shard is written
    if strategy.global_rank == 0:
        torch.save(checkpoint, tmp / LIGHTNING_STATE)
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"world_size": strategy.world_size}))
        publish_path(tmp, path)
    strategy.barrier()


def load_checkpoint_at(
    strategy: _Strategy, engine: ZeroEngine, path: Path, weights_only: bool | None
) -> dict[str, Any]:
    """Read the checkpoint at ``path`` (a sharded directory or a full file, ours or Lightning ``ddp``'s) into
    ``engine``'s shards and return Lightning's part of it; weights-only unless ``weights_only=False``."""
    recover_path(path)  # a save killed while it replaced this directory left the old one aside
    if path.is_dir():
        meta = read_meta(path)  # clear error if it is not ours
        if not (path / COMPLETE_MARKER).is_file():
            raise ValueError(
                f"{path} is an incomplete sharded checkpoint (no {COMPLETE_MARKER}): its save "
                f"was interrupted; resume from an earlier one"
            )
        # the shards' .metadata is checked (no reads outside, nothing unrestricted) before anything in the
        # directory is unpickled
        read_dcp_metadata(path, weights_only)
        checkpoint = load_file(contained_path(path, LIGHTNING_STATE, "Lightning state file"), weights_only)
        model = _permanent_model(engine, meta, checkpoint.get("state_dict"))
        zero.load_sharded(engine, path, weights_only, model=model is None)
        if model is not None:
            zero.load_full_state_dict(engine, model)
        strategy.exact_data.take_rank_state(checkpoint)
        if checkpoint.get("current_model_state") == {}:  # weight averaging's: the model it puts back, in full
            checkpoint["current_model_state"] = zero.full_state_dict(engine)  # a collective; every rank read the same
        return checkpoint
    checkpoint = load_file(path, weights_only)
    strategy.exact_data.take_rank_state(checkpoint)
    zero.load_full_state_dict(engine, checkpoint["state_dict"])
    states = checkpoint.get("optimizer_states") or []
    if any(not is_plain_optimizer_state(s) for s in states):  # an after-fit file of an older version
        rank_zero_warn(
            f"{path} is a full checkpoint without the optimizers' per-parameter state: its weights were "
            f"loaded and sharded, and training resumes with a fresh optimizer state"
        )
    return checkpoint  # load_optimizer_state_dict reshards the optimizer states


def _permanent_model(engine: ZeroEngine, meta: dict[str, Any], state_dict: Any) -> dict[str, Any] | None:
    """The model to load instead of the shards' when a callback reparametrized the module when it was saved and
    left its plain form as the checkpoint's ``state_dict``, which is what Lightning's file holds: pruning's
    ``weight_orig`` and ``weight_mask`` made permanent (``weight``), for a module that has not been pruned
    (yet). None when the shards' keys are this module's (the shards are the model). A ``state_dict`` with the
    shards' own keys is no other form of the model (weight averaging's average), so it is never taken for it."""
    try:
        check_compatible(engine, meta)
        return None
    except ValueError as mismatch:
        mine = sorted(key for key, _ in replicated_state(engine)[0])
        saved = sorted(key for key, _ in meta["keys"])
        if not isinstance(state_dict, dict) or sorted(state_dict) != mine or saved == mine:
            raise mismatch from None
        return state_dict


def optimizer_state_of(engine: ZeroEngine | None, optimizer: Any, state_dict_type: str) -> dict[str, Any]:
    """What a checkpoint holds of ``optimizer``: with ``"full"``, on rank 0 the unsharded optimizer's
    ``state_dict()``, gathered (a collective); otherwise its hyperparameters only (learning rates, betas, ...),
    the per-element state being in the shards."""
    index = _index_in(engine, optimizer)
    if state_dict_type == "full" and engine is not None and index is not None:
        full = full_optimizer_state(engine, index)
        if full is not None:
            return full
    return {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}


def load_optimizer_states(engine: ZeroEngine | None, optimizers: list[Any], states: list[dict[str, Any]]) -> None:
    """A full checkpoint's (ours or ``ddp``'s) optimizer states are resharded into this rank's shards; a sharded
    one's state is in the shards already, and only its hyperparameters (a scheduler's learning rates) are read."""
    if len(states) != len(optimizers) and states:
        raise ValueError(
            f"the checkpoint holds {len(states)} optimizer states, this run has {len(optimizers)} optimizers"
        )
    for optimizer, state in zip(optimizers, states):
        index = _index_in(engine, optimizer)
        if engine is not None and index is not None and is_plain_optimizer_state(state):
            load_full_optimizer_state(engine, state, index)
            continue
        groups = state.get("param_groups", [])
        if len(groups) != len(optimizer.param_groups):
            raise ValueError(
                f"checkpoint has {len(groups)} optimizer param groups, this optimizer has {len(optimizer.param_groups)}"
            )
        for group, saved in zip(optimizer.param_groups, groups):
            group.update(saved)


def _index_in(engine: ZeroEngine | None, optimizer: Any) -> int | None:
    """``optimizer``'s position among the engine's (Lightning's ``optimizer_states`` are in that order)."""
    if engine is None:
        return None
    return next((i for i, opt in enumerate(engine.optimizers) if opt is optimizer), None)


class ShardedCheckpointing:
    """:class:`~lightning_sync.strategies.sharded.ShardedStrategy`'s side of Lightning's checkpointing: what goes
    into a checkpoint, and how one is written, read and removed, in either form (module docstring). A mixin before
    the strategy's Lightning base, whose methods its ``super()`` calls reach."""

    engine: ZeroEngine | None
    _finished: ZeroEngine | None  # the engine a teardown closed: its shards, for checkpoints written after fit
    state_dict_type: str
    exact_data: Any
    optimizers: list[Any]
    global_rank: int
    is_global_zero: bool

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the shards, so they are read once the engine exists."""
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        """True: Lightning then hands the checkpoint to :meth:`load_optimizer_state_dict`, which
        restores the hyperparameters (learning rates a scheduler changed); the state is in the shards."""
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """``"full"``: the module's full state, gathered to rank 0 (``{}`` elsewhere; a collective). ``"sharded"``:
        ``{}``, save_checkpoint writes the shards. After fit: the module's own, whole again."""
        if self.engine is None:
            return super().lightning_module_state_dict()
        return full_model_state(self.engine) if self.state_dict_type == "full" else {}

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """``"full"``: on rank 0 the unsharded optimizer's ``state_dict()``, gathered (a collective). Otherwise the
        hyperparameters only (learning rates, betas, ...): the per-element state is in the shards."""
        return optimizer_state_of(self.engine or self._finished, unwrap_optimizer(optimizer), self.state_dict_type)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        return None  # load_checkpoint already loaded the shards

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """A full checkpoint's (ours or ``ddp``'s) optimizer states are resharded into this rank's shards; a
        sharded one's state is in the shards already, and only its hyperparameters are read here."""
        load_optimizer_states(self.engine, self.optimizers, checkpoint.get("optimizer_states") or [])

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint does not take storage_options (it writes a local "
                f"file, or a sharded directory through torch.distributed.checkpoint), got {storage_options!r}"
            )
        self.exact_data.save_rank_states(checkpoint)
        engine = self.engine or self._finished
        if self.state_dict_type == "full" or engine is None:  # one file, rank 0's (a directory there goes)
            super().save_checkpoint(checkpoint, filepath)
            return
        save_directory(self, engine, checkpoint, filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Weights-only unless ``weights_only=False`` (``trainer.fit(..., weights_only=False)``); a
        checkpoint that needs more raises :class:`~lightning_sync.checkpoint.reading.UntrustedCheckpointError`."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if self.engine is None:  # Lightning loads a sharded checkpoint after setup (restore_checkpoint_after_setup)
            raise RuntimeError(
                f"{type(self).__name__}.load_checkpoint reads into the sharding engine, which "
                f"exists once the strategy is set up (Trainer.fit/validate/test); {path} was not read"
            )
        return load_checkpoint_at(self, self.engine, path, weights_only)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            recover_path(filepath)  # an old copy left aside would otherwise come back as this checkpoint
            remove_path(Path(filepath))
