"""One-process unit tests of lightning_sync.sync.bucketing: the bucket plan and GradBucketer.

Everything runs on :class:`~lightning_sync.sync.communicator.LoopbackCommunicator`: ``world_size``
identical "ranks" that are all this process, so ``avg`` leaves a tensor unchanged and ``sum``
multiplies it by ``world_size``. A bucketed gradient must therefore equal the plain single-process
gradient *bit for bit*: the bucketer only moves values (copies, views, in-place accumulation in the
same order autograd would use) and the loopback ``avg`` does no arithmetic, so every comparison here
is ``torch.equal`` (tolerance 0). Compression, which does change values, is in test_compression.py.
"""

from __future__ import annotations

import copy
import random
import time
from typing import Any

import pytest
import torch
from torch import nn

from lightning_sync.sync import GradBucketer, LoopbackCommunicator, plan_buckets

__all__: list[str] = []

_MB = 2**20


# --------------------------------------------------------------------------- helpers


class RecordingLoopback(LoopbackCommunicator):
    """A loopback communicator that also records which tensor each all_reduce received."""

    def __init__(self, world_size: int = 1) -> None:
        super().__init__(world_size)
        self.reduced: list[tuple[int, torch.dtype, str]] = []  # (storage data_ptr, dtype, op)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", group: Any = None, async_op: bool = False) -> Any:
        self.reduced.append((tensor.untyped_storage().data_ptr(), tensor.dtype, op))
        return super().all_reduce(tensor, op=op, group=group, async_op=async_op)


