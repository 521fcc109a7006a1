"""Every strategy sees exactly the samples it should: a resumed run continues where the interrupted one stopped,
and evaluation counts every sample once.

:class:`ExactData`, an object every strategy on a process group holds (``strategy.exact_data``), does two
things from the strategy's Lightning hooks:

* **Training:** the strategy's :class:`~lightning_sync.resume.ExactResume` makes the training loader resumable
  (its position in the epoch's global order rides in Lightning's checkpoint), gathers every rank's RNG states
  into each checkpoint and sets them again when training starts. Where the strategy rebalances, the split of the
  global batch rides in the checkpoint too (:mod:`lightning_sync.strategies._rebalance`).
* **Evaluation:** Lightning's ``DistributedSampler`` pads an evaluation set to a multiple of the world size
  by repeating samples, which synced metrics then count twice (and ``trainer.validate()`` warns about it).
  :func:`~lightning_sync.sampler.shard_for_evaluation` deals the set out without repeats whenever every rank
  still runs the same number of batches; where that is impossible the padding stays, and rank 0 says how
  many samples are evaluated twice instead of Lightning's general warning, which would otherwise be wrong.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from lightning_sync._lightning import epoch_batches, finish_restored_epoch, set_epoch_batches, trainer_of
from lightning_sync.resume import RANK_STATES, ExactResume, stash_positions, unstash_positions
from lightning_sync.sampler import shard_for_evaluation
from lightning_sync.strategies._rebalance import REBALANCE

__all__ = ["ExactData"]

# Lightning's warning for trainer.validate()/test() with a DistributedSampler: it says samples are repeated,
# which is no longer true once shard_for_evaluation dealt the set out (and said so itself where it could not)
_REPEATS_WARNING = r"Using `DistributedSampler` with the dataloaders\. During `trainer\.(validate|test)\(\)`"


class _FitLoop:
    """Lightning's training loop as the data position sees it (:class:`~lightning_sync.resume.TrainingLoop`)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def trained(self) -> tuple[int, bool]:
        """Read when a checkpoint is written. In ``on_train_batch_end`` (step-interval and preemption
        checkpoints) the batch counts as processed; the loader's own count runs ahead by what it prefetched.
        Inside an accumulation window only the whole windows count: the window's gradients are not in the
        checkpoint, so a resume trains its batches again, from the weights they started from (Lightning's
        ModelCheckpoint saves there when a run resumed with accumulation: its last saved step is not restored,
        and the first micro-batch ends at the same global step)."""
        done = epoch_batches(self.trainer)
        if done >= self.trainer.num_training_batches:
            return done, True
        return done - done % self.accumulate(), False

    def accumulate(self) -> int:
        return int(self.trainer.accumulate_grad_batches)

    def restart_at(self, batches: int) -> None:
        """Called while the loader is set up, after Lightning restored the loop and before the epoch starts:
        accumulation windows, the epoch's last batch and step-interval checks then fall where they would had
        the run trained in this run's batches all along."""
        set_epoch_batches(self.trainer, batches)


