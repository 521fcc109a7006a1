"""Full checkpoints of a ZeroEngine whose parameters live on CUDA (skipped where CUDA is absent).

What only a GPU shows: the gathered module and optimizer state land on CPU (rank 0 accumulates there, not in
GPU memory), and a loaded state goes where torch's ``Optimizer.load_state_dict`` would put it (per-element
state on the parameter's device, a non-fused ``step`` on the CPU), so the engine continues as a plain CUDA
optimizer does. One process: a :class:`LoopbackCommunicator` of one rank stands in for the group.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_sync.sync.communicator import LoopbackCommunicator
from lightning_sync.sync.zero import ZeroEngine, load_full_state_dict
from lightning_sync.sync.zero.full_checkpoint import full_model_state, full_optimizer_state, load_full_optimizer_state

pytestmark = pytest.mark.gpu

# The engine's AdamW steps one flat CUDA tensor per flat parameter, the plain one a tensor per parameter: the
# same elementwise float32 formulas, but CUDA's multi-tensor kernels may round a few ulps apart (~1e-7 on values
# ~1); 4 steps of lr 1e-2 keep that below 1e-6, and a misplaced or missing state element moves weights by ~1e-3.
TOL = {"rtol": 0.0, "atol": 1e-5}


def _train(net: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int, device: torch.device) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(6, 8, generator=g).to(device)
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()


def _round_trip(device: torch.device) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5)).to(device)
    net = copy.deepcopy(plain)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    engine = ZeroEngine(net, opt, LoopbackCommunicator(1), stage=3, wrap_policy=["Linear"])
    _train(plain, plain_opt, 2, 1, device)
    _train(net, opt, 2, 1, device)

    model, state = full_model_state(engine), full_optimizer_state(engine)
    assert state is not None
    assert {t.device.type for t in model.values()} == {"cpu"}, "rank 0 accumulates on CPU"
    assert {v.device.type for entry in state["state"].values() for v in entry.values()} == {"cpu"}
    for index, entry in plain_opt.state_dict()["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(state["state"][index][key], value.cpu(), **TOL, msg=f"{index} {key}")

    resumed = copy.deepcopy(plain)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=0.01)
    resumed_engine = ZeroEngine(resumed, resumed_opt, LoopbackCommunicator(1), stage=1)
    load_full_state_dict(resumed_engine, model)
    load_full_optimizer_state(resumed_engine, state)
    for own in resumed_opt.state.values():
        assert own["exp_avg"].device == resumed_engine.flats[0].device and own["step"].device.type == "cpu"
    _train(plain, plain_opt, 2, 2, device)
    _train(resumed, resumed_opt, 2, 2, device)
    for (name, got), want in zip(resumed.named_parameters(), plain.parameters()):
        torch.testing.assert_close(got, want, **TOL, msg=name)


@pytest.mark.timeout(120)
def test_a_full_checkpoint_of_cuda_shards_is_gathered_to_cpu_and_resumes_on_cuda() -> None:
    _round_trip(torch.device("cuda", 0))
