"""A ZeRO engine's optimizers: which one steps each flat parameter, and their rewrite onto the master shards.

An engine takes one optimizer or several (a GAN's generator and discriminator under Lightning's manual
optimization). Every flat parameter holds the parameters of one group of one optimizer (the units split them so),
and that group steps its fp32 master shard: each optimizer is rewritten in place to step the masters of its own
parameters, and keeps its groups and hyperparameters (LR schedulers keep working). A parameter in two optimizers'
groups is refused; one in none is sharded and never stepped, as a plain optimizer leaves it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_sync.sync.rewritten import check_rewritable
from lightning_sync.sync.zero.flat_param import FlatParam

__all__ = ["as_optimizers", "optimizer_groups", "rewrite_optimizers"]


def as_optimizers(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
) -> list[torch.optim.Optimizer]:
    """The engine's optimizers as a list; refuses one that cannot step shards or that already stepped."""
    optimizers = (
        [] if optimizer is None else [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    )
    for opt in optimizers:
        check_rewritable(opt, "ZeroEngine")
    return optimizers


def optimizer_groups(
    module: nn.Module, optimizers: list[torch.optim.Optimizer], params: list[nn.Parameter]
) -> tuple[dict[int, int], list[tuple[int, int]]]:
    """Parameter id -> global group index (the optimizers' groups numbered one after another; -1: in no optimizer,
    never stepped, as a plain optimizer leaves it), and each global group's (optimizer index, group index in it).
    A parameter in two groups is refused: a flat parameter's master is stepped by one group of one optimizer."""
    if not optimizers:
        return {id(p): -1 for p in params}, []
    known = {id(p) for p in module.parameters()}
    names = {id(p): n for n, p in module.named_parameters()}
    group_of: dict[int, int] = {}
    owners: list[tuple[int, int]] = []
    for oi, optimizer in enumerate(optimizers):
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in known:
                    raise ValueError(
                        "the optimizer holds a parameter that is not in the module; ZeroEngine can "
                        "only shard the module's own parameters"
                    )
                if id(p) in group_of:
                    first = owners[group_of[id(p)]]
                    raise ValueError(
                        f"parameter {names[id(p)]!r} is in optimizer {first[0]} group {first[1]} and in optimizer "
                        f"{oi} group {gi}; each trainable parameter must be in exactly one optimizer's group"
                    )
                group_of[id(p)] = len(owners)
            owners.append((oi, gi))
    return {id(p): group_of.get(id(p), -1) for p in params}, owners


def rewrite_optimizers(
    optimizers: list[torch.optim.Optimizer], owners: list[tuple[int, int]], flats: list[FlatParam]
) -> list[list[list[nn.Parameter]]]:
    """Point every group at its flat parameters' masters (frozen parameters it holds stay) and clear the state.
    Returns each optimizer's parameter lists as the user built them: a full checkpoint numbers its state by them."""
    user_params = [[list(g["params"]) for g in opt.param_groups] for opt in optimizers]
    sharded = {id(p) for f in flats for p in f.params}
    for g, (oi, gi) in enumerate(owners):
        group = optimizers[oi].param_groups[gi]
        kept = [p for p in group["params"] if id(p) not in sharded]
        group["params"] = [f.master for f in flats if f.group == g] + kept
    for opt in optimizers:
        opt.state.clear()
    return user_params