class ExactData:
    """Exact resume and exact evaluation for the strategy that owns it (module docstring): the strategy calls
    each method from the Lightning hook its name says, and its ``save_checkpoint``/``load_checkpoint`` call
    :meth:`save_rank_states` on every rank and :meth:`take_rank_state`.

    Args:
        owner: the strategy (read for its module, ranks, device, optimizers and communication context).
        per_rank_optimizer_state: True where every rank steps an optimizer of its own whose state drifts from
            rank 0's (replicas trained apart: local SGD, DiLoCo, Hogwild). Lightning saves rank 0's
            ``optimizer_states`` only, so the other ranks' go into their per-rank states and each rank loads
            its own back.
    """

    def __init__(self, owner: Any, per_rank_optimizer_state: bool = False) -> None:
        self._owner = owner
        self.per_rank_optimizer_state = per_rank_optimizer_state
        self.resume = ExactResume()
        self._repeats_filter: tuple[Any, ...] | None = None
        self._own_optimizer_states: list[dict[str, Any]] | None = None  # taken from a checkpoint, loaded next

    def install_warnings_filter(self) -> None:
        """At ``setup_environment``: hide Lightning's warning about repeated evaluation samples."""
        warnings.filterwarnings("ignore", message=_REPEATS_WARNING, category=PossibleUserWarning)
        self._repeats_filter = warnings.filters[0]

    def remove_warnings_filter(self) -> None:
        """At ``teardown``: other strategies in this process keep Lightning's warning."""
        if self._repeats_filter in warnings.filters:
            warnings.filters.remove(self._repeats_filter)
        self._repeats_filter = None

    def process_dataloader(self, dataloader: object) -> object:
        """After Lightning's ``process_dataloader``: the training loader made resumable, an evaluation set
        dealt out without repeats where it can be."""
        owner = self._owner
        trainer = trainer_of(owner.lightning_module)
        if trainer is None:
            return dataloader
        if trainer.training:
            return self.resume.install(dataloader, _FitLoop(trainer))
        if not (trainer.validating or trainer.testing or trainer.sanity_checking):
            return dataloader  # prediction: Lightning's own unrepeated sampler already
        repeated = shard_for_evaluation(dataloader)
        if repeated:
            size, world = len(dataloader.dataset), owner.world_size  # type: ignore[attr-defined]
            rank_zero_warn(
                f"{type(owner).__name__}: {repeated} sample{'' if repeated == 1 else 's'} of {size} "
                f"{'is' if repeated == 1 else 'are'} evaluated twice, and counted twice by synced metrics: "
                f"the set cannot be dealt out to {world} ranks without repeats and with the "
                f"same number of batches on each, which a collective in every evaluation step needs",
                category=PossibleUserWarning,
            )
        return dataloader

    def on_train_start(self) -> None:
        """After Lightning's ``on_train_start``: the restored epoch's counts, and this rank's RNG streams."""
        trainer = trainer_of(self._owner.lightning_module)
        if trainer is not None:
            finish_restored_epoch(trainer)
        self.resume.restore_rng(self._owner.root_device)

    def save_rank_states(self, checkpoint: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
        """Every rank's RNG states and ``extra`` into ``checkpoint`` (on rank 0; a collective), and, with
        :attr:`per_rank_optimizer_state`, the optimizer states of the ranks other than 0 (a weights-only
        checkpoint holds none: it cannot resume training). The training loaders' positions move beside
        Lightning's state (:func:`~lightning_sync.resume.stash_positions`)."""
        owner = self._owner
        extra = dict(extra or {})
        if self.per_rank_optimizer_state and owner.global_rank != 0 and "optimizer_states" in checkpoint:
            extra["optimizer_states"] = [owner.optimizer_state(o) for o in owner.optimizers]
        checkpoint[RANK_STATES] = self.resume.gather(owner.comm, extra, owner.root_device)
        stash_positions(checkpoint)
        rebalance = getattr(owner, "rebalance", None)
        if rebalance is not None and rebalance.state_dict() is not None:  # the split: the same on every rank
            checkpoint[REBALANCE] = rebalance.state_dict()

    def take_rank_state(self, checkpoint: dict[str, Any]) -> dict[str, Any] | None:
        """This rank's entry of ``checkpoint``'s per-rank states (None when absent or from another world size);
        its own optimizer states, if it has them, are kept for :meth:`take_own_optimizer_states`. The training
        loaders' positions go back where Lightning restores them from."""
        unstash_positions(checkpoint)
        rebalance = getattr(self._owner, "rebalance", None)
        if rebalance is not None:
            rebalance.load_state_dict(checkpoint.get(REBALANCE))
        mine = self.resume.take(checkpoint.get(RANK_STATES), self._owner.global_rank, self._owner.world_size)
        self._own_optimizer_states = mine.get("optimizer_states") if mine is not None else None
        return mine

    def optimizer_checkpoint(self, checkpoint: Mapping[str, Any]) -> Mapping[str, Any]:
        """What ``load_optimizer_state_dict`` loads: this rank's own optimizer states where the checkpoint had
        them (taken once), else ``checkpoint`` (Lightning's: rank 0's)."""
        states, self._own_optimizer_states = self._own_optimizer_states, None
        return checkpoint if states is None else {"optimizer_states": states}
