"""Full checkpoints of a ZeroEngine in one process (``lightning_sync.sync.zero.full_checkpoint``): the module's
state and the *unsharded* optimizer's ``state_dict()``, and that state loaded back into the shards.

At ``world_size=1`` a :class:`LoopbackCommunicator` engine is an exact single-rank run, so the reference is a
plain copy of the model stepped by a plain torch optimizer: the engine's full optimizer state must have the
plain one's structure (keys, parameter numbers in the user's group order, shapes, hyperparameters) and values,
and a plain state loaded into a fresh engine must continue exactly as the plain optimizer does. The model has
a tied weight, a frozen layer, a 0-d parameter (whose 0-d ``exp_avg`` is per element and 0-d ``step`` is not),
and two param groups that list parameters out of module order. Real ranks, resharding and Lightning files are
in ``tests/multiprocess/test_sharded_full_checkpoint.py``. A layer in no param group is sharded like the others
and, as in the plain optimizer, never stepped nor numbered.
"""

from __future__ import annotations

import copy
import io
import re
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_sync.sync.communicator import LoopbackCommunicator
from lightning_sync.sync.zero import ZeroEngine, load_full_state_dict
from lightning_sync.sync.zero.full_checkpoint import (
    full_model_state,
    full_optimizer_state,
    is_plain_optimizer_state,
    load_full_optimizer_state,
    resolve_state_dict_type,
)

VOCAB, DIM = 11, 6
# One flat parameter stepped by AdamW against per-parameter tensors stepped by the same AdamW: the same
# elementwise float32 operations on the same values, so equal; 1e-6 absolute leaves room for a kernel that
# vectorizes the flat buffer differently (a few ulps), and is far below a misplaced or missing element (~1e-2).
TOL = {"rtol": 0.0, "atol": 1e-6}


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM).requires_grad_(False)
        self.fc = nn.Linear(DIM, DIM)
        self.scale = nn.Parameter(torch.ones(()))  # 0-d
        self.head = nn.Linear(DIM, VOCAB)
        self.head.weight = self.embed.weight  # tied
        self.unlisted = nn.Linear(DIM, DIM)  # trainable, but in no param group: sharded, never stepped

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen(self.embed(ids).mean(1)))
        return self.scale * self.head(h + self.fc(h) + self.unlisted(h))


def _optimizer(net: _Net) -> torch.optim.Optimizer:
    # out of module order, two learning rates, the frozen layer passed too (it never gets state)
    return torch.optim.AdamW(
        [
            {"params": [net.head.bias, net.scale, net.frozen.weight], "lr": 0.02},
            {"params": [net.fc.weight, net.embed.weight, net.fc.bias, net.frozen.bias]},
        ],
        lr=0.01,
        weight_decay=0.1,
    )


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randint(0, VOCAB, (8, 3), generator=g), torch.randint(0, VOCAB, (8,), generator=g)) for _ in range(n)
    ]


def _train(net: nn.Module, opt: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for ids, y in batches:
        opt.zero_grad()
        F.cross_entropy(net(ids), y).backward()
        opt.step()


def _engine(net: _Net, stage: int) -> tuple[torch.optim.Optimizer, ZeroEngine]:
    opt = _optimizer(net)
    # stage 1/2: buckets of ~100 bytes, so the parameters fall into several flat parameters
    kw: dict[str, Any] = {"wrap_policy": ["Linear"]} if stage == 3 else {"bucket_cap_mb": 1e-4}
    return opt, ZeroEngine(net, opt, LoopbackCommunicator(1), stage=stage, **kw)


def _assert_same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["param_groups"] == want["param_groups"], "hyperparameters and parameter numbers"
    assert list(got["state"]) == list(want["state"]), "which parameters have state"
    for index, entry in want["state"].items():
        assert list(got["state"][index]) == list(entry), f"state keys of parameter {index}"
        for key, value in entry.items():
            assert got["state"][index][key].shape == value.shape, f"{index} {key} shape"
            torch.testing.assert_close(got["state"][index][key], value, **TOL, msg=f"{index} {key}")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py's


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_full_state_is_the_unsharded_optimizers_and_loads_back(stage: int) -> None:
    torch.manual_seed(0)
    plain_net = _Net()
    net = copy.deepcopy(plain_net)
    plain_opt = _optimizer(plain_net)
    opt, engine = _engine(net, stage)
    _train(plain_net, plain_opt, _batches(3))
    _train(net, opt, _batches(3))

    model = full_model_state(engine)
    assert list(model) == list(plain_net.state_dict()), "the module's keys, in its order"
    assert model["head.weight"] is model["embed.weight"], "a tied weight is one tensor under both names"
    for key, value in plain_net.state_dict().items():
        torch.testing.assert_close(model[key], value, **TOL, msg=key)
    state = full_optimizer_state(engine)
    assert state is not None and is_plain_optimizer_state(state)
    _assert_same_state(state, plain_opt.state_dict())
    assert state["param_groups"][0]["params"] == [0, 1, 2] and 2 not in state["state"], "frozen: no state"
    steps = [entry["step"] for entry in state["state"].values()]
    assert len({s.data_ptr() for s in steps}) == len(steps), "each parameter's step is its own tensor"
    buffer = io.BytesIO()
    torch.save({"state_dict": model, "optimizer_states": [state]}, buffer)
    buffer.seek(0)
    torch.load(buffer, weights_only=True)  # tensors and plain data only

    # the plain optimizer's state, into a fresh engine of another stage: both continue alike
    resumed = copy.deepcopy(plain_net)
    resumed_opt, resumed_engine = _engine(resumed, 3 if stage < 3 else 1)
    load_full_state_dict(resumed_engine, plain_net.state_dict())
    load_full_optimizer_state(resumed_engine, plain_opt.state_dict())
    assert [g["lr"] for g in resumed_opt.param_groups] == [0.02, 0.01]
    more = _batches(5)[3:]
    _train(plain_net, plain_opt, more)
    _train(resumed, resumed_opt, more)
    resumed_engine.unshard()
    for key, value in plain_net.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, **TOL, msg=f"continued: {key}")


