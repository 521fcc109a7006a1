"""``ShardedGradScaler`` in one process: a peer's overflow, told through a fake communicator, skips this rank's step.

The fake stands for a second rank whose gradient shard holds an inf (its flag is 1) or is finite (0); the
all-reduce MAX is what a real group computes from the two flags. The gloo tests with Lightning fits are in
``tests/multiprocess/test_sharded_amp.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_sync.sync.communicator import LoopbackCommunicator
from lightning_sync.sync.zero import ShardedGradScaler

__all__: list[str] = []


class _Peer(LoopbackCommunicator):
    """One peer rank whose found-inf flag is ``peer_flag``; records what each all-reduce was given."""

    def __init__(self, peer_flag: float) -> None:
        super().__init__(world_size=2, rank=0)
        self.peer_flag = peer_flag
        self.reduced: list[tuple[str, float]] = []

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", group: Any = None, async_op: bool = False) -> Any:
        self.reduced.append((op, float(tensor.max())))
        assert op == "max", op
        tensor.clamp_(min=self.peer_flag)
        return tensor


def _step(scaler: ShardedGradScaler, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scaled SGD step on a parameter whose (already scaled) gradient is ``grad``: (before, after)."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = grad.clone()
    before = p.detach().clone()
    scaler.scale(torch.ones(()))  # creates the scale, as scaling the loss does
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    return before, p.detach().clone()


def test_a_peers_overflow_skips_this_ranks_step_and_halves_its_scale() -> None:
    comm = _Peer(peer_flag=1.0)  # the peer's shard overflowed; this rank's is finite
    scaler = ShardedGradScaler(comm, device="cpu", init_scale=8.0)
    before, after = _step(scaler, torch.full((3,), 8.0))
    assert comm.reduced == [("max", 0.0)]  # this rank found nothing, and said so
    assert torch.equal(after, before)  # a plain GradScaler would have stepped to 0
    assert scaler.get_scale() == 4.0


def test_finite_everywhere_steps_with_the_unscaled_gradient() -> None:
    comm = _Peer(peer_flag=0.0)
    scaler = ShardedGradScaler(comm, device="cpu", init_scale=8.0, growth_interval=1)
    before, after = _step(scaler, torch.full((3,), 8.0))
    assert torch.equal(after, before - 1.0)  # gradient 8 / scale 8, lr 1
    assert scaler.get_scale() == 16.0  # growth_interval=1: grows after one good step
    assert comm.reduced == [("max", 0.0)]


def test_this_ranks_overflow_is_sent_to_the_peers() -> None:
    comm = _Peer(peer_flag=0.0)
    scaler = ShardedGradScaler(comm, device="cpu", init_scale=8.0)
    before, after = _step(scaler, torch.tensor([1.0, float("inf"), 1.0]))
    assert comm.reduced == [("max", 1.0)]
    assert torch.equal(after, before)
    assert scaler.get_scale() == 4.0


def test_an_optimizer_without_gradients_still_takes_part_in_the_all_reduce() -> None:
    """A rank must issue the all-reduce even with nothing to check, or its peers wait in it."""
    comm = _Peer(peer_flag=1.0)
    scaler = ShardedGradScaler(comm, device="cpu", init_scale=8.0)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler.scale(torch.ones(()))  # the scale exists once something was scaled
    scaler.step(opt)
    scaler.update()
    assert comm.reduced == [("max", 0.0)]
    assert scaler.get_scale() == 4.0


@pytest.mark.parametrize("used", [False, True], ids=["fresh", "after-updates"])
def test_like_keeps_the_users_settings_and_state(used: bool) -> None:
    user = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    if used:  # a scale that moved (a resumed run) is kept, not reset to init_scale
        user.scale(torch.ones(()))
        user._scale.fill_(256.0)
        user._growth_tracker.fill_(2)
    sharded = ShardedGradScaler.like(user, _Peer(0.0))
    assert sharded.state_dict() == user.state_dict()
    assert sharded._device == "cpu"


def test_like_keeps_a_disabled_scaler_disabled() -> None:
    sharded = ShardedGradScaler.like(torch.amp.GradScaler("cpu", enabled=False), _Peer(0.0))
    assert not sharded.is_enabled()
