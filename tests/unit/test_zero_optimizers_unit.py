"""ZeroEngine with several optimizers, in one process (a :class:`LoopbackCommunicator` stands in for the peers).

Each optimizer steps the masters of its own parameters' flat parameters. An optimizer whose masters do not
require grad (Lightning's ``toggle_optimizer`` turns the other optimizers' off) takes no gradient and issues no
reduce-scatter, and its parameters are not "unused". The gloo tests with a Lightning GAN are in
``tests/multiprocess/test_sharded_optimizers.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_sync.sync.communicator import LoopbackCommunicator
from lightning_sync.sync.zero import ZeroEngine, full_state_dict

__all__: list[str] = []

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (tests/conftest.py)


class _TwoPart(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        self.second = nn.Sequential(nn.Linear(3, 9), nn.Tanh(), nn.Linear(9, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def _optimizers(model: _TwoPart) -> list[torch.optim.Optimizer]:
    return [
        torch.optim.Adam(model.first.parameters(), lr=0.01),
        torch.optim.SGD(model.second.parameters(), lr=0.05, momentum=0.9),
    ]


def _toggle(optimizers: list[torch.optim.Optimizer], on: torch.optim.Optimizer | None) -> None:
    """What Lightning's ``toggle_optimizer``/``untoggle_optimizer`` do: only ``on``'s parameters require grad."""
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                p.requires_grad_(on is None or opt is on)


def _train(model: _TwoPart, optimizers: list[torch.optim.Optimizer]) -> None:
    """Alternating phases, GAN-style: each optimizer's loss, backward and step with the other one toggled off."""
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(6, 5, generator=g)
        for opt, sign in zip(optimizers, (1.0, -1.0)):
            _toggle(optimizers, opt)
            (sign * model(x).square().mean()).backward()
            opt.step()
            opt.zero_grad()
        _toggle(optimizers, None)


@pytest.mark.parametrize(("stage", "policy"), [(1, None), (2, None), (3, nn.Linear)])
def test_one_rank_with_two_optimizers_trains_exactly_like_plain_torch(stage: int, policy: Any) -> None:
    # At K = 1 the reduce-scatter is an identity and the optimizers are elementwise: bit equal (as for one optimizer)
    ref = _TwoPart()
    _train(ref, _optimizers(ref))
    model = _TwoPart()
    optimizers = _optimizers(model)
    engine = ZeroEngine(model, optimizers, LoopbackCommunicator(), stage=stage, wrap_policy=policy, bucket_cap_mb=1e-4)
    _train(model, optimizers)
    got, want = full_state_dict(engine), ref.state_dict()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert want["first.0.weight"].ne(_TwoPart().state_dict()["first.0.weight"]).any()  # it trained
    for opt in optimizers:  # each optimizer steps exactly the masters of its own flat parameters
        stepped = [id(p) for g in opt.param_groups for p in g["params"]]
        assert stepped == [id(f.master) for f in engine.flats_of(opt)]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_toggled_off_optimizer_takes_no_reduce_scatter_and_is_not_unused(stage: int) -> None:
    model = _TwoPart()
    optimizers = _optimizers(model)
    comm = LoopbackCommunicator(world_size=2)
    policy = nn.Linear if stage == 3 else None
    engine = ZeroEngine(model, optimizers, comm, stage=stage, wrap_policy=policy, bucket_cap_mb=1e-4)
    on = engine.flats_of(optimizers[1])
    assert on and len(on) < len(engine.flats)
    _toggle(optimizers, optimizers[1])
    comm.calls.clear()
    x = torch.randn(4, 5)
    model(x).square().mean().backward()  # the first part gets gradients too, and drops them
    # a unit's flats go in one call, so the elements reduced add up to exactly those of the toggled-on flats
    reduced = sum(n for op, n in comm.calls if op == "reduce_scatter_into_coalesced")
    assert reduced == sum(f.layout.padded for f in on)
    assert all(f.master.grad is None for f in engine.flats_of(optimizers[0]))
    assert all(f.master.grad is not None for f in on)
    assert all(f.grad_full is None for f in engine.flats_of(optimizers[0])) or stage == 1


def test_a_parameter_in_two_optimizers_is_refused_naming_it() -> None:
    model = _TwoPart()
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.second.parameters(), lr=0.1)]
    with pytest.raises(ValueError, match=r"'second\.0\.weight' is in optimizer 0 group 0 and in optimizer 1 group 0"):
        ZeroEngine(model, optimizers, LoopbackCommunicator(), stage=2)


def test_engine_optimizer_names_the_alternatives_with_several() -> None:
    model = _TwoPart()
    engine = ZeroEngine(model, _optimizers(model), LoopbackCommunicator(), stage=2)
    with pytest.raises(AttributeError, match=r"2 optimizers: use engine\.optimizers or engine\.optimizer_of"):
        _ = engine.optimizer


@pytest.mark.parametrize(("stage", "policy"), [(1, None), (2, None), (3, nn.Linear)])
def test_two_synchronized_backwards_before_a_step_add_up(stage: int, policy: Any) -> None:
    """Accumulation under manual optimization: every backward reduce-scatters (Lightning blocks the sync only in
    automatic optimization) and the masters' gradients add up until the step, as ``.grad`` does."""
    ref, model = _TwoPart(), _TwoPart()
    ref_opts, optimizers = _optimizers(ref), _optimizers(model)
    engine = ZeroEngine(model, optimizers, LoopbackCommunicator(), stage=stage, wrap_policy=policy, bucket_cap_mb=1e-4)
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        x1, x2 = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
        for net, opts in ((ref, ref_opts), (model, optimizers)):
            net(x1).square().mean().backward()
            net(x2).mean().backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
    got, want = full_state_dict(engine), ref.state_dict()
    for key in want:
        assert torch.equal(got[key], want[key]), key