class _Watching(LoopbackCommunicator):
    """Records, at every all-gather, how many buffers gathered before it are still alive."""

    def __init__(self, world_size: int, rank: int) -> None:
        super().__init__(world_size, rank)
        self.alive: list[int] = []
        self._gathered: list[weakref.ref[torch.Tensor]] = []

    def watch(self) -> None:
        """Record from here on (training's own gathers are the engine's to keep)."""
        self.alive, self._gathered = [], []

    def all_gather_into(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.alive.append(sum(ref() is not None for ref in self._gathered))
        self._gathered.append(weakref.ref(output))
        return super().all_gather_into(output, input, *args, **kwargs)


@pytest.mark.parametrize("rank", [0, 1])
def test_saving_gathers_one_flat_parameter_at_a_time_to_rank_0(rank: int) -> None:
    """Every rank takes part in one all-gather per flat parameter (and per-element state), and lets its buffer go
    before the next: no rank holds more than one flat parameter's full tensor. Rank 0 alone keeps the result."""
    torch.manual_seed(0)
    net = _Net()
    opt = _optimizer(net)
    comm = _Watching(2, rank)  # the layout of rank `rank` of 2 (the values are this rank's, repeated)
    engine = ZeroEngine(net, opt, comm, stage=3, wrap_policy=["Linear"])
    _train(net, opt, _batches(1))
    comm.watch()
    model, state = full_model_state(engine), full_optimizer_state(engine)
    flats, stepped = len(engine.flats), sum(f.master in opt.state for f in engine.flats)
    assert stepped >= 3 and len(comm.alive) == flats + 2 * stepped, "the masters, then exp_avg and exp_avg_sq"
    assert comm.alive == [0] * len(comm.alive), comm.alive
    if rank == 0:
        assert list(model) == list(net.state_dict()) and state is not None and len(state["state"]) == 5
    else:
        assert model == {} and state is None


def test_a_plain_state_of_another_optimizer_layout_is_refused() -> None:
    torch.manual_seed(0)
    plain_net = _Net()
    plain_opt = torch.optim.AdamW(plain_net.parameters(), lr=0.01)  # one group
    _train(plain_net, plain_opt, _batches(1))
    _, engine = _engine(copy.deepcopy(plain_net), 1)
    with pytest.raises(ValueError, match="checkpoint has 1 optimizer param groups, this optimizer has 2"):
        load_full_optimizer_state(engine, plain_opt.state_dict())
    saved = _optimizer(plain_net).state_dict()
    saved["param_groups"][1]["params"] = saved["param_groups"][1]["params"][:-1]
    with pytest.raises(ValueError, match="param group 1 has 3 parameters in the checkpoint, 4 in this optimizer"):
        load_full_optimizer_state(engine, saved)


def test_state_dict_type_defaults_by_stage_and_refuses_other_values() -> None:
    assert [resolve_state_dict_type(None, stage) for stage in (1, 2, 3)] == ["full", "full", "sharded"]
    assert resolve_state_dict_type("sharded", 1) == "sharded" and resolve_state_dict_type("full", 3) == "full"
    for bad in ("Full", "dcp", 3):
        with pytest.raises(ValueError, match=r"state_dict_type must be one of \['full', 'sharded', None\], got "):
            resolve_state_dict_type(bad, 3)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["embed.weight", "frozen.bias"])
def test_a_state_dict_of_other_shapes_is_refused_before_anything_loads(key: str) -> None:
    """A tensor of another shape is refused naming its key, as ``nn.Module.load_state_dict`` does, whether it
    would fit the flat buffer (the embedding transposed: as many elements) or broadcast into a replicated
    tensor (the frozen bias as one value); the engine keeps its weights."""
    torch.manual_seed(0)
    net = _Net()
    _, engine = _engine(net, 3)
    before = full_model_state(engine)
    state = {k: v.clone() for k, v in _Net().state_dict().items()}
    here = list(state[key].shape)
    state[key] = state[key].t().contiguous() if state[key].dim() == 2 else state[key][:1]
    wrong = list(state[key].shape)
    with pytest.raises(ValueError, match=re.escape(f"first mismatched key '{key}' (shape {wrong} in it, {here} here)")):
        load_full_state_dict(engine, state)
    for k, value in full_model_state(engine).items():
        assert torch.equal(value, before[k]), f"{k} changed by a refused load"
