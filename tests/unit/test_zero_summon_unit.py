"""summon_full_params in one process (a one-rank :class:`LoopbackCommunicator`): what the module holds inside,
what is written back into the master shards, and the stage's state afterwards.

At one rank every master shard is its whole flat parameter, so "this rank's elements" are all of them; the
2-rank behaviour (each rank writes only its own shard) is in ``tests/multiprocess/test_sharded_callbacks.py``.
The masters are first moved by a training step, so they hold fp32 values a bf16 parameter cannot represent:
a write-back of unchanged values through the parameters' dtype would change them, and the bit-identity
checks below would fail.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_sync.sync.communicator import LoopbackCommunicator
from lightning_sync.sync.zero import ZeroEngine, summon_full_params

__all__: list[str] = []

# (model dtype, param_dtype): full precision; bf16 compute on fp32 parameters; a bf16 model on fp32 masters
DTYPES = [(torch.float32, None), (torch.float32, "bf16"), (torch.bfloat16, None)]


class Net(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(5, 7)
        self.frozen = nn.Linear(7, 7).requires_grad_(False)
        self.l2 = nn.Linear(7, 3)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.frozen(self.l1(x))))


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py's


def _trained(stage: int, dtype: torch.dtype, param_dtype: Any, **kw: Any) -> tuple[Net, ZeroEngine]:
    model = Net(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = nn.Linear if stage == 3 else None
    eng = ZeroEngine(
        model, opt, LoopbackCommunicator(1), stage=stage, wrap_policy=policy, param_dtype=param_dtype, **kw
    )
    model(torch.randn(4, 5, dtype=dtype)).pow(2).mean().backward()
    opt.step()
    return model, eng


def _masters(eng: ZeroEngine) -> list[torch.Tensor]:
    return [f.master.detach().clone() for f in eng.flats]


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize(("dtype", "param_dtype"), DTYPES)
def test_reading_inside_leaves_the_masters_bit_identical(stage: int, dtype: torch.dtype, param_dtype: Any) -> None:
    model, eng = _trained(stage, dtype, param_dtype)
    held = _held(eng)
    before = _masters(eng)
    if dtype != torch.float32:  # the masters hold values the parameters' dtype cannot represent
        assert any(not torch.equal(m, m.to(dtype).to(m.dtype)) for m in before)
    frozen_before = Net(dtype).frozen.weight.detach()  # its own data, before the engine made a compute copy
    with summon_full_params(eng):
        for f in eng.flats:  # every parameter whole, in its own dtype, valued as its master
            for p, want in zip(f.params, f.layout.views(f.master.detach())):
                assert p.shape == want.shape and p.dtype == dtype
                assert torch.equal(p, want.to(dtype))
        assert model.frozen.weight.dtype == dtype  # its own data, not param_dtype's compute copy
        assert torch.equal(model.frozen.weight, frozen_before)
        total = sum(float(p.detach().float().sum()) for p in model.parameters())  # what a reading callback does
    assert total == total  # not NaN
    for m, b in zip(_masters(eng), before):
        assert torch.equal(m, b)
    _assert_stage_state(model, eng, stage, held)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize(("dtype", "param_dtype"), DTYPES)
def test_changes_inside_reach_the_masters_and_the_next_forward(
    stage: int, dtype: torch.dtype, param_dtype: Any
) -> None:
    model, eng = _trained(stage, dtype, param_dtype)
    held = _held(eng)
    plain = Net(dtype)
    with summon_full_params(eng):
        plain.load_state_dict(model.state_dict())
        model.l1.weight.data[0].fill_(0.5)  # in place, one row
        model.l2.bias.data = torch.full((3,), -0.25, dtype=dtype)  # .data assigned anew, as torch's pruning does
    plain.l1.weight.data[0].fill_(0.5)
    plain.l2.bias.data.fill_(-0.25)
    _assert_stage_state(model, eng, stage, held)
    for f in eng.flats:  # in the parameters' dtype: untouched fp32 masters keep their extra precision
        for name, view in zip(f.names, f.layout.views(f.master.detach())):
            assert torch.equal(view.to(dtype), plain.get_parameter(name).detach()), name
    x = torch.randn(6, 5, dtype=dtype)
    with torch.no_grad():
        if eng.param_dtype is not None:  # the engine computes in bf16: compare with the same rounding
            plain.to(eng.param_dtype)
            x = x.to(eng.param_dtype)
        assert torch.equal(model(x), plain(x))


def _held(eng: ZeroEngine) -> list[bool]:
    """Stage 3, per flat: gathered or in flight (the step's prefetch of the next forward's first units)."""
    return [f.full is not None or f._gather_work is not None for f in eng.flats]


def _assert_stage_state(model: Net, eng: ZeroEngine, stage: int, held: list[bool]) -> None:
    """Stage 3: every parameter empty again, but those held before (gathered or in flight), which are gathered;
    stages 1/2: every parameter a view of its flat's full buffer, in the compute dtype; frozen parameters back in
    their compute dtype."""
    compute = eng.param_dtype or next(iter(eng.flats)).orig_dtype
    if stage == 3:  # one step ran: its prefetch holds the first units of the next forward
        assert any(held), held
    for f, was_held in zip(eng.flats, held):
        if stage == 3 and not was_held:
            assert f.full is None and all(p.numel() == 0 for p in f.params)
        else:
            assert f.full is not None
            for p, view in zip(f.params, f.layout.views(f.full)):
                assert p.data_ptr() == view.data_ptr() and p.shape == view.shape and p.dtype == compute
    assert model.frozen.weight.dtype == compute


def test_a_unit_gathered_before_is_gathered_after_with_the_new_values() -> None:
    model, eng = _trained(3, torch.float32, "bf16")
    root = eng.root
    assert root is not None
    l1 = next(u for u in eng.units if u.name == "l1")
    eng.reshard()  # the step's prefetch of the next forward's first units: dropped, so only l1 is held below
    eng._gather([l1], wait=l1)  # as inside a step, between this unit's forward and backward
    with summon_full_params(eng):
        model.l1.bias.data.fill_(1.0)
    assert l1.gathered and model.l1.bias.dtype == torch.bfloat16
    assert torch.equal(model.l1.bias, torch.ones(7, dtype=torch.bfloat16))
    assert all(f.full is None for u in eng.units if u is not l1 for f in u.flats)


def test_running_the_forward_inside_is_refused_at_exit() -> None:
    # one unit a group, no prefetch: only the last group is kept into backward, so l1's forward frees it
    model, eng = _trained(3, torch.float32, None, coalesce_mb=0, prefetch=False)
    with pytest.raises(RuntimeError, match=r"parameter 'l1\.weight' has shape \(0,\) at exit.*forward"):
        with summon_full_params(eng):
            model(torch.randn(2, 5))  # stage 3's hooks gather and free each unit under the summoned values
