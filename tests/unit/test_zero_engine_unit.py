"""ZeroEngine in one process: wrap policies, bad input, padding invisibility, the memory model.

No process group: a :class:`LoopbackCommunicator` stands in for the peers. At ``world_size=1`` it is an
exact single-rank run; at ``world_size=K > 1`` every "rank" holds the same tensors, so gathered *values*
are this rank's shard repeated K times, but every layout (shard sizes, padding, which element of which
parameter lives where) is exactly a real rank's, and that is what these tests check. Training against
real peers is in ``tests/multiprocess/test_zero_engine.py``.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_sync.sync.communicator import LoopbackCommunicator
from lightning_sync.sync.zero import (
    ZeroEngine,
    full_state_dict,
    load_full_state_dict,
    resolve_dtype,
    resolve_wrap_policy,
    zero_memory_bytes,
)

__all__: list[str] = []

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (tests/conftest.py)

VOCAB, DIM, HIDDEN = 37, 8, 13
TRAINABLE = 563  # not divisible by 2, 3 or 4: every flat of the whole model pads at K = 2, 3, 4


class TiedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.l1 = nn.Linear(DIM, HIDDEN)
        self.l2 = nn.Linear(HIDDEN, DIM)
        self.frozen = nn.Linear(DIM, DIM, bias=False).requires_grad_(False)
        self.head = nn.Linear(DIM, VOCAB)
        self.head.weight = self.emb.weight
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = self.frozen(h + self.l2(torch.tanh(self.l1(h))))
        return self.head(h * self.scale)


class Block(nn.Module):
    """Holds both places of a tied weight, so a Block unit (not the root) owns it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.out = nn.Linear(DIM, VOCAB)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(x)))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.extra = nn.Linear(VOCAB, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.extra(self.block(x))


def make(seed: int = 0, cls: type[nn.Module] = TiedNet) -> nn.Module:
    torch.manual_seed(seed)
    return cls()


def engine(
    model: nn.Module | None = None, kind: str = "sgd", world: int = 1, rank: int = 0, **kw: Any
) -> tuple[nn.Module, torch.optim.Optimizer, ZeroEngine]:
    model = model or make()
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if kind == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    )
    return model, opt, ZeroEngine(model, opt, LoopbackCommunicator(world, rank), **kw)


def data(n: int = 3, batch: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, VOCAB, (batch, 3), generator=g), torch.randint(0, VOCAB, (batch, 3), generator=g))
        for _ in range(n)
    ]


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    opt.step()


# ====================================================================== wrap policies
def test_resolve_wrap_policy_forms() -> None:
    lin, emb, net = nn.Linear(2, 2), nn.Embedding(3, 2), TiedNet()
    assert resolve_wrap_policy(None) is None  # the whole model is one unit
    for form in (100, {"min_num_params": 100}):
        fn = resolve_wrap_policy(form)
        assert fn(lin, 100) and not fn(lin, 99) and fn(emb, 1000)  # counts the unclaimed parameters only
    for form in (
        nn.Linear,
        "torch.nn.Linear",
        "Linear",
        ["Linear"],
        [nn.Linear],
        {"module_classes": ["Linear"]},
        {"module_classes": [nn.Linear]},
    ):
        fn = resolve_wrap_policy(form)
        assert fn(lin, 0) and not fn(emb, 10**6) and not fn(net, 10**6), form
    both = resolve_wrap_policy(["Embedding", "torch.nn.Linear"])
    assert both(lin, 0) and both(emb, 0) and not both(net, 0)
    fn = resolve_wrap_policy(lambda m: isinstance(m, nn.Embedding))
    assert fn(emb, 0) and not fn(lin, 10**6)


@pytest.mark.parametrize(
    ("form", "units"),
    [
        (None, [""]),
        (nn.Linear, ["", "l1", "l2", "head"]),  # the tied weight has places in emb and head: the root owns it
        ("torch.nn.Linear", ["", "l1", "l2", "head"]),
        (["Linear", "Embedding"], ["", "l1", "l2", "head"]),  # emb's only parameter is tied: nothing left for it
        ({"min_num_params": 100}, ["", "l1", "l2"]),  # l1 117, l2 112; head's own bias is 37
        (117, ["", "l1"]),
        (lambda m: m.__class__.__name__ == "Linear" and m.out_features == HIDDEN, ["", "l1"]),
    ],
)
def test_stage3_units_per_policy(form: Any, units: list[str]) -> None:
    model, _, eng = engine(stage=3, wrap_policy=form)
    assert [u.name for u in eng.units] == units
    assert eng.units[0].is_root and not any(u.is_root for u in eng.units[1:])
    owned = {u.name: {n for f in u.flats for n in f.names} for u in eng.units}
    assert "emb.weight" in owned[""] and "scale" in owned[""]
    assert sum(u.numel for u in eng.units) == TRAINABLE  # frozen parameters belong to no unit
    assert all("frozen" not in n for names in owned.values() for n in names)


