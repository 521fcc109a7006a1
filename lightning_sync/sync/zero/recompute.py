"""Activation checkpointing per wrap unit: keep a unit's inputs, recompute its activations in backward.

Chen et al., "Training Deep Nets with Sublinear Memory Cost" (2016), as torch's non-reentrant
:func:`torch.utils.checkpoint.checkpoint` does it (``use_reentrant=False``): a checkpointed module's forward
saves only its inputs; when backward first needs one of its activations the forward is run again, with the
random-number state it had the first time (so dropout draws the same masks) and the saved tensors it produces
are handed to autograd. Activation memory falls from every unit's activations to the units' inputs plus one
unit's activations at a time; each step pays one more forward of the checkpointed units.

Which modules: those the engine's wrap policy selects (stage 3: every wrap unit but the root; stages 1/2, which
have no wrap units, the modules the same policy would wrap). The module is not replaced: its ``forward`` is
shadowed by an instance attribute that runs the original under the checkpoint, so the module tree, names and
state-dict keys are unchanged, and the module's own hooks (stage 3's gather before the forward, free and
re-gather wrapper after it) run once, around the checkpointed call, never during the recomputation.

Stage 3 needs to know when a recomputation runs (:attr:`ActivationCheckpointing.recomputing`), because a
recomputed unit may contain other wrap units, whose hooks *do* run again inside it: they must gather their
parameters but not record the forward order, prefetch, free the parameters after their forward or wrap their
outputs for backward a second time (:mod:`lightning_sync.sync.zero.forward`). ``before_recompute`` lets the
engine gather the checkpointed unit's own parameters first; stage 3's re-gather for backward has normally done
so already, which makes it free.
"""

from __future__ import annotations

import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_sync.sync.zero.units import UnitPlan, wrap_units

__all__ = ["ActivationCheckpointing", "checkpointed_modules"]

_STATE = "_lightning_sync_recompute"  # on a checkpointed module: (weak ref to its controller, its own forward)


class ActivationCheckpointing:
    """Checkpoint the forward of each of ``modules`` until :meth:`remove` (see the module docstring).

    Args:
        modules: the modules whose forward is checkpointed (nested ones are allowed).
        before_recompute: called with a module just before its forward is recomputed.
    """

    def __init__(self, modules: list[nn.Module], before_recompute: Callable[[nn.Module], None] | None = None) -> None:
        self.modules = list(modules)
        self._before = before_recompute
        self._depth = 0  # recomputations running (a nested unit's inside its parent's)
        for module in self.modules:
            if _STATE in module.__dict__:
                raise ValueError(f"{type(module).__name__} is already checkpointed by another engine")
            module.__dict__[_STATE] = (weakref.ref(self), module.__dict__.get("forward"))
            # a method bound to the module: a deep copy of the module rebinds it to the copy
            module.forward = types.MethodType(_checkpointed_forward, module)

    @property
    def recomputing(self) -> bool:
        """A checkpointed forward is being recomputed (inside backward) right now."""
        return self._depth > 0

    def contexts(self, module: nn.Module) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        """The (forward, recomputation) contexts of ``module``'s checkpoint (its ``context_fn``)."""
        return nullcontext(), self._recomputation(module)

    @contextmanager
    def _recomputation(self, module: nn.Module) -> Iterator[None]:
        if self._before is not None:
            self._before(module)
        self._depth += 1
        try:
            yield
        finally:  # also when the checkpoint stops the recomputation early, by raising inside it
            self._depth -= 1

    def remove(self) -> None:
        """Give every module its own forward back."""
        for module in self.modules:
            _, own = module.__dict__.pop(_STATE, (None, None))
            if own is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own
        self.modules = []


def checkpointed_modules(
    module: nn.Module, params: list[nn.Parameter], units: list[UnitPlan], policy: Any, stage: int
) -> list[nn.Module]:
    """The modules activation checkpointing wraps: stage 3's wrap units (``units``) but the root; in stages 1/2,
    whose units are gradient buckets, the modules ``policy`` would make units of. ``ValueError`` for none."""
    if stage < 3:
        with warnings.catch_warnings():  # its warning is about stage 3's units; this function raises instead
            warnings.simplefilter("ignore")
            units = wrap_units(module, params, policy)
    modules = [m for _, m, _, is_root in units if not is_root and m is not None]
    if not modules:
        raise ValueError(
            "activation_checkpointing=True checkpoints the modules the wrap_policy selects, and it selects no "
            "submodule with trainable parameters; give a wrap_policy (e.g. the model's block class)"
        )
    return modules


def _checkpointed_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    ref, own = module.__dict__[_STATE]
    forward = own if own is not None else types.MethodType(type(module).forward, module)
    controller = ref()
    if controller is None or not torch.is_grad_enabled():  # no backward will need its activations
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=lambda: controller.contexts(module), **kwargs)