def _mlp(seed: int = 0, width: int = 16, depth: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def _batch(seed: int, width: int = 16, rows: int = 8) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _caps(model: nn.Module, per_bucket_params: int) -> dict[str, float]:
    """Caps (MiB) so that roughly ``per_bucket_params`` fp32 values fill a bucket: several buckets."""
    return {"bucket_cap_mb": per_bucket_params * 4 / _MB, "first_bucket_mb": per_bucket_params * 4 / _MB}


def _reduce_calls(comm: LoopbackCommunicator) -> list[tuple[str, int]]:
    return [c for c in comm.calls if c[0] == "all_reduce"]


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _bucket_of(bucketer: GradBucketer, i: int):
    return next(b for b in bucketer.buckets if i in b.members)


class Chain(nn.Module):
    """Three linears registered l1, l2, l3 but applied l2 -> l1 -> l3, of distinct sizes.

    Backward therefore makes l3's gradients ready first, then l1's, then l2's: not the reverse of
    registration order (l3, l2, l1) that the initial plan assumes. With ``_CHAIN_CAP`` every layer
    (weight + bias) fills exactly one bucket: numels 49 (l3), 25 (l2), 36 (l1) in the initial plan.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.l1 = nn.Linear(5, 6)  # 36 values
        self.l2 = nn.Linear(4, 5)  # 25 values
        self.l3 = nn.Linear(6, 7)  # 49 values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.tanh(self.l1(torch.tanh(self.l2(x)))))


_CHAIN_CAP = 100 / _MB  # 100 bytes: a layer's bias alone (<= 28 bytes) is below it, bias + weight above


def _chain_input(seed: int = 0) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))


def _record_ready_order(model: nn.Module) -> tuple[list[str], list[Any]]:
    """Names of parameters in the order their gradients became ready (our own post-accumulate hooks)."""
    order: list[str] = []
    handles = [
        p.register_post_accumulate_grad_hook(lambda _p, n=n: order.append(n)) for n, p in model.named_parameters()
    ]
    return order, handles


# --------------------------------------------------------------------------- plan_buckets


def test_plan_walks_the_given_order_and_first_bucket_uses_the_first_limit() -> None:
    sizes, keys = [10] * 7, ["k"] * 7
    plan = plan_buckets(sizes, keys, reversed(range(7)), cap_bytes=30, first_cap_bytes=10)
    assert plan == [[6], [5, 4, 3], [2, 1, 0]]
    # the first limit applies to the first bucket only, a larger first limit too
    assert plan_buckets(sizes, keys, range(7), cap_bytes=20, first_cap_bytes=40) == [[0, 1, 2, 3], [4, 5], [6]]


def test_plan_parameter_larger_than_cap_gets_its_own_bucket() -> None:
    # 100 bytes > cap 50: it closes a bucket on its own when it opens one (the bucket before it closed)
    sizes, keys = [10, 100, 40, 10], ["k"] * 4
    plan = plan_buckets(sizes, keys, [0, 2, 1, 3], cap_bytes=50, first_cap_bytes=50)
    assert plan == [[0, 2], [1], [3]]


def test_plan_parameter_larger_than_cap_joins_the_open_bucket_and_closes_it() -> None:
    # documented (as torch DDP): a parameter is never split; one reaching the limit on its own joins the open
    # bucket of its key and closes it, so that bucket goes past the cap
    plan = plan_buckets([10, 100, 5], ["k"] * 3, [0, 1, 2], cap_bytes=50, first_cap_bytes=50)
    assert plan == [[0, 1], [2]]


def test_plan_keeps_one_open_bucket_per_dtype_device_key() -> None:
    f32, f64 = (torch.float32, torch.device("cpu")), (torch.float64, torch.device("cpu"))
    keys = [f32, f64, f32, f64, f32, f64]
    plan = plan_buckets([10] * 6, keys, range(6), cap_bytes=20, first_cap_bytes=20)
    assert plan == [[0, 2], [1, 3], [4], [5]]
    for bucket in plan:
        assert len({keys[i] for i in bucket}) == 1


@pytest.mark.parametrize("cap, first", [(0, 10), (10, 0), (-5, 10), (10, -7)])
def test_plan_rejects_caps_that_are_not_positive(cap: int, first: int) -> None:
    bad = cap if cap <= 0 else first
    with pytest.raises(ValueError, match=rf"{bad}\b"):
        plan_buckets([1, 2], ["k", "k"], [1, 0], cap_bytes=cap, first_cap_bytes=first)


@pytest.mark.parametrize("seed", range(5))
def test_plan_places_every_index_exactly_once_and_closes_greedily(seed: int) -> None:
    rng = random.Random(seed)
    n = 60
    sizes = [rng.choice([4, 16, 64, 400, 4000]) for _ in range(n)]
    keys = [rng.choice(["a", "b", "c"]) for _ in range(n)]
    order = list(range(n))
    rng.shuffle(order)
    cap, first = 1000, 200
    plan = plan_buckets(sizes, keys, order, cap, first)
    flat = sorted(i for b in plan for i in b)
    assert flat == list(range(n))
    position = {i: k for k, i in enumerate(order)}
    closed_so_far = 0
    for b in plan:
        assert len({keys[i] for i in b}) == 1, "a bucket mixes (dtype, device) keys"
        assert [position[i] for i in b] == sorted(position[i] for i in b), "a bucket breaks the walk order"
    # greedy: a bucket that reached its limit did so only with its last member
    for b in plan:
        limit = first if closed_so_far == 0 else cap
        total = sum(sizes[i] for i in b)
        if total >= limit:
            assert total - sizes[b[-1]] < limit
            closed_so_far += 1


# --------------------------------------------------------------------------- construction


def test_bucketer_plans_in_reverse_registration_order() -> None:
    model = _mlp()
    b = GradBucketer(model.named_parameters(), LoopbackCommunicator(), **_caps(model, 200))
    assert len(b.buckets) > 2
    flat = [i for bucket in b.buckets for i in bucket.members]
    assert flat == list(reversed(range(len(b.params))))
    assert b.names == [n for n, _ in model.named_parameters()]
    for bucket in b.buckets:
        assert bucket.buffer.numel() == sum(b.params[i].numel() for i in bucket.members)
    b.close()


def test_bucketer_skips_frozen_parameters() -> None:
    model = _mlp(depth=3)
    model[0].weight.requires_grad_(False)
    model[2].bias.requires_grad_(False)
    b = GradBucketer(model.named_parameters(), LoopbackCommunicator(), **_caps(model, 200))
    assert "0.weight" not in b.names and "2.bias" not in b.names
    assert len(b.params) == 4
    assert sum(bk.buffer.numel() for bk in b.buckets) == sum(p.numel() for p in b.params)
    b.prepare_for_backward()
    _loss(model, _batch(0)).backward()
    assert model[0].weight.grad is None and model[2].bias.grad is None
    b.close()


class Tied(nn.Module):
    """The same Parameter registered twice (as ``a.weight`` and ``b.weight``) and used twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("remove_duplicate", [True, False])
def test_bucketer_counts_a_tied_parameter_once_and_matches_plain_gradients(remove_duplicate: bool) -> None:
    model, ref = Tied(), Tied()
    named = list(model.named_parameters(remove_duplicate=remove_duplicate))
    assert len(named) == (3 if remove_duplicate else 4)
    comm = LoopbackCommunicator(world_size=2)
    b = GradBucketer(named, comm, bucket_cap_mb=64 * 4 / _MB, first_bucket_mb=64 * 4 / _MB)
    assert len(b.params) == 3
    assert len({id(p) for p in b.params}) == 3
    assert sum(bk.buffer.numel() for bk in b.buckets) == 64 + 8 + 8
    x = _batch(0, width=8)
    b.prepare_for_backward()
    _loss(model, x).backward()
    _loss(ref, x).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), name  # exact: loopback avg does no arithmetic
    assert len(_reduce_calls(comm)) == len(b.buckets)
    b.close()


