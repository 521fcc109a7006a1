"""One-process unit tests of lightning_sync.sync.compression (fp16/bf16 casts, PowerSGD) in a GradBucketer.

Gradients are set exactly: the loss ``sum_i (p_i * g_i).sum()`` has gradient ``g_i`` for ``p_i``, bit
for bit. On :class:`~lightning_sync.sync.communicator.LoopbackCommunicator` all ``world_size`` ranks hold
the same gradient, so the true average is that gradient, and whatever differs from it is the
compressor's own error: tolerances below are derived from the compression, not from the communicator.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lightning_sync.sync import (
    COMPRESSIONS,
    CastCompression,
    GradBucketer,
    LoopbackCommunicator,
    PowerSGD,
    make_compressor,
)

__all__: list[str] = []

_MB = 2**20


class RecordingLoopback(LoopbackCommunicator):
    """A loopback communicator that also records each all_reduce's dtype and op."""

    def __init__(self, world_size: int = 1) -> None:
        super().__init__(world_size)
        self.reduced: list[tuple[torch.dtype, str, int]] = []

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", group: Any = None, async_op: bool = False) -> Any:
        self.reduced.append((tensor.dtype, op, tensor.numel()))
        return super().all_reduce(tensor, op=op, group=group, async_op=async_op)


class Params(nn.Module):
    """Bare parameters of the given shapes, whose gradients the test sets exactly."""

    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in shapes])

    def backward_with(self, grads: list[torch.Tensor]) -> None:
        sum((p * g).sum() for p, g in zip(self.ps, grads)).backward()


