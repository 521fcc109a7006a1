"""ZeRO offload and activation checkpointing in one process (a :class:`LoopbackCommunicator` of one rank): exact
equivalence with the run without them at every stage, the activation memory checkpointing saves, what its
patched ``forward`` does to the module (deep copies, removal), and the argument checks. The 2-rank runs are in
``tests/multiprocess/test_zero_offload_recompute.py``.
"""

from __future__ import annotations

import copy
import ctypes
from typing import Any

import pytest
import torch
from support.block_net import Block, batches, make_net, reference, sharded_steps, state
from torch import nn
from torch.nn import functional as F

from lightning_sync import ShardedStrategy
from lightning_sync.sync.communicator import LoopbackCommunicator
from lightning_sync.sync.zero import ZeroEngine, full_state_dict

__all__: list[str] = []

pytestmark = [pytest.mark.usefixtures("one_thread")]

# One process against plain training of the same model: the engine's "reduce-scatter" of one rank is a copy,
# so only the order in which gradient contributions are summed can differ (~1e-7 relative); 3 AdamW steps of lr
# 0.01 keep that below 1e-6, while a lost or stale gradient moves weights by ~1e-2.
TOL = {"rtol": 0.0, "atol": 1e-5}
EXACT = {"rtol": 0.0, "atol": 0.0}
CASES = [(1, [Block]), (2, [Block]), (3, [Block]), (3, [Block, nn.Linear])]


def _train(stage: int, policy: Any, **kw: Any) -> dict[str, torch.Tensor]:
    model = make_net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    engine = ZeroEngine(model, opt, LoopbackCommunicator(1), stage=stage, wrap_policy=policy, **kw)
    sharded_steps(engine, model, opt, batches(6), 0, 1, accum=2, clip=0.5)
    return full_state_dict(engine)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, tol: dict[str, float]) -> None:
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **tol, msg=lambda m, k=k: f"{what}: {k}: {m}")


@pytest.mark.parametrize(("stage", "policy"), CASES)
def test_one_process_offload_and_checkpointing_change_nothing(stage: int, policy: Any) -> None:
    model = make_net(0)
    init = state(model)
    reference(model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1), batches(6), 1, 2, 0.5)
    want = state(model)
    assert max((want[k] - init[k]).abs().max().item() for k in want) > 1e-2
    plain = _train(stage, policy)
    _assert_same(plain, want, f"stage {stage} vs plain training", TOL)
    for kw in (
        {"offload": True},
        {"activation_checkpointing": True},
        {"offload": True, "activation_checkpointing": True},
    ):
        _assert_same(_train(stage, policy, **kw), plain, f"stage {stage} {kw}", EXACT)


class _MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks".split()]
    _fields_ += [(n, ctypes.c_size_t) for n in ("fordblks", "keepcost")]


def _allocated() -> int:
    """Bytes allocated through malloc now (torch's CPU tensors are): small blocks plus mmapped ones."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpointing_holds_a_fraction_of_the_activations(stage: int) -> None:
    """Bytes held when forward ends (what backward will read) and the most held during backward (sampled as each
    parameter's gradient arrives), above the level before forward, with and without checkpointing the 4 blocks.
    Each block of 64 x 32 tokens keeps ~7 MiB of activations (LayerNorm, two Linears, GELU, dropout at widths
    64 and 256); checkpointed it keeps its 0.5 MiB input, and backward rebuilds one block's at a time.
    Measured: 28.1 MiB -> 2.1 MiB after forward, 28.7 MiB -> 9.1 MiB at the peak of backward."""
    held = {}
    for ac in (False, True):
        model = make_net(0, vocab=50, dim=64, hidden=256, depth=4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = ZeroEngine(
            model, opt, LoopbackCommunicator(1), stage=stage, wrap_policy=[Block], activation_checkpointing=ac
        )
        g = torch.Generator().manual_seed(0)
        x, y = torch.randint(0, 50, (64, 32), generator=g), torch.randint(0, 50, (64,), generator=g)
        samples: list[int] = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p, samples=samples: samples.append(_allocated()))
        for _ in range(2):  # the second step: the optimizer state and every buffer exist already
            samples.clear()
            base = _allocated()
            loss = F.cross_entropy(model(x), y)
            after_forward = _allocated() - base
            loss.backward()
            opt.step()
            opt.zero_grad()
        held[ac] = (after_forward, max(samples) - base)
        engine.close()
    (plain_fwd, plain_peak), (ac_fwd, ac_peak) = held[False], held[True]
    assert plain_fwd > 20 * 2**20, held  # the activations are what is measured
    assert ac_fwd < 0.2 * plain_fwd and ac_peak < 0.5 * plain_peak, held


def test_checkpointed_module_keeps_its_names_copies_and_gets_its_forward_back() -> None:
    model = make_net(0, dropout=0.0)
    keys = list(model.state_dict())
    engine = ZeroEngine(
        model, None, LoopbackCommunicator(1), stage=2, wrap_policy=[Block], activation_checkpointing=True
    )
    assert list(model.state_dict()) == keys and all("forward" in b.__dict__ for b in model.blocks)
    ids = batches(1)[0][0]
    twin = copy.deepcopy(model)  # its forward is bound to the copy, not to the original
    torch.testing.assert_close(twin(ids), model(ids), rtol=0, atol=0)
    with torch.no_grad():
        twin.blocks[0].fc1.weight.add_(1.0)
    assert not torch.equal(twin(ids), model(ids))
    with pytest.raises(ValueError, match="already checkpointed"):
        ZeroEngine(model, None, LoopbackCommunicator(1), stage=1, wrap_policy=[Block], activation_checkpointing=True)
    engine.close()
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.filterwarnings("ignore:wrap_policy matched no submodule")  # stage 3's units: then the error
@pytest.mark.parametrize("stage", [1, 3])
def test_checkpointing_needs_a_policy_that_selects_modules(stage: int) -> None:
    for policy in (None, ["Conv2d"]):
        with pytest.raises(ValueError, match="activation_checkpointing=True .* wrap_policy"):
            ZeroEngine(
                make_net(0),
                None,
                LoopbackCommunicator(1),
                stage=stage,
                wrap_policy=policy,
                activation_checkpointing=True,
            )
    with pytest.raises(ValueError, match=r"wrap_policy=None"):
        ShardedStrategy(stage=stage, activation_checkpointing=True)


@pytest.mark.parametrize("name", ["offload", "activation_checkpointing"])
@pytest.mark.parametrize("value", [1, "true", None])
def test_engine_offload_and_checkpointing_take_booleans(name: str, value: Any) -> None:
    """(ShardedStrategy's own checks are in test_strategy_validation.py's table.)"""
    with pytest.raises(ValueError, match=rf"{name} must be True or False, got {value!r}"):
        ZeroEngine(make_net(0), None, LoopbackCommunicator(1), stage=3, wrap_policy=[Block], **{name: value})