def test_a_tied_weight_goes_to_the_smallest_unit_holding_all_its_places() -> None:
    model, _, eng = engine(make(cls=Outer), stage=3, wrap_policy=["Block", "Linear"])
    owned = {u.name: sorted(n for f in u.flats for n in f.names) for u in eng.units}
    # block.out is a Linear, but its weight also lives in block.emb: only block holds both
    assert owned == {
        "": [],
        "block": ["block.emb.weight"],
        "block.out": ["block.out.bias"],
        "extra": ["extra.bias", "extra.weight"],
    }
    x = torch.randint(0, VOCAB, (4, 2))
    assert model(x).shape == (4, 2, 3)


def test_a_policy_that_matches_nothing_warns_and_wraps_the_whole_model() -> None:
    with pytest.warns(UserWarning, match="wrap_policy matched no submodule"):
        _, _, eng = engine(stage=3, wrap_policy=["Conv2d"])
    assert [(u.name, u.is_root, u.numel) for u in eng.units] == [("", True, TRAINABLE)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a policy that matches something does not warn
        engine(stage=3, wrap_policy=nn.Linear)


# ====================================================================== bad input
@pytest.mark.parametrize("stage", [0, 4, "3", None, -1])
def test_a_stage_outside_1_2_3_lists_the_allowed_ones(stage: Any) -> None:
    with pytest.raises(ValueError, match=rf"stage must be one of \[1, 2, 3\], got {re.escape(repr(stage))}"):
        engine(stage=stage)


@pytest.mark.parametrize("stage", [True, 3.0])
def test_a_bool_or_float_stage_is_refused(stage: Any) -> None:
    with pytest.raises(ValueError, match="stage must be one of"):
        engine(stage=stage)


@pytest.mark.parametrize(
    ("form", "named"),
    [
        (3.5, "3.5"),
        (True, "True"),
        ([], r"\[\]"),
        ([1, 2], r"\[1, 2\]"),
        ({"min_params": 5}, "min_params"),
        ({"min_num_params": 5, "module_classes": ["Linear"]}, "module_classes"),
        (0, "got 0"),
        (-3, "got -3"),
        ("no.such.Module", "no.such.Module"),
        ("torch.nn.functional.relu", "torch.nn.functional.relu"),
    ],
)
def test_an_unknown_wrap_policy_names_the_value(form: Any, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        resolve_wrap_policy(form)
    with pytest.raises(ValueError, match=named):
        engine(stage=3, wrap_policy=form)


@pytest.mark.parametrize("arg", ["param_dtype", "reduce_dtype"])
@pytest.mark.parametrize(
    ("value", "named"), [("int8", "'int8'"), (torch.int32, "torch.int32"), ("fp8", "'fp8'"), (16.0, "16.0")]
)
def test_a_bad_dtype_names_the_value(arg: str, value: Any, named: str) -> None:
    with pytest.raises(ValueError, match=rf"{arg} must be None, a floating torch.dtype or one of .*got {named}"):
        engine(stage=2, **{arg: value})


def test_dtype_names_resolve() -> None:
    assert resolve_dtype("bf16", "x") is torch.bfloat16 and resolve_dtype("FP16", "x") is torch.float16
    assert resolve_dtype(torch.float64, "x") is torch.float64 and resolve_dtype(None, "x") is None


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (0, "got 0"),
        (-1, "got -1"),
        (math.inf, "got inf"),
        (math.nan, "got nan"),
        ("25", "got '25'"),
        (True, "got True"),
    ],
)
def test_a_bad_bucket_cap_names_the_value(value: Any, named: str) -> None:
    with pytest.raises(ValueError, match=rf"bucket_cap_mb must be a finite number > 0 \(MiB\), {named}"):
        engine(stage=2, bucket_cap_mb=value)


def test_an_optimizer_that_already_stepped_is_refused() -> None:
    model = make()
    opt = torch.optim.AdamW(model.parameters())
    step(model, opt, *data(1)[0])
    with pytest.raises(ValueError, match="already has state"):
        ZeroEngine(model, opt, LoopbackCommunicator(1), stage=2)


