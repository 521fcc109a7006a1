"""ZeroEngine and parameters that get no gradient, in one process (a :class:`LoopbackCommunicator`).

torch's DDP (``find_unused_parameters=False``) and our ``BucketedDDPStrategy`` raise when a trainable
parameter got no gradient; the ZeRO engine does the same by default, naming the parameters, once every
reduce-scatter of the step has completed (so no peer is left waiting in one). ``find_unused_parameters=True``
opts in to zero gradients for them. Across real ranks the decision is one all-reduce of a per-parameter
count, so every rank raises together (``tests/multiprocess/test_sharded_callbacks.py``).
"""

from __future__ import annotations

import pytest
import torch
from test_sync_bucketing import TwoHeads  # a trunk and two heads: forward(x, head) leaves the other without a gradient
from torch import nn

from lightning_sync.sync.communicator import LoopbackCommunicator
from lightning_sync.sync.zero import ZeroEngine

__all__: list[str] = []


def _engine(stage: int, world: int = 2, **kw: object) -> tuple[TwoHeads, torch.optim.Optimizer, ZeroEngine]:
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = nn.Linear if stage == 3 else None
    return model, opt, ZeroEngine(model, opt, LoopbackCommunicator(world), stage=stage, wrap_policy=policy, **kw)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_parameter_without_gradient_raises_naming_it(stage: int) -> None:
    model, opt, eng = _engine(stage)
    x = torch.randn(5, 8)
    with pytest.raises(RuntimeError, match=r"head_b\.weight") as info:
        model(x, "a").pow(2).mean().backward()
    message = str(info.value)
    assert message.startswith("It looks like your LightningModule has parameters that were not used")
    assert "head_b.bias" in message and "trunk" not in message and "head_a" not in message
    assert "find_unused_parameters=True" in message
    # every reduce-scatter was issued and completed: a peer is never left in one
    assert all(f._reduce is None for f in eng.flats)
    assert all(f.master.grad is not None for f in eng.flats)
    # the next step, using both heads, trains normally
    opt.zero_grad()
    (model(x, "a") + model(x, "b")).pow(2).mean().backward()
    opt.step()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_find_unused_parameters_zero_fills_them(stage: int) -> None:
    model, opt, eng = _engine(stage, world=1, find_unused_parameters=True)
    ref = TwoHeads()
    x = torch.randn(5, 8)
    model(x, "a").pow(2).mean().backward()
    ref(x, "a").pow(2).mean().backward()
    # one rank: each master's gradient is its flat parameter's whole gradient
    grads = {name: view for f in eng.flats for name, view in zip(f.names, f.layout.views(f.master.grad))}
    for name, p in ref.named_parameters():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        assert torch.equal(grads[name], want), name


def test_used_in_an_earlier_micro_step_of_the_window_is_not_unused() -> None:
    model, opt, eng = _engine(2)
    x = torch.randn(5, 8)
    with eng.no_sync():
        model(x, "b").pow(2).mean().backward()
    model(x, "a").pow(2).mean().backward()  # head_b got its gradient in this accumulation window: no error
    opt.step()


def test_the_check_is_one_all_reduce_per_synchronized_backward() -> None:
    model, opt, eng = _engine(2, world=1)
    comm = eng.comm
    x = torch.randn(5, 8)
    comm.calls.clear()
    (model(x, "a") + model(x, "b")).pow(2).mean().backward()
    assert [c for c in comm.calls if c[0] == "all_reduce"] == [("all_reduce", 6)]  # one count per parameter
    comm.calls.clear()
    with eng.no_sync():
        (model(x, "a") + model(x, "b")).pow(2).mean().backward()
    assert comm.calls == []  # accumulation micro-steps communicate nothing
    _, _, opted = _engine(2, world=1, find_unused_parameters=True)
    opted.comm.calls.clear()
    (opted.module(x, "a") + opted.module(x, "b")).pow(2).mean().backward()
    assert not [c for c in opted.comm.calls if c[0] == "all_reduce"]  # opted in: no check, no all-reduce


def test_find_unused_parameters_must_be_a_bool() -> None:
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"find_unused_parameters must be True or False, got 'yes'"):
        ZeroEngine(model, opt, LoopbackCommunicator(1), stage=2, find_unused_parameters="yes")
