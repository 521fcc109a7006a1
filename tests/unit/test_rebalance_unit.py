"""Rebalancing's algorithm in one process: the split of a micro-batch by measured speed, and the shares it deals.

The ranks are simulated: rank r computes a share of n samples in ``fixed + n / speed[r]`` seconds (a step's fixed
costs, and its per-sample ones), measured with seeded noise. What must hold:

* the counts always sum to the micro-batch, each rank keeps at least one sample, and equal counts deal exactly the
  strided shares of a plain run;
* the weights make the ranks' average of share means the micro-batch's mean, for any counts (so the gradient is
  the global mean);
* the split moves toward the measured speeds and converges where every rank's compute time is equal, despite the
  fixed costs; it stays put for equal speeds under noise, and one slow step inside a window does not move it;
* a rank that slows down in the middle of a run is followed within a few windows;
* the state survives a checkpoint, and a crafted one is refused.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_sync.sampler import GlobalOrderSampler
from lightning_sync.shares import SharedBatches, deal, share_of, weight_of
from lightning_sync.sync.rebalance import Rebalancer, proportional


def _simulate(
    rebalancer: Rebalancer, speeds: list[float], windows: int, fixed: float = 0.0, noise: float = 0.0, seed: int = 0
) -> list[list[int]]:
    """``windows`` windows of 10 micro-batches each; returns the counts after each."""
    rng = random.Random(seed)
    history = []
    for _ in range(windows):
        counts = rebalancer.counts
        seconds = [10 * (fixed + n / s) * (1 + rng.uniform(-noise, noise)) for n, s in zip(counts, speeds)]
        rebalancer.update(seconds, [10 * n for n in counts])
        history.append(list(rebalancer.counts))
    return history


@pytest.mark.parametrize("total", [2, 3, 7, 16, 48, 1000])
@pytest.mark.parametrize("weights", [[1.0, 1.0], [2.0, 1.0], [1.0, 1e-6, 1.0], [3.0, 1.0, 1.0, 0.5], [5.0, 0.0]])
def test_proportional_counts_sum_to_the_total_and_leave_no_rank_without_a_sample(
    total: int, weights: list[float]
) -> None:
    if total < len(weights):
        return
    counts = proportional(weights, total)
    assert sum(counts) == total and min(counts) >= 1, counts
    for n, w in zip(counts, weights):  # within one sample of the exact share, but for a rank raised to one
        assert abs(n - w * total / sum(weights)) < 1 + 1e-9 or n == 1, (counts, weights)


@pytest.mark.parametrize(
    ("weights", "cap", "expected"),
    [
        ([1.0, 100.0], 48, [16, 48]),  # the fast rank at its cap, the rest to the slow one
        ([100.0, 1.0, 1.0], 48, [48, 24, 24]),  # the capped rank's excess shared by the others in proportion
        ([100.0, 100.0, 1.0], 48, [47, 48, 1]),  # both fast ranks at the cap would leave none: one sample each at least
        ([3.0, 1.0], 64, [48, 16]),  # a cap above the proportional counts changes nothing
    ],
)
def test_proportional_keeps_every_rank_within_its_cap(weights: list[float], cap: int, expected: list[int]) -> None:
    total = 64 if len(weights) == 2 else 96
    assert proportional(weights, total, cap=cap) == expected
    with pytest.raises(ValueError, match="cannot take"):
        proportional(weights, total, cap=total // len(weights) - 1)


def test_a_slow_rank_with_mostly_fixed_costs_keeps_its_share_within_the_cap() -> None:
    # rank 1's time is almost all fixed cost: without a cap the fixed point would hand rank 0 all but one sample
    rebalancer = Rebalancer(2, 64)
    _simulate(rebalancer, [1e6, 1e6], 10, fixed=0.01)  # equal: stays even
    assert rebalancer.counts == [32, 32]

    def seconds(counts: list[int]) -> list[float]:  # 10 micro-batches; rank 1 three times slower, fixed cost and all
        return [10 * (0.001 + counts[0] / 1e5), 10 * 3 * (0.001 + counts[1] / 1e5)]

    for _ in range(10):
        rebalancer.update(seconds(rebalancer.counts), [10 * n for n in rebalancer.counts])
    assert rebalancer.counts == [48, 16], "1.5 x the even 32 at most"


def test_proportional_refuses_weights_it_cannot_split_by() -> None:
    for bad in ([], [0.0, 0.0], [1.0, -1.0]):
        with pytest.raises(ValueError, match="non-negative with a positive sum"):
            proportional(bad, 8)


def test_equal_counts_deal_the_strided_shares_of_a_plain_run() -> None:
    entries = list(range(100, 124))
    for world in (1, 2, 3, 4, 6):
        counts = [len(range(r, 24, world)) for r in range(world)]
        assert deal(entries, counts) == [entries[r::world] for r in range(world)]


@pytest.mark.parametrize("counts", [[5, 3], [1, 7], [4, 2, 2], [1, 1, 6], [3, 3, 1, 1]])
def test_uneven_counts_deal_every_entry_once_in_the_given_sizes(counts: list[int]) -> None:
    entries = list(range(sum(counts)))
    shares = deal(entries, counts)
    assert [len(s) for s in shares] == counts
    assert Counter(i for s in shares for i in s) == Counter(entries)
    with pytest.raises(ValueError, match="do not split"):
        deal(entries, [*counts[:-1], counts[-1] + 1])


@pytest.mark.parametrize("counts", [(5, 3), (1, 7), (6, 3, 3), (2, 9, 1)])
@pytest.mark.parametrize("size", [None, 6, 3])  # a whole micro-batch, or a short last one
def test_weighted_share_means_average_to_the_micro_batch_mean(counts: tuple[int, ...], size: int | None) -> None:
    world = len(counts)
    entries = list(range(size if size is not None else sum(counts)))
    if len(entries) < world:
        return
    values = torch.rand(len(entries), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    shares = [share_of(entries, r, world, counts) for r in range(world)]
    assert Counter(i for s in shares for i in s) == Counter(entries), "a short micro-batch is split whole too"
    mean = sum(weight_of(entries, r, world, counts) * values[s].mean().item() for r, s in enumerate(shares)) / world
    assert mean == pytest.approx(values.mean().item(), abs=1e-12, rel=0)


def test_even_counts_weigh_exactly_one() -> None:
    # the common case must leave the loss untouched bit for bit
    assert all(weight_of(list(range(16)), r, 2, (8, 8)) == 1.0 for r in range(2))


def test_the_split_moves_toward_the_speeds_and_settles_where_compute_times_are_equal() -> None:
    # rank 1 at half speed, with a fixed cost of 2 samples' worth per micro-batch: n/s alone would give it 1/3;
    # equal times need (n0 + 2) / 1 = (n1 + 1) * 2 / 1 ... the fixed point is where the times match
    speeds, fixed = [1000.0, 500.0], 0.002
    rebalancer = Rebalancer(2, 48)
    history = _simulate(rebalancer, speeds, 12, fixed=fixed)
    assert history[0][1] < 24, "the first window already moves samples away from the slow rank"
    final = history[-1]
    times = [fixed + n / s for n, s in zip(final, speeds)]
    one_sample = 1 / min(speeds)
    assert abs(times[0] - times[1]) <= one_sample + 1e-12, (final, times)  # as equal as whole samples allow
    assert history[-3:] == [final] * 3, f"it settled: {history}"
    assert rebalancer.seconds_saved > 0


def test_one_of_three_at_half_speed_gets_about_a_fifth() -> None:
    rebalancer = Rebalancer(3, 60)
    history = _simulate(rebalancer, [1.0, 0.5, 1.0], 8)
    assert history[-1] == [24, 12, 24]


def test_equal_speeds_under_noise_leave_the_split_put() -> None:
    rebalancer = Rebalancer(4, 64)
    history = _simulate(rebalancer, [800.0] * 4, 100, fixed=0.001, noise=0.05, seed=1)
    assert all(h == [16] * 4 for h in history) and rebalancer.moves == 0


def test_one_slow_step_inside_a_window_does_not_move_the_split() -> None:
    rebalancer = Rebalancer(2, 16)
    _simulate(rebalancer, [100.0, 100.0], 3)
    seconds = [10 * 8 / 100.0, (9 + 3) * 8 / 100.0]  # rank 1: one of its 10 micro-batches took 3 times as long
    assert not rebalancer.update(seconds, [80, 80])
    assert rebalancer.counts == [8, 8]


def test_a_rank_that_slows_down_mid_run_is_followed_within_a_few_windows() -> None:
    rebalancer = Rebalancer(2, 32)
    _simulate(rebalancer, [100.0, 100.0], 5)
    assert rebalancer.counts == [16, 16]
    history = _simulate(rebalancer, [100.0, 50.0], 4)
    assert history[0][1] < 16, "the first window after the slow-down moves the split"
    assert history[-1] in ([21, 11], [22, 10]), history  # 32 x 2/3 = 21.3


def test_a_window_some_rank_measured_nothing_in_is_skipped() -> None:
    rebalancer = Rebalancer(2, 8)
    assert not rebalancer.update([0.0, 1.0], [4, 4]) and rebalancer.speeds is None
    with pytest.raises(ValueError, match="one measurement per rank"):
        rebalancer.update([1.0], [4])


def test_the_state_survives_a_checkpoint_and_a_crafted_one_is_refused() -> None:
    rebalancer = Rebalancer(2, 16)
    _simulate(rebalancer, [100.0, 40.0], 4)
    state = rebalancer.state_dict()
    again = Rebalancer(2, 16)
    assert again.load_state_dict(state)
    assert again.state_dict() == state
    other = Rebalancer(3, 24)  # another world size: starts even
    assert not other.load_state_dict(state) and other.counts == [8, 8, 8]
    for counts in ([16, 0], [10, 10], [8.0, 8.0], "8,8", [8, 7, 1], [13, 3]):  # 13: above 1.5 x its even 8
        with pytest.raises(ValueError, match=r"counts must be 2 ints in 1\.\.12 summing to 16"):
            Rebalancer(2, 16).load_state_dict({**state, "counts": counts})
    with pytest.raises(ValueError, match="speeds must be 2 positive numbers"):
        Rebalancer(2, 16).load_state_dict({**state, "speeds": [1.0, -1.0]})


@pytest.mark.parametrize(("world", "micro"), [(0, 4), (3, 2), (2.0, 8)])
def test_bad_shapes_are_refused(world: int, micro: int) -> None:
    with pytest.raises(ValueError, match="need 1 <= world <= micro"):
        Rebalancer(world, micro)


def test_shared_batches_deal_each_micro_step_by_the_counts_in_force_and_know_a_stale_one() -> None:
    n, world, batch = 40, 2, 4
    base = DistributedSampler(list(range(n)), num_replicas=world, rank=1, shuffle=True, seed=3)  # type: ignore[arg-type]
    place = [1, 2, (4, 4)]
    batches = SharedBatches(GlobalOrderSampler(base), batch, False, lambda: tuple(place))
    got = []
    for j, indices in enumerate(batches):
        got.append(indices)
        if j == 1:
            place[2] = (6, 2)  # rank 1 measured slower: it gets 2 of every 8 from micro-step 2 on
    assert got[:2] == [batches.entries(j)[1::2] for j in range(2)], "even counts: the plain run's shares"
    assert [len(b) for b in got[2:]] == [2] * (len(got) - 2)
    assert batches.is_stale(3, 1, 2, (5, 3)) and not batches.is_stale(3, 1, 2, (6, 2))
    assert batches.weight(3, 1, 2, (6, 2)) == 0.5