# ====================================================================== padding is invisible
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_padding_is_invisible_and_stays_zero(stage: int, world: int) -> None:
    shapes = {n: p.shape for n, p in make().named_parameters()}
    last = world - 1  # the padding sits at the end of the last rank's shard
    model, opt, eng = engine(
        kind="adamw", world=world, rank=last, stage=stage, wrap_policy=None
    )  # one flat of all 563: it pads at K = 2, 3 and 4
    (flat,) = eng.flats
    assert flat.layout.total == TRAINABLE and flat.layout.padding == -TRAINABLE % world > 0
    assert flat.master.numel() == math.ceil(TRAINABLE / world) and flat.master.dtype == torch.float32
    assert [g["params"][0] for g in opt.param_groups] == [flat.master]  # the optimizer steps the shard
    seen: dict[str, torch.Size] = {}
    hook = model.l2.register_forward_pre_hook(
        lambda mod, args: seen.update({n: p.shape for n, p in model.named_parameters()})
    )
    pad = flat.layout.padding
    for x, y in data(2):
        step(model, opt, x, y)
        assert flat.master.grad[-pad:].eq(0).all()  # padding gradients are zero ...
        assert flat.master.detach()[-pad:].eq(0).all()  # ... so AdamW (with weight decay) keeps padding at 0
    hook.remove()
    assert seen == shapes  # inside forward every parameter has its own shape, padding excluded
    assert {k: v.shape for k, v in full_state_dict(eng).items()} == {k: v.shape for k, v in make().state_dict().items()}
    if stage < 3:  # stages 1/2: the module's parameters are views of the full buffer, which ends in padding
        views = {p.data_ptr() for p in model.parameters() if p.requires_grad}
        assert len(views) == 7 and all(p.shape == shapes[n] for n, p in model.named_parameters())
        end = max(p.data_ptr() + p.numel() * 4 for p in model.parameters() if p.requires_grad)
        assert end == flat.full.data_ptr() + TRAINABLE * 4  # no parameter reaches into the padding
    else:  # stage 3 frees the full parameters after backward; unshard() gathers them for good
        assert all(p.numel() == 0 for p in model.parameters() if p.requires_grad)
        eng.unshard()
        assert {n: p.shape for n, p in model.named_parameters()} == shapes


def test_the_padded_shard_sizes_add_up_across_ranks() -> None:
    for world in (2, 3, 4):
        sizes = [engine(world=world, rank=r, stage=3, wrap_policy=nn.Linear)[2] for r in range(world)]
        for ui in range(4):
            per_rank = [sum(f.master.numel() for f in eng.units[ui].flats) for eng in sizes]
            numel = sizes[0].units[ui].numel
            assert per_rank == [math.ceil(numel / world)] * world  # equal shards, padding included


# ====================================================================== world 1 equals plain training
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize(("stage", "policy"), [(1, None), (2, None), (3, nn.Linear), (3, None)])
def test_one_rank_trains_exactly_like_plain_torch(kind: str, stage: int, policy: Any) -> None:
    # At K = 1 the reduce-scatter is an identity and the fp32 masters hold the parameters' own values;
    # the optimizers are elementwise, so the flat shard steps exactly like the separate tensors: bit equal.
    ref_model = make()
    ref_opt = (
        torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
        if kind == "sgd"
        else torch.optim.AdamW(ref_model.parameters(), lr=0.01, weight_decay=0.1)
    )
    model, opt, eng = engine(kind=kind, stage=stage, wrap_policy=policy)
    for x, y in data():
        step(ref_model, ref_opt, x, y)
        step(model, opt, x, y)
    got, want = full_state_dict(eng), ref_model.state_dict()
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_no_sync_issues_no_collective_until_the_boundary() -> None:
    model, opt, eng = engine(stage=2, bucket_cap_mb=0.001)
    comm = eng.comm
    (x, y), (x2, y2) = data(2)
    comm.calls.clear()
    with eng.no_sync():
        F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    assert comm.calls == []
    F.cross_entropy(model(x2).reshape(-1, VOCAB), y2.reshape(-1)).backward()
    # the boundary: each bucket's reduce-scatter (one flat a call), then which parameters got no gradient (one
    # count each)
    assert comm.calls == [("reduce_scatter_into_coalesced", f.layout.padded) for f in eng.flats] + [
        ("all_reduce", len(eng.names))
    ]
    assert len(eng.flats) >= 3