@pytest.mark.parametrize("value", [0, -1, 0.0, float("nan"), float("inf"), "25", None, True])
@pytest.mark.parametrize("arg", ["bucket_cap_mb", "first_bucket_mb"])
def test_bucketer_rejects_bad_bucket_sizes(arg: str, value: Any) -> None:
    model = _mlp(depth=1)
    with pytest.raises(ValueError, match=arg) as info:
        GradBucketer(model.named_parameters(), LoopbackCommunicator(), **{arg: value})
    assert repr(value) in str(info.value)


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("world_size", [1, 4])
@pytest.mark.parametrize("as_view", [True, False])
def test_gradients_equal_plain_single_process_gradients(as_view: bool, world_size: int) -> None:
    model, ref = _mlp(), _mlp()
    comm = LoopbackCommunicator(world_size=world_size)
    b = GradBucketer(model.named_parameters(), comm, gradient_as_bucket_view=as_view, **_caps(model, 200))
    for step in range(3):  # step 0 on the initial plan, then on the rebuilt one
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        b.prepare_for_backward()
        x = _batch(step)
        _loss(model, x).backward()
        _loss(ref, x).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            # exact (tolerance 0): values are only copied, and the loopback 'avg' leaves them unchanged
            assert torch.equal(p.grad, q.grad), (step, name)
    b.close()


def test_gradient_as_bucket_view_makes_each_grad_a_view_into_its_bucket() -> None:
    model = _mlp()
    b = GradBucketer(
        model.named_parameters(), LoopbackCommunicator(), gradient_as_bucket_view=True, **_caps(model, 200)
    )
    _loss(model, _batch(0)).backward()  # no prepare_for_backward: autograd's own grads get re-pointed too
    for i, p in enumerate(b.params):
        bucket = _bucket_of(b, i)
        assert _same_storage(p.grad, bucket.buffer), b.names[i]
        pos = bucket.members.index(i)
        assert p.grad.data_ptr() == bucket.views[pos].data_ptr()
        assert p.grad.shape == p.shape
    b.close()


def test_without_bucket_view_grads_have_their_own_storage() -> None:
    model = _mlp()
    b = GradBucketer(
        model.named_parameters(), LoopbackCommunicator(), gradient_as_bucket_view=False, **_caps(model, 200)
    )
    for step in range(2):
        b.prepare_for_backward()
        _loss(model, _batch(step)).backward()
        for i, p in enumerate(b.params):
            assert p.grad is not None
            assert not _same_storage(p.grad, _bucket_of(b, i).buffer), b.names[i]
    b.close()


