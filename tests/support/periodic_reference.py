"""One process that trains what a live ``local_sgd`` / ``diloco`` run of :mod:`support.ft_trainer` commits.

The live guarantee for the periodic strategies: a period is committed whole, by the members that finished it, and
a period that lost a member is trained again from its start by the survivors, on the same global batches. So the
run equals replicas trained on the shares of the membership that committed each period. :func:`simulate` trains
exactly that in one process, in plain torch: one replica (module, SGD with momentum, step LR schedule) per member,
each micro-batch's global-order entries shared strided over the period's members, a share's loss weighted so the
members' mean is the micro-batch's, and at each period's end the replicas averaged (``local_sgd``) or DiLoCo's
outer Nesterov step. A replacement starts from rank 0's replica, optimizer and schedule, as its heal gives it.

``members`` is what a member recorded: for each global step, the members that committed it; ``final``, the members
at the fit's end, who commit the steps of a period the fit ended inside.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.nn import functional as F

from lightning_sync.models.digits import DigitsDataModule
from lightning_sync.sampler import global_order
from support import ft_trainer

NOMINAL = 3  # the job's full size: the global order and each micro-batch's entries are made for it


def period_end(strategy: str, step: int, sync_every: int, warmup: int) -> int:
    """The last step of the period that ``step`` is in (the one whose vote commits it)."""
    if strategy == "local_sgd" and step < warmup:
        return step  # a warm-up step is a period of its own
    base = warmup if strategy == "local_sgd" else 0
    return base + ((step - base) // sync_every + 1) * sync_every - 1


def simulate(
    strategy: str,
    members: dict[str, list[str]],
    batch: int,
    accumulate: int,
    steps: int,
    sync_every: int,
    warmup: int = 0,
    lr_interval: str = "epoch",
    final: list[str] | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Each member's final replica (every one the synchronized model if the run ended with a sync; a run that
    ends inside a period ends with the replicas apart, its last steps trained by the members that committed them
    at the fit's end, recorded as that period's)."""
    torch.manual_seed(0)  # what the script's seed_everything(0) gives torch before it builds the model
    module = ft_trainer.Model()
    data = DigitsDataModule(batch_size=batch)
    data.setup("fit")
    x, y = data.train_dataset.tensors
    size = len(x)
    total = -(-size // NOMINAL) * NOMINAL  # the sampler pads the order to a multiple of the world size
    micro_steps = -(-(total // NOMINAL) // batch)
    assert micro_steps % accumulate == 0, "the simulation assumes whole windows per epoch"
    steps_per_epoch = micro_steps // accumulate

    def new_replica(source: Any = None) -> Any:
        model = copy.deepcopy(source[0] if source is not None else module)
        config = model.configure_optimizers()
        optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
        if source is not None:
            optimizer.load_state_dict(copy.deepcopy(source[1].state_dict()))
            scheduler.load_state_dict(copy.deepcopy(source[2].state_dict()))
        return model, optimizer, scheduler

    replicas: dict[str, Any] = {}
    global_params = [p.detach().clone() for p in module.parameters()]
    outer = torch.optim.SGD([torch.nn.Parameter(g) for g in global_params], lr=0.7, momentum=0.9, nesterov=True)
    for step in range(steps):
        end = period_end(strategy, step, sync_every, warmup)
        now = members[str(end)] if end < steps else final or members[str(steps - 1)]  # a period the fit ended in
        first = replicas[now[0]] if now[0] in replicas else None
        replicas = {m: replicas.get(m) or new_replica(first) for m in now}  # the lost go, a replacement copies rank 0
        epoch, in_epoch = divmod(step, steps_per_epoch)
        order = global_order(size, epoch, 0, True, total)
        grads: list[list[torch.Tensor]] = []
        for rank, member in enumerate(now):
            model, optimizer, _ = replicas[member]
            optimizer.zero_grad()
            for a in range(accumulate):
                j = in_epoch * accumulate + a
                entries = order[j * batch * NOMINAL : (j + 1) * batch * NOMINAL]
                share = entries[rank :: len(now)]
                weight = len(share) * len(now) / len(entries)
                loss = F.cross_entropy(model(x[share]), y[share]) / accumulate * weight
                loss.backward()
            grads.append([p.grad.detach().clone() for p in model.parameters()])
        if strategy == "local_sgd" and step < warmup:  # synchronous: every replica steps with the mean gradient
            mean = [torch.stack(g).mean(0) for g in zip(*grads)]
            for model, _, _ in replicas.values():
                for p, g in zip(model.parameters(), mean):
                    p.grad.copy_(g)
        for _model, optimizer, scheduler in replicas.values():
            optimizer.step()
            if lr_interval == "step" or (step + 1) % steps_per_epoch == 0:
                scheduler.step()
        if step == end:
            _sync(strategy, [r[0] for r in replicas.values()], outer)
    return {m: {k: v.detach().clone() for k, v in r[0].state_dict().items()} for m, r in replicas.items()}


def _sync(strategy: str, models: list[Any], outer: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        params = [list(m.parameters()) for m in models]
        mean = [torch.stack(ps).mean(0) for ps in zip(*params)]
        if strategy == "diloco":
            global_params = outer.param_groups[0]["params"]
            for g, m in zip(global_params, mean):
                g.grad = g.detach() - m
            outer.step()
            outer.zero_grad(set_to_none=True)
            mean = [g.detach() for g in global_params]
        for ps in params:
            for p, m in zip(ps, mean):
                p.copy_(m)
