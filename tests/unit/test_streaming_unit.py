"""Streaming DiLoCo's pieces in one process: the int8/int4 codec and its error feedback, the fragment split, the
staggered schedule, the overlap's merge, and the settings' checks. The averages over real ranks, and against a
single-process reference, are in ``tests/multiprocess/test_streaming_diloco.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_sync.sync.communicator import LoopbackCommunicator
from lightning_sync.sync.outer import DiLoCoOuter, split_fragments
from lightning_sync.sync.quantize import CHUNK, OuterCodec, decode, encode, encoded_bytes

LEVELS = {"int8": 127, "int4": 7}


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_round_trip_is_bounded_by_half_a_step_per_chunk(dtype: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * CHUNK, generator=g) * torch.logspace(-4, 2, 8).repeat_interleave(CHUNK)
    x[:CHUNK] = 0.0  # an all-zero chunk: scale 0, decodes to zeros
    buffer, decoded = encode(x, dtype)
    assert buffer.dtype == torch.uint8 and buffer.numel() == encoded_bytes(x.numel(), dtype)
    assert torch.equal(decode(buffer, x.numel(), dtype), decoded), "what is sent decodes to what the sender kept"
    step = x.view(-1, CHUNK).abs().amax(1, keepdim=True) / LEVELS[dtype]
    err = (decoded - x).view(-1, CHUNK).abs()
    # round to nearest: half a quantization step per value, plus fp32 rounding of the product (1e-6 relative)
    assert (err <= step / 2 * (1 + 1e-5) + 1e-30).all(), (err / step.clamp_min(1e-30)).max()
    assert torch.equal(decoded[:CHUNK], torch.zeros(CHUNK))


def test_bytes_on_the_wire_are_the_codes_and_the_scales() -> None:
    n = 4 * CHUNK
    assert encoded_bytes(n, "int8") == n + 4 * 4  # a byte a value, an fp32 scale a chunk
    assert encoded_bytes(n, "int4") == n // 2 + 4 * 4  # two values a byte
    # 4 bits a value and 32 per 128-value chunk: 4.25 bits, against fp32's 32
    assert encoded_bytes(n, "int4") * 8 / n == pytest.approx(4.25)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_error_feedback_makes_the_accumulated_error_vanish(dtype: str) -> None:
    """The same vector averaged R times: with error feedback what arrives sums to R x the vector within the
    errors still held (a bounded amount), so the mean error per round falls as 1/R; without it, every round
    loses the same rounding and the accumulated error grows as R. One rank (a loopback of several would gather
    its own segment K times), which owns the whole vector: both halves and both buffers still run."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3 * CHUNK - 5, generator=g)  # not a whole number of chunks: padded
    codec, comm = OuterCodec(dtype), LoopbackCommunicator(1)
    arrived, once = torch.zeros_like(x), None
    for r in range(1, 201):
        handle = codec.start("0/0", x, comm)
        handle.advance()
        average = handle.wait()
        once = average.clone() if once is None else once
        arrived += average
        if r in (10, 200):
            accumulated = (arrived - r * x).abs().max().item()
            held = codec.worker_errors["0/0"].abs().max().item() + codec.server_errors["0/0"].abs().max().item()
            # what did not arrive is what the two buffers hold: at most one rounding of each, whatever r
            assert accumulated <= held + 1e-4 * r, (r, accumulated, held)
    without = 200 * (once - x).abs().max().item()  # no feedback: the first round's error, 200 times over
    assert (arrived - 200 * x).abs().max().item() < without / 20, "feedback keeps the sum on track"
    assert (arrived / 200 - x).abs().max().item() < (once - x).abs().max().item() / 20, "the mean error vanishes"


def test_fp32_and_bf16_keep_no_error_state() -> None:
    x = torch.randn(300)
    for dtype in ("fp32", "bf16"):
        codec = OuterCodec(dtype)
        out = codec.start("0/0", x, LoopbackCommunicator(2)).wait()
        assert out.dtype == x.dtype and codec.rank_state() == {"worker": {}, "server": {}}
        tol = 0 if dtype == "fp32" else 2**-8  # bf16 keeps 8 bits of mantissa
        assert torch.allclose(out, x, rtol=tol, atol=0), dtype


