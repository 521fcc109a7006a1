"""Lightning callbacks that read or write the module's parameters, run on a sharded model.

Lightning's weight averaging (``WeightAveraging``, ``EMAWeightAveraging``), ``StochasticWeightAveraging`` and
``ModelPruning`` work on ``pl_module.parameters()`` as a plain module's: they read them to average or to
rank them, and write them (the average into the model at train end, its swap in and out around
validation, the pruned values). Under ZeRO stage 3 those are empty tensors between gathers, and in every
stage the master shards are the training state, so :class:`GatheredCallbacks` runs those hooks inside the
engine's :func:`~lightning_sync.sync.zero.summon.summon_full_params`: the module holds its full parameters
during the hook, and what the hook changed is written back into the masters. Lightning calls every
callback hook on every rank, which the gather needs. The cost is one all-gather of the model per wrapped
hook call where the parameters are not already whole (stage 3, or a ``param_dtype``), and one full copy of
the model per rank while the hook runs; weight averaging's own averaged copy is full-size too, as under DDP.

The hooks are wrapped on the callback instances (``callback.on_train_end = ...``) when the strategy is set
up, and the wrappers removed at teardown. Another callback class opts in through the strategy's
``gathered_callbacks`` argument: then every hook it overrides is gathered.

``BaseFinetuning`` (and ``BackboneFinetuning``) unfreeze parameters and add optimizer param groups during
fit; the engine shards the trainable parameters and the optimizer state once, at setup, so they are
refused there with a ``ValueError``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from lightning.pytorch.callbacks import (
    BaseFinetuning,
    Callback,
    ModelPruning,
    StochasticWeightAveraging,
    WeightAveraging,
)

from lightning_sync.sync.zero.options import import_class

__all__ = ["GATHERED_HOOKS", "GatheredCallbacks", "refuse_finetuning", "resolve_gathered_callbacks"]

GATHERED_HOOKS: dict[type[Callback], tuple[str, ...]] = {
    WeightAveraging: (
        "on_train_batch_end",  # update the average (EMA: every step)
        "on_train_epoch_end",  # update the average (per-epoch averaging)
        "on_train_end",  # copy the average into the model
        "on_validation_epoch_start",  # swap the average in
        "on_validation_epoch_end",  # and out
        "on_load_checkpoint",  # the model's own state back into it (the checkpoint's state_dict is the average)
    ),
    StochasticWeightAveraging: (
        "on_train_epoch_start",  # update the average; transfer it in (models with batch norm)
        "on_train_end",  # transfer the average into the model
    ),
    ModelPruning: (
        "on_train_epoch_end",  # prune (ranks the weights; lottery ticket: resets them)
        "on_validation_epoch_end",  # prune (prune_on_train_epoch_end=False)
        "on_train_end",  # make the pruning permanent
        "on_save_checkpoint",  # the permanent state_dict of the checkpoint
    ),
}
"""Lightning's callbacks that touch parameters during fit, and the hooks in which they do."""

# Every hook of a callback that may run while the model is sharded. setup runs before the engine exists and
# teardown after it is gone; on_exception is left alone (a failed rank takes part in no collective).
_HOOKS = tuple(
    name
    for name in dir(Callback)
    if name.startswith("on_") and name != "on_exception" and callable(getattr(Callback, name))
)


def resolve_gathered_callbacks(value: Any) -> tuple[type[Callback], ...]:
    """The callback classes of the ``gathered_callbacks`` argument: None, or a list of Lightning
    ``Callback`` subclasses or their dotted class paths; a ValueError naming the value otherwise."""
    allowed = "None or a list of Lightning Callback classes or their dotted class paths"
    if value is None:
        return ()
    if isinstance(value, (str, type)) or not isinstance(value, Sequence):
        raise ValueError(f"gathered_callbacks must be {allowed}, got {value!r}")
    classes = []
    for item in value:
        cls = import_class(item, "gathered_callbacks") if isinstance(item, str) else item
        if not (isinstance(cls, type) and issubclass(cls, Callback)):
            raise ValueError(f"gathered_callbacks must be {allowed}, got {value!r} (with {item!r})")
        classes.append(cls)
    return tuple(classes)


class GatheredCallbacks:
    """Runs the parameter hooks of a trainer's callbacks inside ``context()`` (see the module docstring).

    Args:
        context: returns the context the hooks run in (the engine's full parameters, or nothing yet).
        extra: callback classes whose every overridden hook is gathered (the strategy's ``gathered_callbacks``).
        run: calls a wrapped hook (``run(call)``): the strategy's guard, which skips it once a live window lost a
            member (its gather would need the lost rank); None: it is called as it is.
    """

    def __init__(
        self,
        context: Callable[[], AbstractContextManager[Any]],
        extra: Sequence[type[Callback]] = (),
        run: Callable[[Callable[[], Any]], Any] | None = None,
    ) -> None:
        self._context = context
        self._run = run or (lambda hook: hook())
        self._extra = tuple(extra)
        self._wrapped: list[tuple[Callback, str, Any]] = []  # (callback, hook, its own instance attribute or None)

    def hooks_of(self, callback: Callback) -> tuple[str, ...]:
        """The hooks of ``callback`` that run gathered."""
        if isinstance(callback, self._extra):
            return tuple(h for h in _HOOKS if getattr(type(callback), h) is not getattr(Callback, h))
        return next((hooks for cls, hooks in GATHERED_HOOKS.items() if isinstance(callback, cls)), ())

    def install(self, callbacks: Sequence[Callback], strategy: str, fitting: bool) -> None:
        """Refuse what cannot work on shards (when ``fitting``), then wrap the hooks of ``callbacks``."""
        if fitting:
            refuse_finetuning(callbacks, strategy)
        self.remove()
        for callback in callbacks:
            for hook in self.hooks_of(callback):
                own = vars(callback).get(hook)  # an instance attribute the user set, to give back at removal
                setattr(callback, hook, self._gathered(getattr(callback, hook)))
                self._wrapped.append((callback, hook, own))

    def _gathered(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(hook)
        def gathered(*args: Any, **kwargs: Any) -> Any:
            def call() -> Any:
                with self._context():
                    return hook(*args, **kwargs)

            return self._run(call)

        return gathered

    def remove(self) -> None:
        """Give the callbacks their own hooks back."""
        for callback, hook, own in reversed(self._wrapped):
            if own is None:
                vars(callback).pop(hook, None)
            else:
                setattr(callback, hook, own)
        self._wrapped = []


def refuse_finetuning(callbacks: Sequence[Callback], strategy: str) -> None:
    """A ``BaseFinetuning`` callback changes the trainable set mid-fit; the shards are laid out once."""
    for callback in callbacks:
        if isinstance(callback, BaseFinetuning):
            raise ValueError(
                f"{strategy} cannot run the callback {type(callback).__name__} (a BaseFinetuning): it unfreezes "
                f"parameters and adds optimizer param groups during fit, while the trainable parameters and the "
                f"optimizer state are sharded once, at setup. Train each phase in a fit of its own instead: set "
                f"requires_grad before trainer.fit (the module holds the trained weights after fit), or use "
                f"strategy='ddp' for this run."
            )
