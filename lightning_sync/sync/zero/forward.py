"""ZeRO stage 3's forward side: gather a unit just before it runs, prefetch the next, free after.

FSDP's schedule (Zhao et al., "PyTorch FSDP", VLDB 2023): a forward pre-hook on each wrap unit waits
for its all-gather (and issues the next unit's, in the recorded forward order, so communication hides
behind compute); a forward hook frees the unit's full parameters again (``reshard_after_forward``) and
wraps its outputs in :class:`_PreBackward`, whose backward re-gathers the unit (prefetching the unit
whose backward comes next) before autograd needs its parameters. The order units ran in is recorded
in the first step, checked to be the same on every rank after the first backward (the all-gathers are
matched by order), and from then on drives prefetching and the reduce-scatter order.

Two departures from one call per unit, both from DeepSpeed's ZeRO-3: consecutive units whose full parameters
add up to at most the engine's ``coalesce_mb`` form a group, gathered in one call (by its first unit in
forward, its last in backward) and reduce-scattered in one call, so a rank waits once per group; and the last
group in forward order stays gathered after its forward, since its backward comes right after the loss (its
``stage3_max_reuse_distance``; FSDP2 keeps its root the same way), and with prefetch the group before it too,
which the last one's backward would gather again at once (the peak at the start of backward holds both anyway).

With activation checkpointing (:mod:`lightning_sync.sync.zero.recompute`) a checkpointed unit's forward runs
again inside its backward, after its :class:`_PreBackward` gathered it; the units nested in it run their
hooks again there. During such a recomputation a unit's pre-hook only gathers it (no recording of the forward
order, no prefetch) and its forward hook does nothing: the unit stays gathered until its own backward has
its gradients (then it is freed as always), and its outputs, which only feed the recomputation, are not
wrapped again. So activation checkpointing adds no all-gather: a nested unit's second gather happens in the
recomputation instead of in its :class:`_PreBackward`.

This is a mixin of :class:`~lightning_sync.sync.zero.engine.ZeroEngine`, kept apart so the engine
module reads as build / backward / step; it uses the engine's units, flats and options.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lightning_sync.sync.zero.flat_param import start_gathers
from lightning_sync.sync.zero.units import Unit, consecutive_groups

if TYPE_CHECKING:
    from lightning_sync.sync.communicator import Communicator
    from lightning_sync.sync.zero.recompute import ActivationCheckpointing

__all__ = ["Stage3Forward"]


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's outputs whose backward re-gathers the unit before its own backward runs."""

    @staticmethod
    def forward(ctx: Any, engine: Stage3Forward, unit: Unit, *tensors: torch.Tensor) -> Any:
        ctx.engine, ctx.unit = engine, unit
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.engine._pre_backward(ctx.unit)
        return (None, None, *grads)