def test_error_feedback_regrouped_for_another_world_size_keeps_what_it_carries() -> None:
    """Two ranks' buffers to three: the worker errors' mean is each new rank's, and the server errors, segments of
    one vector in rank order, are cut into the new segments; the total every average will still deliver is kept."""
    n = 700  # 2 ranks: segments of 384; 3 ranks: 256
    workers = [torch.randn(n), torch.randn(n)]
    whole = torch.randn(n)
    servers = [torch.zeros(384), torch.zeros(384)]
    servers[0][:384] = whole[:384]
    servers[1][: n - 384] = whole[384:]
    states = [{"worker": {"0/0": w}, "server": {"0/0": s}} for w, s in zip(workers, servers)]
    new = [OuterCodec.regrouped(states, 3, r) for r in range(3)]
    for state in new:
        assert torch.allclose(state["worker"]["0/0"], (workers[0] + workers[1]) / 2, atol=1e-6)
    rebuilt = torch.cat([state["server"]["0/0"] for state in new])
    assert rebuilt.numel() == 768 and torch.equal(rebuilt[:n], whole) and not rebuilt[n:].any()
    assert OuterCodec.regrouped([{}, {}], 3, 0) == {"worker": {}, "server": {}}, "saved before any sync"


@pytest.mark.parametrize(
    ("sizes", "fragments", "want"),
    [
        ([10, 10, 10, 10], 2, [[(0, 0, 10), (1, 0, 10)], [(2, 0, 10), (3, 0, 10)]]),
        ([100, 1, 1, 1], 2, [[(0, 0, 51)], [(0, 51, 100), (1, 0, 1), (2, 0, 1), (3, 0, 1)]]),  # a cut inside a tensor
        ([1, 0, 2, 0], 3, [[(0, 0, 1)], [(1, 0, 0), (2, 0, 1)], [(2, 1, 2), (3, 0, 0)]]),  # empty ones ride along
        ([7], 1, [[(0, 0, 7)]]),
        ([3], 3, [[(0, 0, 1)], [(0, 1, 2)], [(0, 2, 3)]]),
    ],
)
def test_fragments_are_consecutive_runs_of_equal_size(
    sizes: list[int], fragments: int, want: list[list[tuple[int, int, int]]]
) -> None:
    got = split_fragments(sizes, fragments)
    assert got == want
    counts = [sum(hi - lo for _, lo, hi in run) for run in got]
    assert max(counts) - min(counts) <= 1 and sum(counts) == sum(sizes), "every value once, to one value equal"


def test_more_fragments_than_values_is_refused() -> None:
    with pytest.raises(ValueError, match="fragments=3 is more than the 2 trainable values"):
        split_fragments([1, 1], 3)


def test_the_outer_step_on_pieces_is_torchs_sgd_on_the_whole_tensor() -> None:
    """A tensor cut in two takes its outer Nesterov steps a piece at a time; the same gradients given to torch's
    SGD whole step it to the same values and momentum (the same elementwise arithmetic; the tolerance is an fp32
    rounding of a multiply-add chain, which the two evaluate alike)."""
    p = nn.Parameter(torch.randn(10))
    outer = DiLoCoOuter([p], LoopbackCommunicator(1), 4, fragments=2)
    whole = torch.nn.Parameter(p.detach().clone())
    sgd = torch.optim.SGD([whole], lr=0.7, momentum=0.9, nesterov=True)
    for r in range(3):
        grad = torch.randn(10, generator=torch.Generator().manual_seed(r))
        outer._outer_step((0, 0, 5), grad[:5].clone())
        outer._outer_step((0, 5, 10), grad[5:].clone())
        whole.grad = grad
        sgd.step()
    assert torch.allclose(outer.global_params[0], whole, rtol=0, atol=1e-6)
    buf = outer.outer_optimizer.state[outer.global_params[0]]["momentum_buffer"]
    assert torch.allclose(buf, sgd.state[whole]["momentum_buffer"], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"fragments": 0}, "fragments must be an int >= 1, got 0"),
        ({"fragments": 9}, r"fragments must be in \[1, sync_every=8\]"),
        ({"overlap_steps": -1}, "overlap_steps must be an int >= 0, got -1"),
        ({"overlap_steps": 8}, r"overlap_steps must be in \[0, sync_every=8\)"),
        ({"overlap_alpha": 1.5}, r"overlap_alpha must be a number in \[0, 1\], got 1.5"),
        ({"outer_dtype": "fp8"}, r"outer_dtype must be one of \['fp32', 'bf16', 'int8', 'int4'\], got 'fp8'"),
    ],
)
def test_bad_streaming_settings_are_named(kw: dict[str, Any], named: str) -> None:
    params = [nn.Parameter(torch.ones(4)) for _ in range(4)]
    with pytest.raises(ValueError, match=named):
        DiLoCoOuter(params, LoopbackCommunicator(2), 8, **kw)