# ====================================================================== the memory model
def test_zero_memory_bytes_formulas() -> None:
    psi = 1000
    # fp32 AdamW: p = g = 4, K = 8: baseline 16 psi; (p+g) psi + K psi/N; p psi + (g+K) psi/N; 16 psi/N
    assert [zero_memory_bytes(psi, 4, s, 8, 4, 4) for s in (0, 1, 2, 3)] == [16000, 10000, 7000, 4000]
    # SGD with momentum: K = 4
    assert [zero_memory_bytes(psi, 2, s, 4, 4, 4) for s in (0, 1, 2, 3)] == [12000, 10000, 8000, 6000]
    # mixed-precision Adam (the defaults: p = g = 2, K = 12): 16 psi, 4 psi + 12 psi/N, 2 psi + 14 psi/N, 16 psi/N
    assert [zero_memory_bytes(psi, 8, s) for s in (0, 1, 2, 3)] == [16000, 5500, 3750, 2000]
    assert {zero_memory_bytes(psi, 1, s, 8, 4, 4) for s in (0, 1, 2, 3)} == {16000}  # one rank: no saving
    for bad in ({"num_params": -1, "world_size": 2}, {"num_params": 10, "world_size": 0}):
        with pytest.raises(ValueError, match="need world_size >= 1 and num_params >= 0"):
            zero_memory_bytes(stage=1, **bad)
    with pytest.raises(ValueError, match=r"stage must be one of \[0, 1, 2, 3\].*got 5"):
        zero_memory_bytes(10, 2, 5)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_bytes_at_one_rank_equal_the_plain_models(stage: int) -> None:
    """At K = 1 every stage holds what plain training holds (params, grads, AdamW state), with one
    AdamW ``step`` scalar per flat instead of one per parameter."""
    ref_model = make()
    ref_opt = torch.optim.AdamW(ref_model.parameters())
    model, opt, eng = engine(kind="adamw", stage=stage, wrap_policy=nn.Linear if stage == 3 else None)
    (x, y), (x2, y2) = data(2)
    for m, o in ((ref_model, ref_opt), (model, opt)):
        step(m, o, x, y)
        o.zero_grad()
        F.cross_entropy(m(x2).reshape(-1, VOCAB), y2.reshape(-1)).backward()
    frozen = DIM * DIM * 4
    mem = eng.memory_bytes()
    assert mem["grads"] == TRAINABLE * 4
    assert mem["optimizer"] == 2 * TRAINABLE * 4 + 4 * len(eng.flats)  # exp_avg, exp_avg_sq, fp32 step
    # stages 1/2 hold the full parameters (the master shard is their buffer); stage 3 freed them after
    # backward and holds the fp32 master shard
    assert mem["params"] == TRAINABLE * 4 + frozen
    plain = (
        sum(p.numel() * 4 for p in ref_model.parameters())
        + sum(p.grad.numel() * 4 for p in ref_model.parameters() if p.grad is not None)
        + sum(v.numel() * v.element_size() for s in ref_opt.state.values() for v in s.values())
    )
    assert sum(mem.values()) == plain - 4 * (7 - len(eng.flats))  # 7 trainable parameters' step scalars