def _step(model: Params, bucketer: GradBucketer, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """One synchronized step with exactly these gradients; returns the reduced gradients (copies)."""
    model.zero_grad(set_to_none=True)
    bucketer.prepare_for_backward()
    model.backward_with(grads)
    return [p.grad.detach().clone() for p in model.ps]


def _rand(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _low_rank(n: int, m: int, r: int, seed: int) -> torch.Tensor:
    return _rand((n, r), seed) @ _rand((m, r), seed + 1000).T


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _reduces(comm: LoopbackCommunicator) -> list[int]:
    return [n for op, n in comm.calls if op == "all_reduce"]


# --------------------------------------------------------------------------- fp16 / bf16


# Tolerance: g/K is formed in fp32 (relative error <= 2^-24), rounded once to the low dtype (<= u), the
# loopback sum multiplies by K in the low dtype (<= u again, exact when K is a power of two), and the cast
# back to fp32 is exact. So |result - g| <= (2u + 2^-24) |g| with u = 2^-11 (fp16) or 2^-8 (bf16), as long as
# every value stays in the low dtype's normal range; the gradients below have 0.25 <= |g| < 4.
_UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@pytest.mark.parametrize("world_size", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_compression_equals_the_average_within_the_dtype_precision(dtype: torch.dtype, world_size: int) -> None:
    shapes = [(16, 8), (8,), (5, 3, 2)]
    model = Params(shapes)
    comm = RecordingLoopback(world_size)
    b = GradBucketer(
        model.named_parameters(),
        comm,
        compressor=CastCompression(dtype),
        bucket_cap_mb=20 * 4 / _MB,
        first_bucket_mb=20 * 4 / _MB,
    )  # [(5, 3, 2)], [(8,), (16, 8)]
    assert len(b.buckets) == 2
    rtol = 2 * _UNIT_ROUNDOFF[dtype] + 2.0**-24
    for step in range(3):
        grads = []
        for k, s in enumerate(shapes):
            mag = torch.rand(s, generator=torch.Generator().manual_seed(10 * step + k)) * 3.75 + 0.25
            grads.append(mag * torch.where(_rand(s, 100 * step + k) < 0, -1.0, 1.0))
        comm.reduced.clear()
        out = _step(model, b, grads)
        for got, g in zip(out, grads):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, g, rtol=rtol, atol=0.0)
        # one message per bucket, in the low precision, summed (the division by K happened before the cast)
        assert comm.reduced == [(dtype, "sum", bk.buffer.numel()) for bk in b.buckets]
    b.close()


def test_cast_compression_rejects_other_dtypes() -> None:
    with pytest.raises(ValueError, match="float32"):
        CastCompression(torch.float32)


# --------------------------------------------------------------------------- PowerSGD: arguments


@pytest.mark.parametrize("rank", [0, -1, 1.5, True, "2", None])
def test_powersgd_rejects_bad_rank(rank: Any) -> None:
    with pytest.raises(ValueError, match="rank") as info:
        PowerSGD(rank=rank)
    assert repr(rank) in str(info.value)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 1.5}, "warmup_steps"),
        ({"min_compression_rate": 0.5}, "min_compression_rate"),
    ],
)
def test_powersgd_rejects_bad_settings(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as info:
        PowerSGD(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(info.value)


# --------------------------------------------------------------------------- PowerSGD: messages

# Rank 2, min_compression_rate 2: a matrix n x m (the parameter as first dim x the rest) is compressed iff
# n*m >= 2 * 2 * (n + m).
_SHAPES = [(32, 16), (8,), (3, 3), (16, 2, 4), (4, 40)]
_COMPRESSED = {0: (32, 16), 3: (16, 8)}  # 512 >= 192, 128 >= 96; (3, 3): 9 < 24; (4, 40): 160 < 176
_UNCOMPRESSED_NUMEL = 8 + 9 + 160


def test_powersgd_warmup_is_uncompressed_then_messages_are_r_times_n_plus_m() -> None:
    model = Params(_SHAPES)
    comm = LoopbackCommunicator(world_size=4)
    psgd = PowerSGD(rank=2, warmup_steps=2)
    b = GradBucketer(model.named_parameters(), comm, compressor=psgd)
    assert len(b.buckets) == 1
    total = b.buckets[0].buffer.numel()
    grads = [_rand(s, k) for k, s in enumerate(_SHAPES)]
    for _ in range(2):  # warmup: the whole bucket, averaged exactly (loopback avg does no arithmetic)
        comm.calls.clear()
        out = _step(model, b, grads)
        assert _reduces(comm) == [total]
        for got, g in zip(out, grads):
            assert torch.equal(got, g)
    r = 2
    msg1 = sum(r * n for n, _ in _COMPRESSED.values()) + _UNCOMPRESSED_NUMEL  # every P, plus what is not compressed
    msg2 = sum(r * m for _, m in _COMPRESSED.values())  # every Q
    for step in range(2, 5):
        comm.calls.clear()
        _step(model, b, grads)
        assert _reduces(comm) == [msg1, msg2], step
    assert msg1 + msg2 == sum(r * (n + m) for n, m in _COMPRESSED.values()) + _UNCOMPRESSED_NUMEL
    assert psgd.wire_values([torch.Size(s) for s in _SHAPES]) == msg1 + msg2
    assert msg1 + msg2 < total
    b.close()


def test_powersgd_sends_one_message_pair_per_bucket() -> None:
    shapes = [(32, 16), (24, 24), (10,)]
    model = Params(shapes)
    comm = LoopbackCommunicator(world_size=2)
    b = GradBucketer(
        model.named_parameters(),
        comm,
        compressor=PowerSGD(rank=1, warmup_steps=0),
        bucket_cap_mb=500 * 4 / _MB,
        first_bucket_mb=500 * 4 / _MB,
    )
    assert [bk.members for bk in b.buckets] == [[2, 1], [0]]
    _step(model, b, [_rand(s, k) for k, s in enumerate(shapes)])
    # bucket 0: P of the 24 x 24 matrix plus the 10 uncompressed values, then its Q; bucket 1: P, then Q.
    # The P messages go out as buckets become ready; when each Q message goes is the compressor's business.
    calls = _reduces(comm)
    assert calls[0] == 1 * 24 + 10
    assert sorted(calls) == sorted([1 * 24 + 10, 1 * 24, 1 * 32, 1 * 16])


# --------------------------------------------------------------------------- PowerSGD: values


def test_powersgd_reconstructs_an_exactly_low_rank_gradient() -> None:
    model = Params(_SHAPES)
    comm = LoopbackCommunicator(world_size=4)
    b = GradBucketer(model.named_parameters(), comm, compressor=PowerSGD(rank=2, warmup_steps=1))
    grads = [_rand(s, k) for k, s in enumerate(_SHAPES)]
    grads[0] = _low_rank(32, 16, 2, seed=7)
    grads[3] = _low_rank(16, 8, 2, seed=8).view(16, 2, 4)
    for step in range(4):  # step 0 warmup; then with a fresh Q, then with Q warm-started
        out = _step(model, b, grads)
        for k in _COMPRESSED:
            # P Q^T with P spanning the column space of M is M itself; what remains is fp32 rounding in the
            # matmuls and the QR of a 32 x 2 matrix: ~ few * n * 2^-24 relative, far below 1e-4
            assert _rel(out[k], grads[k]) < 1e-4, (step, k, _rel(out[k], grads[k]))
        for k in (1, 2, 4):  # uncompressed: sum of 4 equal values / 4 is exact in fp32
            assert torch.equal(out[k], grads[k]), (step, k)
    b.close()


def test_powersgd_warm_start_converges_to_the_best_rank_r_approximation() -> None:
    # subspace iteration: with the same M every step and Q reused, P Q^T -> the truncated SVD of M
    n, m, r = 24, 12, 2
    u, _ = torch.linalg.qr(_rand((n, m), 1))
    v, _ = torch.linalg.qr(_rand((m, m), 2))
    s = torch.tensor([10.0, 6.0] + [0.5 * 0.8**k for k in range(m - 2)])
    g = u @ torch.diag(s) @ v.T
    best = u[:, :r] @ torch.diag(s[:r]) @ v[:, :r].T
    model = Params([(n, m)])
    b = GradBucketer(
        model.named_parameters(),
        LoopbackCommunicator(2),
        compressor=PowerSGD(rank=r, warmup_steps=0, error_feedback=False, warm_start=True),
    )
    errors = [_rel(_step(model, b, [g])[0], best) for _ in range(8)]
    # the error shrinks by about (s_3 / s_2)^2 = (0.5/6)^2 each step; after 8 steps only rounding is left
    assert errors[-1] < 1e-5, errors
    b.close()


def test_powersgd_error_feedback_is_input_minus_approximation_and_is_added_back() -> None:
    n, m, r = 20, 10, 1
    model = Params([(n, m)])
    psgd = PowerSGD(rank=r, warmup_steps=0, error_feedback=True, warm_start=True)
    b = GradBucketer(model.named_parameters(), LoopbackCommunicator(world_size=2), compressor=psgd)
    error = torch.zeros(n, m)
    sent = torch.zeros(n, m)
    total = torch.zeros(n, m)
    for step in range(5):
        g = _rand((n, m), 50 + step)  # full rank: rank 1 leaves a large error
        q_prev = psgd.state_dict()["q"].get(0)
        approx = _step(model, b, [g])[0]
        inp = g + error  # what was compressed: this step's gradient plus the error carried over
        if q_prev is not None:
            # one power-iteration step from the previous Q, on g + error, in float64
            p_orth = torch.linalg.qr(inp.double() @ q_prev.double()).Q
            ref = p_orth @ (inp.double().T @ p_orth).T
            assert _rel(approx.double(), ref) < 1e-5, step
        state_error = psgd.state_dict()["error"][0]
        # computed as the compressor does (same fp32 operations), so exactly equal
        assert torch.equal(state_error, inp - approx), step
        error = state_error
        sent += approx
        total += g
        # nothing is lost, only delayed: what was applied plus what is still owed is every gradient so far
        torch.testing.assert_close(sent + error, total, rtol=0, atol=1e-5)
    b.close()


def test_powersgd_without_error_feedback_keeps_no_error() -> None:
    model = Params([(20, 10)])
    psgd = PowerSGD(rank=1, warmup_steps=0, error_feedback=False)
    b = GradBucketer(model.named_parameters(), LoopbackCommunicator(), compressor=psgd)
    g = _rand((20, 10), 3)
    first = _step(model, b, [g])[0]
    assert psgd.state_dict()["error"] == {}
    assert _rel(first, g) > 0.1  # rank 1 of a random 20 x 10 matrix is a coarse approximation
    b.close()


# --------------------------------------------------------------------------- PowerSGD: state


def test_powersgd_state_dict_round_trip_reproduces_the_next_step() -> None:
    def build() -> tuple[Params, GradBucketer, PowerSGD]:
        model = Params(_SHAPES)
        psgd = PowerSGD(rank=2, warmup_steps=1, seed=123)
        return model, GradBucketer(model.named_parameters(), LoopbackCommunicator(world_size=2), compressor=psgd), psgd

    model_a, a, psgd_a = build()
    for step in range(3):
        _step(model_a, a, [_rand(s, 10 * step + k) for k, s in enumerate(_SHAPES)])
    state = copy.deepcopy(a.state_dict())
    assert state["step"] == 3
    assert sorted(state["compressor"]["q"]) == sorted(_COMPRESSED)
    assert sorted(state["compressor"]["error"]) == sorted(_COMPRESSED)
    for k, (n, m) in _COMPRESSED.items():
        assert state["compressor"]["q"][k].shape == (m, 2)
        assert state["compressor"]["error"][k].shape == (n, m)

    model_b, b, psgd_b = build()
    b.load_state_dict(state)
    assert b.step == 3
    for key in ("q", "error"):
        for k, t in psgd_a.state_dict()[key].items():
            assert torch.equal(psgd_b.state_dict()[key][k], t), (key, k)

    grads = [_rand(s, 99 + k) for k, s in enumerate(_SHAPES)]
    out_a, out_b = _step(model_a, a, grads), _step(model_b, b, grads)
    for k, (x, y) in enumerate(zip(out_a, out_b)):
        assert torch.equal(x, y), k  # same Q, same error, same input: the same step, bit for bit
    for k, t in psgd_a.state_dict()["q"].items():
        assert torch.equal(psgd_b.state_dict()["q"][k], t), k

    # a fresh compressor (different Q, no error) would have given something else
    model_c, c, _ = build()
    c.load_state_dict({"step": 3})
    out_c = _step(model_c, c, grads)
    assert not torch.equal(out_c[0], out_a[0])
    for bucketer in (a, b, c):
        bucketer.close()


def _one_bucket(grad: torch.Tensor) -> tuple[Any, Any]:
    """A bucket holding one gradient matrix as parameter 0, and a bucketer past the warm-up."""
    return SimpleNamespace(members=[0], views=[grad], buffer=grad.view(-1)), SimpleNamespace(step=5)


def _saved_state(n: int, m: int) -> dict[str, Any]:
    """A PowerSGD state as a checkpoint holds it: CPU float32 clones (``PowerSGD.state_dict``)."""
    return {"q": {0: _rand((m, 2), 1)}, "error": {0: _rand((n, m), 2)}}


@pytest.mark.parametrize(("device", "dtype"), [("meta", torch.float32), ("cpu", torch.float64)])
def test_powersgd_state_loaded_from_a_checkpoint_moves_to_the_gradients_device_and_dtype(
    device: str, dtype: torch.dtype
) -> None:
    # A checkpoint's Q and error are CPU float32; a run on another device (meta stands in for CUDA here) or
    # in another dtype meets them in its first compressed step, where they must follow the gradient.
    n, m = 32, 16
    psgd = PowerSGD(rank=2, warmup_steps=0)
    psgd.load_state_dict(_saved_state(n, m))
    grad = _rand((n, m), 3).to(device=device, dtype=dtype)
    bucket, bucketer = _one_bucket(grad)
    psgd.launch(bucket, bucketer, LoopbackCommunicator(world_size=2)).wait()
    for key, store in (("q", psgd._q), ("error", psgd._error)):
        assert (store[0].device.type, store[0].dtype) == (device, dtype), key


def test_powersgd_state_moved_on_first_use_computes_what_a_state_loaded_there_does() -> None:
    # the move is a plain cast: the step equals one from a state converted by hand beforehand, bit for bit
    n, m = 32, 16
    lazy, eager = PowerSGD(rank=2, warmup_steps=0), PowerSGD(rank=2, warmup_steps=0)
    lazy.load_state_dict(_saved_state(n, m))
    eager.load_state_dict({key: {i: t.double() for i, t in part.items()} for key, part in _saved_state(n, m).items()})
    out = []
    for psgd in (lazy, eager):
        grad = _rand((n, m), 3).double()
        bucket, bucketer = _one_bucket(grad)
        psgd.launch(bucket, bucketer, LoopbackCommunicator(world_size=2)).wait()
        out.append(grad)
    assert torch.equal(out[0], out[1])
    for key in ("q", "error"):
        assert torch.equal(lazy.state_dict()[key][0], eager.state_dict()[key][0]), key


# --------------------------------------------------------------------------- make_compressor


def test_make_compressor_names() -> None:
    assert make_compressor(None) is None
    assert make_compressor("none") is None
    assert isinstance(make_compressor("fp16"), CastCompression) and make_compressor("fp16").dtype == torch.float16
    assert make_compressor("bf16").dtype == torch.bfloat16
    psgd = make_compressor("powersgd", powersgd_rank=3, powersgd_warmup_steps=5)
    assert isinstance(psgd, PowerSGD) and (psgd.rank, psgd.warmup_steps) == (3, 5)
    assert set(COMPRESSIONS) == {"fp16", "bf16", "powersgd"}


@pytest.mark.parametrize("name", ["fp8", "FP16", "power_sgd", ""])
def test_make_compressor_unknown_name_lists_the_allowed_ones(name: str) -> None:
    with pytest.raises(ValueError) as info:
        make_compressor(name)
    msg = str(info.value)
    assert repr(name) in msg
    for allowed in COMPRESSIONS:
        assert repr(allowed) in msg


def test_make_compressor_validates_the_powersgd_rank() -> None:
    with pytest.raises(ValueError, match="rank"):
        make_compressor("powersgd", powersgd_rank=0)


# --------------------------------------------------------------------------- codec accounting


@pytest.mark.parametrize("compressor", ["fp16", "powersgd"])
def test_codec_arithmetic_is_counted_in_comms_stats_as_time_without_bytes(
    compressor: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The codec entry counts one call per compressed bucket, no bytes, and the seconds of each timed
    stretch of arithmetic; the communicator's own traffic is not in it (the loopback communicator records
    nothing in comms). The compressor reads a fake clock that advances by exactly 1 s per reading, so
    every timed stretch counts 1 s: no wall clock is read."""
    from types import SimpleNamespace

    from lightning_sync import comms
    from lightning_sync.sync import compression
    from lightning_sync.sync.compression import CODEC_OP

    ticks = iter(range(10_000))
    monkeypatch.setattr(compression, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    shapes = [(64, 32), (32,)]
    model = Params(shapes)
    codec_of = make_compressor(compressor, powersgd_warmup_steps=0)
    b = GradBucketer(
        model.named_parameters(),
        LoopbackCommunicator(world_size=2, observer=comms.CommStats()),
        compressor=codec_of,
        bucket_cap_mb=64 * 32 * 4 / _MB,
        first_bucket_mb=64 * 32 * 4 / _MB,
    )
    stats = b._comm.observer
    steps = 2
    for step in range(steps):
        _step(model, b, [_rand(s, 10 * step + k) for k, s in enumerate(shapes)])
    # stretches per bucket and step: the cast, then the cast back (fp16); the products before message 1,
    # then the decoding after it, split in two around message 2 where the bucket holds a compressed matrix
    if compressor == "fp16":
        stretches = 2 * len(b.buckets)
    else:
        stretches = sum(2 + any(codec_of._matrix_shape(v) is not None for v in bk.views) for bk in b.buckets)
    codec = stats[CODEC_OP]
    assert codec.calls == steps * len(b.buckets) and codec.bytes == 0
    assert codec.seconds == steps * stretches
    assert set(stats.snapshot()) == {CODEC_OP}
    b.close()