class _Log(LoopbackCommunicator):
    """Records at which inner step each all-reduce is issued, and of how many values."""

    def __init__(self, world: int) -> None:
        super().__init__(world)
        self.step = 0
        self.issued: list[tuple[int, int]] = []

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.issued.append((self.step, tensor.numel()))
        return super().all_reduce(tensor, *args, **kwargs)


def test_each_fragment_syncs_on_its_own_schedule_and_lands_tau_steps_later() -> None:
    """H = 8, F = 4 (offsets 0, 2, 4, 6), tau = 3: fragment f (tensor f, 5 values each) is sent at the steps
    t = 2f (mod 8) and its global value changes at t + 3, never before."""
    H, F, TAU = 8, 4, 3
    params = [nn.Parameter(torch.zeros(5)) for _ in range(F)]
    comm = _Log(2)
    outer = DiLoCoOuter(params, comm, H, fragments=F, overlap_steps=TAU)
    assert outer.fragments == [[(f, 0, 5)] for f in range(F)] and outer.offsets == [0, 2, 4, 6]
    landed: list[tuple[int, int]] = []
    for step in range(1, 3 * H + 1):
        comm.step = step
        with torch.no_grad():
            for p in params:
                p.add_(1.0)  # an inner step moves every parameter
        before = [g.detach().clone() for g in outer.global_params]
        outer.step()
        landed += [(step, f) for f, g in enumerate(outer.global_params) if not torch.equal(g, before[f])]
    want_sent = [(t, f) for t in range(1, 3 * H + 1) for f in range(F) if t % H == 2 * f and t >= max(2 * f, 1)]
    assert comm.issued == [(t, 5) for t, _ in want_sent]
    assert landed == sorted((t + TAU, f) for t, f in want_sent if t + TAU <= 3 * H)
    assert outer.syncs == len(landed)


def test_an_overlapped_fragment_merges_local_and_global_with_alpha() -> None:
    """One fragment, H = 4, tau = 2, alpha = 0.25: the step after the outer step lands, the local value is
    0.25 local + 0.75 global; the global value is DiLoCo's outer Nesterov step on the pseudo-gradient sent."""
    p = nn.Parameter(torch.tensor([1.0, -2.0]))
    outer = DiLoCoOuter(
        [p],
        LoopbackCommunicator(2),
        4,
        outer_lr=0.5,
        outer_momentum=0.0,
        nesterov=False,
        overlap_steps=2,
        overlap_alpha=0.25,
    )
    start = p.detach().clone()
    for step in range(1, 7):
        with torch.no_grad():
            p.add_(0.5)
        if step == 4:
            sent = start - p.detach()  # the pseudo-gradient at the launch (every loopback rank the same)
        if step == 6:
            local = p.detach().clone()
        outer.step()
    new_global = start - 0.5 * sent
    assert torch.equal(outer.global_params[0].detach(), new_global)
    assert torch.allclose(p.detach(), 0.25 * local + 0.75 * new_global, rtol=0, atol=1e-7)


def test_in_flight_state_round_trips_and_is_checked() -> None:
    params = [nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(5))]
    outer = DiLoCoOuter(params, LoopbackCommunicator(2), 4, fragments=2, overlap_steps=3)
    for _ in range(5):  # fragment 1 sent at step 2 lands at 5; fragment 0 sent at 4 lands at 7: in flight
        with torch.no_grad():
            params[0].add_(0.1)
            params[1].sub_(0.2)
        outer.step()
    state = outer.state_dict()
    assert [(e["fragment"], e["due"]) for e in state["in_flight"]] == [(0, 7)]
    again = DiLoCoOuter(
        [nn.Parameter(p.detach().clone()) for p in params], LoopbackCommunicator(2), 4, fragments=2, overlap_steps=3
    )
    again.load_state_dict(state)
    assert [(f.fragment, f.due) for f in again.in_flight] == [(0, 7)]
    assert torch.equal(again.in_flight[0].averages[0], outer.in_flight[0].wait()[0])
    bad = {**state, "in_flight": [{**state["in_flight"][0], "averages": [torch.zeros(9)]}]}
    with pytest.raises(ValueError, match="outer step in flight for the values"):
        again.load_state_dict(bad)