def test_prepare_for_backward_points_none_grads_at_zeroed_views_and_backward_accumulates_in_place() -> None:
    model, ref = _mlp(), _mlp()
    b = GradBucketer(model.named_parameters(), LoopbackCommunicator(), **_caps(model, 200))
    b.prepare_for_backward()
    _loss(model, _batch(0)).backward()
    model.zero_grad(set_to_none=True)
    b.prepare_for_backward()  # also the one-time rebuild
    for i, p in enumerate(b.params):
        bucket = _bucket_of(b, i)
        assert p.grad is not None and _same_storage(p.grad, bucket.buffer)
        assert p.grad.data_ptr() == bucket.views[bucket.members.index(i)].data_ptr()
        assert not p.grad.any()
    before = {id(p): p.grad for p in b.params}
    _loss(model, _batch(1)).backward()
    _loss(ref, _batch(1)).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is before[id(p)], name  # still the very view prepare_for_backward installed
        assert torch.equal(p.grad, q.grad), name  # 0 + g, exactly
    # that autograd wrote *into* the view (rather than the hook copying there) is checked, from a hook that
    # runs before the bucketer's, in test_autograd_accumulates_directly_into_the_bucket_view
    b.close()


def test_autograd_accumulates_directly_into_the_bucket_view() -> None:
    """Seen from the first post-accumulate hook on each parameter: the grad autograd produced *is* the view."""
    model = _mlp()
    seen: dict[str, bool] = {}
    views: dict[str, int] = {}
    # registered before the bucketer's hooks, so these run first: nothing could have copied yet
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p, n=n: seen.__setitem__(n, p.grad.data_ptr() == views.get(n)))
        for n, p in model.named_parameters()
    ]
    b = GradBucketer(model.named_parameters(), LoopbackCommunicator(), **_caps(model, 200))
    b.prepare_for_backward()
    for i, name in enumerate(b.names):
        bucket = _bucket_of(b, i)
        views[name] = bucket.views[bucket.members.index(i)].data_ptr()
    _loss(model, _batch(0)).backward()
    assert seen and all(seen.values()), seen
    for h in hooks:
        h.remove()
    b.close()


# --------------------------------------------------------------------------- no_sync / accumulation


@pytest.mark.parametrize("as_view", [True, False])
def test_no_sync_issues_no_collective_then_one_all_reduce_per_bucket(as_view: bool) -> None:
    model, ref = _mlp(), _mlp()
    comm = LoopbackCommunicator(world_size=3)
    b = GradBucketer(model.named_parameters(), comm, gradient_as_bucket_view=as_view, **_caps(model, 200))
    assert len(b.buckets) > 2
    micro = 3
    for k in range(micro - 1):
        with b.no_sync():
            b.prepare_for_backward()
            _loss(model, _batch(k)).backward()
        _loss(ref, _batch(k)).backward()
    assert comm.calls == []
    assert b.step == 0
    b.prepare_for_backward()
    _loss(model, _batch(micro - 1)).backward()
    _loss(ref, _batch(micro - 1)).backward()
    assert comm.calls == [("all_reduce", bucket.buffer.numel()) for bucket in b.buckets]
    assert b.step == 1
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name  # the accumulated sum, exactly (same additions, same order)
    b.close()


