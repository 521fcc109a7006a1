"""Deferred initialization and stage 3's memory bound, in one process.

A model built on the meta device is materialized by the ZeroEngine's build (``sync/zero/materialize.py``). At
world size 1 (a :class:`LoopbackCommunicator`) that is an exact single-rank run, so the materialized model must
equal the eagerly built one bit for bit; at a loopback world size K > 1 every layout (which parameters a rank
keeps, what it allocates) is a real rank's. The same seed at K = 2 over gloo, Lightning's ``configure_model``, and
the bound under a real memory cap: ``tests/multiprocess/test_deferred_init.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F

from lightning_sync import ShardedStrategy
from lightning_sync.sync.communicator import LoopbackCommunicator
from lightning_sync.sync.zero import ZeroEngine, full_state_dict
from lightning_sync.sync.zero.materialize import DeferredInit, has_meta

__all__: list[str] = []

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (tests/conftest.py)

VOCAB, DIM, HIDDEN = 37, 8, 13


class TiedNet(nn.Module):
    """Embedding tied to the output head (registered first in the embedding), a frozen layer, a BatchNorm (running
    statistics: buffers), a root-level parameter and buffer, initialized by the root's reset_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.l1 = nn.Linear(DIM, HIDDEN)
        self.norm = nn.BatchNorm1d(HIDDEN)
        self.l2 = nn.Linear(HIDDEN, DIM)
        self.frozen = nn.Linear(DIM, DIM, bias=False).requires_grad_(False)
        self.head = nn.Linear(DIM, VOCAB)
        self.head.weight = self.emb.weight
        self.scale = nn.Parameter(torch.full((1,), 0.5))
        self.register_buffer("temperature", torch.full((1,), 1.5))

    def reset_parameters(self) -> None:
        nn.init.constant_(self.scale, 0.5)
        self.temperature.fill_(1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = self.l1(h)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        h = self.frozen(self.l2(torch.tanh(h)))
        return self.head(h * self.scale) / self.temperature


def eager(seed: int = 0, cls: type[nn.Module] = TiedNet) -> nn.Module:
    torch.manual_seed(seed)
    return cls()


def deferred(cls: type[nn.Module] = TiedNet) -> nn.Module:
    with torch.device("meta"):
        return cls()


def build(model: nn.Module, seed: int = 0, world: int = 1, rank: int = 0, **kw: Any) -> tuple[Any, ZeroEngine]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    torch.manual_seed(seed)  # the random state the walk starts from
    return opt, ZeroEngine(model, opt, LoopbackCommunicator(world, rank), **kw)


def assert_equal_states(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


# ====================================================================== the same model as eager construction
@pytest.mark.parametrize(("stage", "policy"), [(3, nn.Linear), (3, None), (3, {"min_num_params": 100}), (1, None)])
def test_the_materialized_model_equals_the_eagerly_built_one(stage: int, policy: Any) -> None:
    """Meta construction draws no random numbers and the walk replays each layer's reset_parameters in
    registration order, which is the order its constructor drew them: bit-identical weights and buffers."""
    model = deferred()
    assert has_meta(model)
    opt, eng = build(model, stage=stage, wrap_policy=policy)
    assert not has_meta(model)
    assert_equal_states(full_state_dict(eng), eager().state_dict())
    assert eng.init_peak_bytes is not None
    _, eager_eng = build(eager())
    assert eager_eng.init_peak_bytes is None  # built whole before the engine: nothing measured
    x, y = torch.randint(0, VOCAB, (6, 3)), torch.randint(0, VOCAB, (6, 3))
    eng.gather_root()
    F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    opt.step()  # it trains: the optimizer steps the masters made from the materialized weights
    assert all(f.master.grad is not None for f in eng.flats)


def test_modules_are_initialized_in_registration_order_once_each() -> None:
    calls: list[str] = []

    class Recorded(TiedNet):
        def __init__(self) -> None:
            super().__init__()
            for name, mod in self.named_modules():
                reset = mod.reset_parameters if hasattr(mod, "reset_parameters") else None
                if reset is not None:
                    mod.reset_parameters = lambda name=name, reset=reset: (calls.append(name), reset())[1]

    build(deferred(Recorded), stage=3, wrap_policy=nn.Linear)
    # the frozen layer too; not the BatchNorm's own reset_running_stats: reset_parameters calls it
    assert calls == ["", "emb", "l1", "norm", "l2", "frozen", "head"]


def test_a_tied_weight_gets_storage_once_and_the_first_modules_initialization() -> None:
    model = deferred()
    opt, eng = build(model, stage=3, wrap_policy=nn.Linear)
    assert model.head.weight is model.emb.weight  # still one Parameter object
    state = full_state_dict(eng)
    want = eager().emb.weight  # Embedding's normal_(), not the head's kaiming_uniform_ (drawn into scratch)
    assert torch.equal(state["emb.weight"], want) and torch.equal(state["head.weight"], want)
    names = [n for f in eng.flats for n in f.names]
    assert names.count("emb.weight") == 1 and "head.weight" not in names  # sharded once, under its first name


def test_frozen_parameters_and_buffers_are_replicated_whole_on_every_rank() -> None:
    """At K = 4 each rank keeps a quarter of the trainable values, and the frozen layer and every buffer whole,
    initialized (the BatchNorm's running statistics by its reset_parameters, the root's by its own)."""
    ref = eager()
    for rank in range(4):
        model = deferred()
        opt, eng = build(model, world=4, rank=rank, stage=3, wrap_policy=nn.Linear)
        assert torch.equal(model.frozen.weight, ref.frozen.weight) and not model.frozen.weight.requires_grad
        for name, buf in ref.named_buffers():
            assert torch.equal(model.get_buffer(name), buf), name
        masters = {id(p) for g in opt.param_groups for p in g["params"]}
        assert id(model.frozen.weight) in masters  # stepped as it is (no gradient), not sharded
        assert sum(f.master.numel() for f in eng.flats) == sum(-(-u.numel // 4) for u in eng.units)


def test_a_module_without_reset_parameters_is_named_before_anything_is_allocated() -> None:
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.block = nn.Sequential(nn.Linear(3, 3), Bare())

    model = deferred(Outer)
    with pytest.raises(ValueError, match=r"module 'block\.1' \(Bare\) holds tensors built on the meta device \(w\)"):
        build(model, stage=3)
    assert all(p.is_meta for p in model.parameters())  # refused before the walk: nothing materialized
    with pytest.raises(ValueError, match=r"define reset_parameters\(\)"):
        DeferredInit(model)


def test_a_reset_that_replaces_a_parameter_is_refused() -> None:
    class Replacing(nn.Linear):
        def reset_parameters(self) -> None:
            self.weight = nn.Parameter(torch.zeros_like(self.weight))

    with pytest.raises(ValueError, match=r"reset_parameters\(\) of module '' replaced 'weight'.*in place"):
        build(deferred(lambda: Replacing(3, 3)), stage=3)


def test_eagerly_built_tensors_keep_their_values_beside_meta_ones() -> None:
    """A module owning a meta weight and an eagerly built bias: the bias keeps its value, and the module's reset
    draws the bias's random numbers into scratch, so every later layer still equals eager construction."""
    ref = eager()
    model = deferred()
    model.l2.bias = nn.Parameter(torch.full((DIM,), 0.75))
    opt, eng = build(model, stage=3, wrap_policy=nn.Linear)
    state = full_state_dict(eng)
    assert state["l2.bias"].eq(0.75).all()
    for name in ("l2.weight", "frozen.weight", "head.bias", "emb.weight"):
        assert torch.equal(state[name], ref.state_dict()[name]), name


# ====================================================================== the memory the walk holds
def test_the_walk_holds_the_shards_plus_one_unit_and_the_root() -> None:
    """A 12-layer stack at K = 4: the measured peak is this rank's shards plus at most the largest unit, the root
    unit and the replicated tensors, far below the full model (which eager construction holds whole)."""

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*(nn.Linear(64, 64) for _ in range(12)))
            self.scale = nn.Parameter(torch.ones(64))

        def reset_parameters(self) -> None:
            nn.init.ones_(self.scale)

    model = deferred(Stack)
    full = sum(p.numel() * 4 for p in model.parameters())
    _, eng = build(model, world=4, rank=1, stage=3, wrap_policy=nn.Linear)
    shards = sum(f.master.numel() * 4 for f in eng.flats)
    unit = max(u.numel for u in eng.units if not u.is_root) * 4
    root = eng.root.numel * 4 if eng.root is not None else 0
    assert eng.init_peak_bytes is not None
    assert shards < eng.init_peak_bytes <= shards + unit + root
    assert eng.init_peak_bytes < full / 2


# ====================================================================== the strategy's init context
def test_the_init_context_is_meta_under_stage_3_only() -> None:
    for stage, empty_init, meta in ((3, None, True), (3, True, True), (3, False, False), (1, None, False)):
        strategy = ShardedStrategy(stage=stage)
        strategy.parallel_devices = [torch.device("cpu")]
        with strategy.tensor_init_context(empty_init):
            layer = nn.Linear(2, 2)
        assert layer.weight.is_meta == meta, (stage, empty_init)


def test_model_to_device_moves_what_has_storage_and_leaves_meta_tensors_in_place() -> None:
    """Lightning's ``module.to(device)`` cannot copy a meta tensor; the strategy's move passes over them, and every
    tensor stays registered where it was (tied ones too)."""
    strategy = ShardedStrategy(stage=3)
    strategy.parallel_devices = [torch.device("cpu")]
    model = deferred()
    model.l2.bias = nn.Parameter(torch.zeros(DIM))  # one tensor with storage
    before = [(n, id(t)) for n, t in (*model.named_parameters(), *model.named_buffers())]
    strategy.model = model
    strategy.model_to_device()
    assert [(n, id(t)) for n, t in (*model.named_parameters(), *model.named_buffers())] == before
    assert model.head.weight is model.emb.weight and model.l1.weight.is_meta and not model.l2.bias.is_meta


class _WithMetric(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3)


def test_metric_states_built_on_meta_are_refused_with_the_module_named() -> None:
    """A torchmetrics Metric keeps its states as plain attributes: built on the meta device they have no values
    any walk could restore, and Lightning's move to the device would fail on them ("Cannot copy out of meta
    tensor"). The engine and the strategy's move both refuse them first, naming the metric."""
    model = deferred(_WithMetric)
    message = (
        r"module 'acc' \(MulticlassAccuracy\) keeps tensors built on the meta device .*\(_defaults, fn, fp, tn, tp\)"
    )
    with pytest.raises(ValueError, match=message):
        build(model, stage=3)
    assert all(p.is_meta for p in model.parameters())  # refused before the walk: nothing materialized
    strategy = ShardedStrategy(stage=3)
    strategy.model = model
    with pytest.raises(ValueError, match=r"create metrics in the LightningModule's __init__"):
        strategy.model_to_device()
