"""Which parameters a ZeRO engine flattens together: its units.

A unit is what one collective moves. In stage 3 it is a *wrap unit*, a submodule chosen by the wrap
policy (FSDP's ``fully_shard`` granularity) whose parameters are gathered just before it runs and freed
after; in stages 1/2 the full parameters stay resident, so a unit is just a gradient bucket, planned
like DDP's (:func:`~lightning_sync.sync.bucketing.plan_buckets`, reverse registration order) so
reduce-scatters overlap backward. Inside a unit, parameters are split by (optimizer group, dtype) into
:class:`~lightning_sync.sync.zero.flat_param.FlatParam` s, because one flat buffer has one dtype and one
master shard is stepped with one group's hyperparameters.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from lightning_sync.sync.bucketing import plan_buckets
from lightning_sync.sync.zero.flat_param import FlatParam

__all__ = ["Unit", "bucket_units", "consecutive_groups", "trainable_params", "wrap_units"]

UnitPlan = tuple[str, nn.Module | None, list[nn.Parameter], bool]
"""(module name, module or None, its parameters, is the root unit)."""


@dataclass
class Unit:
    """A wrap unit (stage 3) or a gradient bucket (stages 1/2): the flat parameters handled together.
    Its ``index`` is its bucket index in the backward engine."""

    index: int
    name: str
    module: nn.Module | None
    flats: list[FlatParam]
    is_root: bool = False

    @property
    def gathered(self) -> bool:
        return all(f.full is not None for f in self.flats)

    @property
    def numel(self) -> int:
        return sum(f.layout.total for f in self.flats)

    @property
    def gathered_bytes(self) -> int:
        """Bytes of its full parameters when gathered (padded, in the compute dtype)."""
        return sum(f.layout.padded * f.compute_dtype.itemsize for f in self.flats)


def consecutive_groups(order: list[int], size: dict[int, int], cap: int) -> list[list[int]]:
    """``order`` cut into runs of consecutive items whose ``size`` adds up to at most ``cap`` (an item larger
    than ``cap`` is a run of its own; ``cap`` 0: every item alone)."""
    groups: list[list[int]] = []
    total = 0
    for i in order:
        if groups and total + size[i] <= cap:
            groups[-1].append(i)
            total += size[i]
        else:
            groups.append([i])
            total = size[i]
    return groups


def trainable_params(module: nn.Module) -> tuple[list[str], list[nn.Parameter]]:
    """The parameters that require grad, each tied tensor once (under its first name)."""
    names, params, seen = [], [], set()
    for name, p in module.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            names.append(name)
            params.append(p)
    return names, params


def bucket_units(params: list[nn.Parameter], group_of: dict[int, int], cap_bytes: int) -> list[UnitPlan]:
    """Stages 1/2: gradient buckets of at most ``cap_bytes``, one (group, dtype, device) each."""
    if not params:
        return []
    order = list(reversed(range(len(params))))
    sizes = [p.numel() * p.element_size() for p in params]
    keys = [(group_of[id(p)], p.dtype, p.device) for p in params]
    plan = plan_buckets(sizes, keys, order, cap_bytes, cap_bytes)
    return [("", None, [params[i] for i in members], False) for members in plan]


def wrap_units(
    module: nn.Module, params: list[nn.Parameter], policy: Callable[[nn.Module, int], bool] | None
) -> list[UnitPlan]:
    """Stage 3 units: modules chosen by the policy (children before parents claim parameters); a
    parameter registered in several places (tied) belongs to the smallest unit holding all of them;
    whatever is left belongs to the root unit, which comes first."""
    trainable = {id(p) for p in params}
    places: dict[int, list[str]] = {}
    for mname, mod in module.named_modules(remove_duplicate=False):
        for p in mod._parameters.values():
            if p is not None and id(p) in trainable:
                places.setdefault(id(p), []).append(mname)
    claimed: set[int] = set()
    units: list[UnitPlan] = []
    modules = list(module.named_modules())
    if policy is not None:
        for mname, mod in reversed(modules):  # post-order-ish: deeper modules (registered later) first
            if mod is module:
                continue
            mine = [
                p
                for p in mod.parameters()
                if id(p) in trainable
                and id(p) not in claimed
                and all(pl == mname or pl.startswith(mname + ".") for pl in places[id(p)])
            ]
            if mine and policy(mod, sum(p.numel() for p in mine)):
                claimed.update(id(p) for p in mine)
                units.append((mname, mod, mine, False))
        if not units:
            warnings.warn(
                "wrap_policy matched no submodule with trainable parameters; the whole model is "
                "one unit (stage 3 then holds all full parameters during forward and backward)",
                stacklevel=3,
            )
    position = {name: i for i, (name, _) in enumerate(modules)}
    units.sort(key=lambda u: position[u[0]])
    rest = [p for p in params if id(p) not in claimed]
    return [("", module, rest, True), *units]