class TwoHeads(nn.Module):
    """A trunk and two heads; ``forward(x, head)`` uses one head, leaving the other without a gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.trunk = nn.Linear(8, 8)
        self.head_a = nn.Linear(8, 4)
        self.head_b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, head: str = "a") -> torch.Tensor:
        return getattr(self, f"head_{head}")(torch.tanh(self.trunk(x)))


def _two_heads_caps() -> dict[str, float]:
    return {"bucket_cap_mb": 40 * 4 / _MB, "first_bucket_mb": 40 * 4 / _MB}


@pytest.mark.parametrize("as_view", [True, False])
def test_parameter_used_only_in_an_earlier_micro_step_keeps_its_accumulated_gradient(as_view: bool) -> None:
    model, ref = TwoHeads(), TwoHeads()
    comm = LoopbackCommunicator(world_size=2)
    b = GradBucketer(model.named_parameters(), comm, gradient_as_bucket_view=as_view, **_two_heads_caps())
    x0, x1 = _batch(0, width=8), _batch(1, width=8)
    with b.no_sync():
        b.prepare_for_backward()
        model(x0, "b").pow(2).mean().backward()
    b.prepare_for_backward()
    model(x1, "a").pow(2).mean().backward()  # head_b unused here, but used in this accumulation window
    ref(x0, "b").pow(2).mean().backward()
    ref(x1, "a").pow(2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    b.close()


# --------------------------------------------------------------------------- launch order and overlap


def test_buckets_launch_in_index_order_and_overlap_backward() -> None:
    model = Chain()
    comm = RecordingLoopback()
    b = GradBucketer(model.named_parameters(), comm, bucket_cap_mb=_CHAIN_CAP, first_bucket_mb=_CHAIN_CAP)
    assert [bk.members for bk in b.buckets] == [[5, 4], [3, 2], [1, 0]]  # l3, l2, l1
    # l2 (bucket 1) becomes ready *after* l1 (bucket 2); in-order launch must hold bucket 2 back
    last_ready: list[float] = []
    h = model.l2.weight.register_post_accumulate_grad_hook(lambda _p: last_ready.append(time.perf_counter()))
    b.prepare_for_backward()
    model(_chain_input()).sum().backward()
    h.remove()
    ptr_to_index = {bk.buffer.untyped_storage().data_ptr(): bk.index for bk in b.buckets}
    assert [ptr_to_index[ptr] for ptr, _, _ in comm.reduced] == [0, 1, 2]
    assert [n for _, n in comm.calls] == [49, 25, 36]
    t = b.trace.launched_at
    assert all(x is not None for x in t) and t == sorted(t)
    assert b.trace.launched_during_backward >= 1
    assert t[0] < last_ready[0], "bucket 0 should be issued while backward still had gradients to produce"
    assert b.trace.launched_at[-1] <= b.trace.backward_end <= b.trace.synced_at
    # synced_at >= backward_end (checked above), so the exposed time is exactly their difference
    assert b.trace.exposed_seconds == b.trace.synced_at - b.trace.backward_end
    b.close()


# --------------------------------------------------------------------------- rebuild


def test_rebuild_uses_the_recorded_ready_order_once() -> None:
    model = Chain()
    order, handles = _record_ready_order(model)
    comm = LoopbackCommunicator()
    b = GradBucketer(model.named_parameters(), comm, bucket_cap_mb=_CHAIN_CAP, first_bucket_mb=_CHAIN_CAP)
    initial = [bk.members for bk in b.buckets]
    b.prepare_for_backward()
    model(_chain_input(0)).sum().backward()
    first_order = list(order)
    assert [n.split(".")[0] for n in first_order[::2]] == ["l3", "l1", "l2"]  # not reverse registration order
    for step in range(1, 4):
        model.zero_grad(set_to_none=True)
        b.prepare_for_backward()
        model(_chain_input(step)).sum().backward()
    rebuilt = [bk.members for bk in b.buckets]
    assert rebuilt != initial
    assert [b.names[i] for bk in rebuilt for i in bk] == first_order
    assert sorted(i for bk in rebuilt for i in bk) == list(range(len(b.params)))
    assert [c for c in comm.calls if c[0] == "broadcast_object"] == [("broadcast_object", 0)]
    # after the rebuild every bucket is complete when its turn comes: launch order == ready order
    assert [n for op, n in comm.calls[-3:]] == [49, 36, 25]
    for h in handles:
        h.remove()
    b.close()


@pytest.mark.parametrize("as_view", [True, False])
def test_rebuild_preserves_gradients_accumulated_so_far(as_view: bool) -> None:
    model, ref = Chain(), Chain()
    comm = LoopbackCommunicator(world_size=2)
    b = GradBucketer(
        model.named_parameters(),
        comm,
        gradient_as_bucket_view=as_view,
        bucket_cap_mb=_CHAIN_CAP,
        first_bucket_mb=_CHAIN_CAP,
    )
    b.prepare_for_backward()
    model(_chain_input(0)).sum().backward()  # step 0: synchronized, records the order
    with b.no_sync():  # a micro-step: accumulates, must not rebuild (no collective inside no_sync)
        b.prepare_for_backward()
        model(_chain_input(1)).sum().backward()
    assert [c for c in comm.calls if c[0] == "broadcast_object"] == []
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    b.prepare_for_backward()  # rebuilds now, mid-accumulation
    assert [c for c in comm.calls if c[0] == "broadcast_object"] == [("broadcast_object", 0)]
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before[n]), n
        if as_view:
            i = b.names.index(n)
            assert _same_storage(p.grad, _bucket_of(b, i).buffer), n
    model(_chain_input(2)).sum().backward()
    for k in range(3):
        ref(_chain_input(k)).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    b.close()


def test_rebuild_after_several_steps_places_every_parameter_once() -> None:
    model = _mlp(depth=2)
    b = GradBucketer(model.named_parameters(), LoopbackCommunicator(), **_caps(model, 200))
    for step in range(2):  # two synchronized steps before anyone asks for the rebuild
        _loss(model, _batch(step)).backward()
    b.rebuild()  # only the first synchronized backward's order counts
    flat = sorted(i for bk in b.buckets for i in bk.members)
    assert flat == list(range(len(b.params)))
    model.zero_grad(set_to_none=True)
    b.prepare_for_backward()
    _loss(model, _batch(2)).backward()  # and the rebuilt buckets still complete
    assert b.step == 3
    b.close()


# --------------------------------------------------------------------------- unused parameters


def test_unused_parameter_raises_after_every_bucket_was_reduced() -> None:
    model = TwoHeads()
    comm = LoopbackCommunicator(world_size=2)
    b = GradBucketer(model.named_parameters(), comm, find_unused_parameters=False, **_two_heads_caps())
    assert len(b.buckets) >= 2
    b.prepare_for_backward()
    with pytest.raises(RuntimeError, match=r"head_b\.weight") as info:
        model(_batch(0, width=8), "a").pow(2).mean().backward()
    assert "head_b.bias" in str(info.value)
    assert "trunk" not in str(info.value) and "head_a" not in str(info.value)
    assert "find_unused_parameters=True" in str(info.value)
    assert comm.calls == [("all_reduce", bk.buffer.numel()) for bk in b.buckets]
    for bk in b.buckets:
        assert bk.work is not None
    assert b.step == 1


@pytest.mark.parametrize("as_view", [True, False])
def test_find_unused_parameters_leaves_globally_unused_grads_none(as_view: bool) -> None:
    model, ref = TwoHeads(), TwoHeads()
    comm = LoopbackCommunicator(world_size=2)
    b = GradBucketer(
        model.named_parameters(),
        comm,
        find_unused_parameters=True,
        gradient_as_bucket_view=as_view,
        **_two_heads_caps(),
    )
    for step in range(2):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        comm.calls.clear()
        b.prepare_for_backward()
        x = _batch(step, width=8)
        model(x, "a").pow(2).mean().backward()  # no error
        ref(x, "a").pow(2).mean().backward()
        assert model.head_b.weight.grad is None and model.head_b.bias.grad is None
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if q.grad is not None:
                assert torch.equal(p.grad, q.grad), name
        reduces = _reduce_calls(comm)
        # one all_reduce per bucket, plus one of the "used" bitmap (one entry per parameter)
        assert reduces == [("all_reduce", bk.buffer.numel()) for bk in b.buckets] + [("all_reduce", 6)]
    b.close()


# --------------------------------------------------------------------------- state and close


def test_state_dict_round_trip() -> None:
    model = _mlp()
    b = GradBucketer(model.named_parameters(), LoopbackCommunicator(), **_caps(model, 200))
    for step in range(3):
        model.zero_grad(set_to_none=True)
        b.prepare_for_backward()
        _loss(model, _batch(step)).backward()
    state = copy.deepcopy(b.state_dict())
    assert state["step"] == 3
    other = GradBucketer(_mlp().named_parameters(), LoopbackCommunicator(), **_caps(model, 200))
    other.load_state_dict(state)
    assert other.step == 3
    assert other.state_dict() == state
    b.close()
    other.close()


def test_state_dict_restores_the_rebuilt_bucket_order() -> None:
    model = Chain()
    b = GradBucketer(
        model.named_parameters(), LoopbackCommunicator(), bucket_cap_mb=_CHAIN_CAP, first_bucket_mb=_CHAIN_CAP
    )
    for step in range(2):
        model.zero_grad(set_to_none=True)
        b.prepare_for_backward()
        model(_chain_input(step)).sum().backward()
    fresh_model = Chain()
    fresh = GradBucketer(
        fresh_model.named_parameters(), LoopbackCommunicator(), bucket_cap_mb=_CHAIN_CAP, first_bucket_mb=_CHAIN_CAP
    )
    fresh.load_state_dict(copy.deepcopy(b.state_dict()))
    fresh.prepare_for_backward()
    assert [bk.members for bk in fresh.buckets] == [bk.members for bk in b.buckets]


def test_state_dict_restored_bucket_order_gives_the_same_gradients_and_one_rebuild() -> None:
    model, ref = Chain(), Chain()
    b = GradBucketer(
        model.named_parameters(), LoopbackCommunicator(), bucket_cap_mb=_CHAIN_CAP, first_bucket_mb=_CHAIN_CAP
    )
    for step in range(2):
        model.zero_grad(set_to_none=True)
        b.prepare_for_backward()
        model(_chain_input(step)).sum().backward()
    comm = LoopbackCommunicator()
    fresh = GradBucketer(ref.named_parameters(), comm, bucket_cap_mb=_CHAIN_CAP, first_bucket_mb=_CHAIN_CAP)
    fresh.load_state_dict(copy.deepcopy(b.state_dict()))
    for step in range(2, 4):
        for m, bk in ((model, b), (ref, fresh)):
            m.zero_grad(set_to_none=True)
            bk.prepare_for_backward()
            m(_chain_input(step)).sum().backward()
        assert [bk.members for bk in fresh.buckets] == [bk.members for bk in b.buckets]
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), name
    assert [c for c in comm.calls if c[0] == "broadcast_object"] == [("broadcast_object", 0)]
    assert fresh.step == 4


def test_state_without_an_order_records_one_on_the_next_step() -> None:
    """What the strategy loads when the world size changed: only the step; the order is learnt again."""
    model = Chain()
    order, handles = _record_ready_order(model)
    comm = LoopbackCommunicator()
    b = GradBucketer(model.named_parameters(), comm, bucket_cap_mb=_CHAIN_CAP, first_bucket_mb=_CHAIN_CAP)
    initial = [bk.members for bk in b.buckets]
    b.load_state_dict({"step": 7})
    assert b.step == 7
    b.prepare_for_backward()
    assert [bk.members for bk in b.buckets] == initial  # nothing recorded yet: keep the reverse order
    model(_chain_input(0)).sum().backward()
    first_order = list(order)
    model.zero_grad(set_to_none=True)
    b.prepare_for_backward()
    assert [b.names[i] for bk in b.buckets for i in bk.members] == first_order
    assert [c for c in comm.calls if c[0] == "broadcast_object"] == [("broadcast_object", 0)]
    for h in handles:
        h.remove()
    b.close()


def test_close_removes_the_hooks() -> None:
    model, ref = _mlp(), _mlp()
    comm = LoopbackCommunicator(world_size=2)
    b = GradBucketer(model.named_parameters(), comm, **_caps(model, 200))
    b.prepare_for_backward()
    _loss(model, _batch(0)).backward()
    n_calls, step = len(comm.calls), b.step
    b.close()
    model.zero_grad(set_to_none=True)
    _loss(model, _batch(1)).backward()
    _loss(ref, _batch(1)).backward()
    assert len(comm.calls) == n_calls and b.step == step
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name  # plain autograd gradients now
    b.close()  # idempotent