class Stage3Forward:
    """Stage 3's gather/prefetch/free hooks around each wrap unit (see the module docstring)."""

    units: list[Unit]
    root: Unit | None
    module: nn.Module
    comm: Communicator
    stage: int
    prefetch: bool
    reshard_after_forward: bool
    param_dtype: torch.dtype | None
    _handles: list[Any]
    _forward_order: list[int] | None
    coalesce_bytes: int
    _groups: list[list[int]]  # consecutive units in forward order, each group gathered (and reduced) in one call
    _group_of: dict[int, int]  # unit index -> its group (units outside the forward order: none)
    _recording: list[int]
    _order_checked: bool
    _launch_order: list[int]

    optimizers: list[torch.optim.Optimizer]
    _ac: ActivationCheckpointing | None
    _is_complete: Callable[[int], bool]  # BackwardEngine's: has this unit's backward finished?

    def _recomputing(self) -> bool:
        return self._ac is not None and self._ac.recomputing

    def _install_forward_hooks(self) -> None:
        """Gather before each unit's forward; free after (and re-gather for backward) unless it is the root."""
        for unit in self.units:
            if unit.module is None:
                continue
            self._handles.append(
                unit.module.register_forward_pre_hook(
                    functools.partial(self._pre_forward, unit), prepend=True, with_kwargs=True
                )
            )
            if not unit.is_root:
                self._handles.append(unit.module.register_forward_hook(functools.partial(self._post_forward, unit)))

    def _default_launch_order(self) -> list[int]:
        if self.stage < 3:
            return [u.index for u in self.units]
        forward = self._forward_order or [u.index for u in self.units if not u.is_root]
        return list(reversed(forward)) + ([self.root.index] if self.root is not None else [])

    # ------------------------------------------------------------------ stage 3: forward
    def _gather(self, units: Sequence[Unit], wait: Unit | None = None) -> None:
        """Issue the all-gathers of those of ``units`` not gathered or in flight, in one call (see :meth:`_group`);
        then wait for ``wait``'s."""
        start_gathers([f for u in units for f in u.flats], self.comm)
        if wait is not None:
            for f in wait.flats:
                f.finish_gather()

    def gather_root(self) -> None:
        """Stage 3: gather the root unit (the parameters no wrapped submodule owns). Call before a
        step function that may use them without calling the root module's ``forward``."""
        if self.stage == 3 and self.root is not None:
            self._gather([self.root], wait=self.root)

    def _prefetch_next_step(self) -> None:
        """After an optimizer step, issue the next forward's first all-gathers (the root, the first group and the
        group its forward prefetches: what the first unit's pre-hook would issue), so that they run behind what
        comes between two steps (the loop's hooks, logging, the next batch) instead of in front of the first unit's
        compute. The peak is unchanged: the first unit's forward holds the same. Only with a single optimizer:
        under several, a later one's step would update masters whose gather is already in flight. What writes the
        masters outside a step (a checkpoint load, :func:`~lightning_sync.sync.zero.summon_full_params`) finishes
        or drops a gather in flight first, so no forward reads parameters older than the masters."""
        if not (self.prefetch and self._groups) or len(self.optimizers) != 1:
            return
        first = self._group(self.units[self._groups[0][0]])
        self._gather(([self.root] if self.root is not None else []) + first + self._next_group(first, +1))

    def reshard(self) -> None:
        """Stage 3: free every unit's full parameters (after an evaluation step, for example)."""
        if self.stage == 3:
            for unit in self.units:
                for f in unit.flats:
                    f.finish_gather()
                    f.free()

    def _pre_forward(self, unit: Unit, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if self._recomputing():  # see the module docstring
            self._gather([unit], wait=unit)
            return self._cast_inputs(module, args, kwargs) if self.param_dtype is not None else None
        if not unit.is_root:
            if self._forward_order is None and unit.index not in self._recording:
                self._recording.append(unit.index)
        group = self._group(unit)
        # the first unit of its group gathers the group; the others were gathered with it (or are in flight)
        self._gather(group if group and group[0] is unit else [unit], wait=unit)
        if self.prefetch and group:
            self._gather(self._next_group(group, +1))
        return self._cast_inputs(module, args, kwargs) if self.param_dtype is not None else None

    def _cast_inputs(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        """Floating-point inputs to ``param_dtype`` (the parameters are in it)."""
        cast = functools.partial(_cast_floating, dtype=self.param_dtype)
        return tree_map(cast, args), tree_map(cast, kwargs)

    def _group(self, unit: Unit) -> list[Unit]:
        """The units gathered and reduce-scattered in one call with ``unit``, in forward order (consecutive units
        within the engine's ``coalesce_mb``); empty until the forward order is known, and for the root unit."""
        g = self._group_of.get(unit.index)
        return [] if g is None else [self.units[i] for i in self._groups[g]]

    def _kept_into_backward(self, unit: Unit) -> bool:
        """Whether ``unit``'s group stays gathered from its forward into its backward: the last group in forward
        order, whose backward runs right after the loss, so freeing it would only gather it again (FSDP2 keeps its
        root so, DeepSpeed what it reuses within ``stage3_max_reuse_distance``); with ``prefetch`` the one before it
        too, which the last group's backward prefetches. Either way the peak, at the start of backward, is the
        same: it holds those two groups and every activation, whether they were kept or gathered again."""
        g = self._group_of.get(unit.index)
        return g is not None and g >= len(self._groups) - (2 if self.prefetch else 1)

    def _next_group(self, group: list[Unit], step: int) -> list[Unit]:
        """The group after (``step`` = +1) or before (-1) ``group`` in forward order, less the units whose
        backward has completed (empty when there is none)."""
        g = self._group_of[group[0].index] + step
        if not 0 <= g < len(self._groups):
            return []
        return [self.units[i] for i in self._groups[g] if not self._is_complete(i)]

    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> Any:
        if self._recomputing():
            return None
        if self.reshard_after_forward and not (torch.is_grad_enabled() and self._kept_into_backward(unit)):
            for f in unit.flats:
                f.free()
        if not torch.is_grad_enabled():
            return None
        leaves, spec = tree_flatten(output)
        idx = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return None
        out = _PreBackward.apply(self, unit, *[leaves[i] for i in idx])
        out = out if isinstance(out, tuple) else (out,)
        for i, t in zip(idx, out):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    def _before_recompute(self, module: nn.Module) -> None:
        """Activation checkpointing is about to run a unit's forward again, in backward: it needs its parameters
        (normally gathered already, by the unit's :class:`_PreBackward`)."""
        unit = next((u for u in self.units if u.module is module), None)
        if unit is not None:
            self._gather([unit], wait=unit)

    def _pre_backward(self, unit: Unit) -> None:
        group = self._group(unit)
        # backward meets a group at its last unit (in forward order), which gathers every unit of it
        self._gather(group if group and group[-1] is unit else [unit], wait=unit)
        if self.prefetch and group:
            self._gather(self._next_group(group, -1))

    def _check_forward_order(self) -> None:
        """After the first backward: every rank must have run the units in the same order (the
        all-gathers are matched by order); it becomes the prefetch and reduce-scatter order."""
        self._order_checked = True
        orders = self.comm.all_gather_object(list(self._recording))
        if any(o != orders[0] for o in orders):
            raise RuntimeError(
                f"ZeroEngine: ranks ran the wrap units in different orders {orders}; every rank "
                f"must run the same units in the same order"
            )
        self.adopt_forward_order(list(orders[0]) + [
            u.index for u in self.units if not u.is_root and u.index not in orders[0]
        ])  # fmt: skip

    @property
    def forward_order(self) -> list[int] | None:
        """Stage 3: the units' forward order the ranks agreed on in the first backward (None before it)."""
        return self._forward_order

    def adopt_forward_order(self, order: list[int]) -> None:
        """Take ``order`` (the ranks' :attr:`forward_order`) as this engine's, unchecked: a rank that joins a running
        job takes its peers', which they checked in their first backward and do not check again."""
        self._order_checked = True
        self._forward_order = list(order)
        # cut from the end, so that the last group, which stays gathered into backward, is a full one
        backward = consecutive_groups(
            self._forward_order[::-1], {u.index: u.gathered_bytes for u in self.units}, self.coalesce_bytes
        )
        self._groups = [g[::-1] for g in reversed(backward)]
        self._group_of = {i: g for g, members in enumerate(self._groups) for i in members}
        self._launch_order = self._default_launch_order()


def _cast_floating(x: Any, dtype: torch.dtype) -> Any:
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
