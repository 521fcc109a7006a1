"""PeriodicAverager / DiLoCoOuter in one process (LoopbackCommunicator): argument checks, the sync
schedule, what is sent, and checkpoint state."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_sync.sync.communicator import LoopbackCommunicator
from lightning_sync.sync.periodic import DiLoCoOuter, PeriodicAverager


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "8"])
def test_sync_every_below_one_or_not_an_int_is_named(value: Any) -> None:
    p = [nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match=rf"sync_every must be an int >= 1, got {value!r}"):
        PeriodicAverager(p, LoopbackCommunicator(2), value)
    with pytest.raises(ValueError, match=rf"sync_every must be an int >= 1, got {value!r}"):
        DiLoCoOuter(p, LoopbackCommunicator(2), value)


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"outer_lr": 0}, "outer_lr"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"outer_momentum": 0.0}, "nesterov"),
    ],
)
def test_other_bad_arguments_are_named(kw: dict[str, Any], named: str) -> None:
    p = [nn.Parameter(torch.ones(2))]
    cls = PeriodicAverager if "warmup_steps" in kw else DiLoCoOuter
    with pytest.raises(ValueError, match=named):
        cls(p, LoopbackCommunicator(2), 2, **kw)


def test_local_sgd_schedule_with_warmup_and_one_message_per_dtype() -> None:
    comm = LoopbackCommunicator(2)
    params = [
        nn.Parameter(torch.ones(3)),
        nn.Parameter(torch.ones(2, dtype=torch.float64)),
        nn.Parameter(torch.ones(4)),
    ]
    avg = PeriodicAverager(params + [params[0]], comm, sync_every=3, warmup_steps=2)  # a shared tensor once
    flags = []
    for _ in range(8):
        flags.append((avg.in_warmup, avg.step()))
    # steps 1-2 are warm-up (synchronous); then a sync every 3 local steps: after steps 5 and 8
    assert flags == [
        (True, False),
        (True, False),
        (False, False),
        (False, False),
        (False, True),
        (False, False),
        (False, False),
        (False, True),
    ]
    # each sync: one fp32 message (3 + 4 values) and one fp64 message (2 values)
    assert sorted(comm.calls) == sorted([("all_reduce", 7), ("all_reduce", 2)] * 2)
    fresh = PeriodicAverager(params, comm, sync_every=3, warmup_steps=2)
    fresh.load_state_dict(avg.state_dict())
    assert (fresh.steps, fresh.syncs) == (8, 2)


def test_local_sgd_averages_optimizer_state_when_asked() -> None:
    comm = LoopbackCommunicator(2)
    p = nn.Parameter(torch.ones(5))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(5)
    opt.step()
    PeriodicAverager([p], comm, 1, optimizer=opt, average_optimizer_state=True).sync()
    assert comm.calls == [("all_reduce", 10)]  # 5 parameter values + 5 momentum values, one message
    with pytest.raises(ValueError, match="needs the optimizer"):
        PeriodicAverager([p], comm, 1, average_optimizer_state=True)


def test_diloco_state_round_trip_and_mismatch() -> None:
    comm = LoopbackCommunicator(1)
    p = nn.Parameter(torch.zeros(3))
    outer = DiLoCoOuter([p], comm, sync_every=1, outer_lr=0.5, outer_momentum=0.5)
    with torch.no_grad():
        p.add_(1.0)
    assert outer.step()
    # g = w0 - w = -1; Nesterov with a fresh buffer b = g: w = 0 - 0.5 * (g + 0.5 * g) = 0.75
    torch.testing.assert_close(p.detach(), torch.full((3,), 0.75))
    other = DiLoCoOuter([nn.Parameter(torch.zeros(3))], comm, sync_every=1, outer_lr=0.5, outer_momentum=0.5)
    other.load_state_dict(outer.state_dict())
    torch.testing.assert_close(other.global_params[0].detach(), torch.full((3,), 0.75))
    assert other.outer_optimizer.state_dict()["state"][0]["momentum_buffer"].eq(-1.0).all()
    with pytest.raises(ValueError, match="do not match"):
        DiLoCoOuter([nn.Parameter(torch.zeros(4))], comm, 1).load_state_dict(outer.state_dict())