# ====================================================================== stage 3's schedule frees what it gathered
def _saved_unit_bytes(model: nn.Module, eng: ZeroEngine, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes of full unit buffers (storages of a wrapped unit's padded size) that autograd's saved tensors keep
    alive after forward, before backward; not counting the last group in forward order, kept gathered on purpose
    (its backward comes first)."""
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = model(x)
    freed = [u for u in eng.units if not u.is_root and not eng._kept_into_backward(u)]
    unit_bytes = {f.layout.padded * f.compute_dtype.itemsize for u in freed for f in u.flats}
    alive = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(n for n in alive.values() if n in unit_bytes), out


def test_forward_keeps_no_gathered_unit_alive_until_backward() -> None:
    """A Linear saves its weight's transpose for backward: a unit freed after its forward must not live on through
    it (its storage is emptied, and refilled by the gather before backward), and backward must still compute the
    right gradients."""
    ref_model = make()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    model, opt, eng = engine(stage=3, wrap_policy=nn.Linear, coalesce_mb=0)  # every unit its own group
    for i, (x, y) in enumerate(data()):
        opt.zero_grad()
        eng.gather_root()
        kept, out = _saved_unit_bytes(model, eng, x)
        assert kept == 0, f"step {i}: {kept} bytes of gathered units kept alive by autograd"
        F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1)).backward()
        opt.step()
        step(ref_model, ref_opt, x, y)
    got, want = full_state_dict(eng), ref_model.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k  # one rank: exactly plain training


def test_the_last_groups_stay_gathered_into_backward_and_only_with_grad() -> None:
    """Once the first backward recorded the forward order, the last group in it (one unit a group here), and with
    prefetch the one before it, are not freed after a training forward, since their backward comes next (the last
    one's prefetches the other's); every other unit is, and an evaluation forward (no grad, no backward coming)
    frees every unit."""
    for prefetch, kept in ((True, 2), (False, 1)):
        model, opt, eng = engine(stage=3, wrap_policy=nn.Linear, coalesce_mb=0, prefetch=prefetch)
        (x, y), (x2, _) = data(2)
        F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        opt.step()
        last = [u for u in eng.units if eng._kept_into_backward(u)]
        assert sorted(u.index for u in last) == sorted(eng._forward_order[-kept:]), (eng._groups, eng._forward_order)
        out = model(x2)
        assert [u.name for u in eng.units if not u.is_root and u.gathered] == [u.name for u in last]
        out.sum().backward()
        with torch.no_grad():
            model(x2)
        assert not [u.name for u in eng.units if not u.is_root and u.gathered]


def _held(eng: ZeroEngine) -> list[str]:
    """Units gathered or with an all-gather in flight."""
    return [u.name for u in eng.units if any(f.full is not None or f._gather_work is not None for f in u.flats)]


@pytest.mark.parametrize(
    ("kw", "held"),
    [
        ({"coalesce_mb": 0}, ["", "l1", "l2"]),  # the root, the first unit and the one its forward prefetches
        ({}, ["", "l1", "l2", "head"]),  # the three small units are one group
        ({"coalesce_mb": 0, "prefetch": False}, []),
    ],
)
def test_a_step_issues_the_next_forwards_first_gathers(kw: dict[str, Any], held: list[str]) -> None:
    """Once the forward order is known, the optimizer step issues the all-gathers the next forward's first unit
    would (so they run between the steps); before that, or without prefetch, nothing is held after a step."""
    model, opt, eng = engine(stage=3, wrap_policy=nn.Linear, **kw)
    (x, y), (x2, y2) = data(2)
    F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    assert _held(eng) == []  # backward freed every unit
    opt.step()
    assert _held(eng) == held
    step(model, opt, x2, y2)
    assert _held(eng) == held


def test_several_optimizers_prefetch_nothing_across_steps() -> None:
    """A second optimizer's step would update masters whose all-gather the first one's step had issued."""
    model = make()
    head = [p for n, p in model.named_parameters() if n.startswith("l2")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("l2") and p.requires_grad]
    opts = [torch.optim.SGD(rest, lr=0.05), torch.optim.SGD(head, lr=0.05)]
    eng = ZeroEngine(model, opts, LoopbackCommunicator(1, 0), stage=3, wrap_policy=nn.Linear, coalesce_mb=0)
    (x, y), _ = data(2)
    F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    for opt in opts:
        opt.step()
        assert _held(eng) == []


def test_a_load_after_a_step_drops_the_prefetched_parameters() -> None:
    """The step's prefetch gathered the stepped values; a state dict loaded after it must be what the next forward
    computes with."""
    model, opt, eng = engine(stage=3, wrap_policy=nn.Linear)
    (x, y), (x2, _) = data(2)
    F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    opt.step()
    assert _held(eng)
    other = make(seed=5)
    load_full_state_dict(eng, other.state_dict())
    with torch.no_grad():
        assert torch.equal(model(x2), other(x2))


@pytest.mark.parametrize(("stage", "kw"), [(3, {"wrap_policy": nn.Linear}), (2, {"bucket_cap_mb": 0.0005})])
def test_one_reduce_scatter_in_flight_in_stages_2_and_3(stage: int, kw: dict[str, Any]) -> None:
    """The previous unit's reduce-scatter is finished (its full gradient freed) before the next is issued."""
    model, opt, eng = engine(stage=stage, **kw)
    in_flight: list[int] = []
    launch = eng._launch

    def counting(bucket: int) -> None:
        in_flight.append(sum(f._reduce is not None for f in eng.flats))
        launch(bucket)

    eng._launch = counting  # type: ignore[method-assign]
    (x, y), *_ = data(1)
    eng.gather_root()
    F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    assert len(in_flight) >= 3 and max(in_flight) <= 1, in_flight
    assert all(f._reduce is None and f.master.grad is not None for f in eng.flats)
