"""``SharedBatches`` in one process: the batch sampler that shares each micro-step of the global order out over the
members training now (live fault tolerance's data side).

What must hold, and why it is tested here without a process group or a Trainer:

* at the nominal world it is indistinguishable from the ``BatchSampler(DistributedSampler(...))`` Lightning would
  have built, so turning live fault tolerance on changes nothing while no rank is lost;
* at a smaller world the members' shares of a micro-step are exactly that micro-step's samples, none trained twice
  and none dropped, and as even as they can be, so the global batch is held;
* ``weight`` makes the members' average of share means the micro-step's mean, so uneven shares do not bias the
  gradient;
* ``is_stale`` tells a prefetched batch made for an older membership from a current one;
* a resume position starts the epoch at the right micro-step with the uninterrupted run's samples;
* a membership change in the middle of an epoch switches the later batches to the new shares.

Every membership is played by a ``view`` callable, as the strategy's ``_place`` would answer it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler

from lightning_sync.sampler import GlobalOrderSampler
from lightning_sync.shares import SharedBatches

# (dataset size N, nominal world W0, per-rank batch B, drop_last): a whole number of micro-steps; N not a multiple
# of W0 * B (a short last micro-step, kept or dropped); N not a multiple of W0 (DistributedSampler pads by
# repeating the order's start); N < W0 (the order repeated more than once); and a micro-step larger than the epoch.
CASES = [
    (24, 2, 6, False),
    (23, 2, 4, False),
    (23, 2, 4, True),
    (10, 3, 2, False),
    (10, 3, 2, True),
    (29, 4, 3, False),
    (29, 4, 3, True),
    (5, 8, 1, False),
    (7, 4, 3, False),
]
SEED = 7


def _base(n: int, world: int, rank: int, epoch: int = 0, drop_last: bool = False) -> DistributedSampler:
    """The sampler Lightning installs at the nominal world, moved to ``epoch`` as Lightning's loop moves it."""
    base = DistributedSampler(
        list(range(n)),  # type: ignore[arg-type]
        num_replicas=world,
        rank=rank,
        shuffle=True,
        seed=SEED,
        drop_last=drop_last,
    )
    base.set_epoch(epoch)
    return base


def _live(
    n: int,
    world: int,
    rank: int,
    batch_size: int,
    drop_last: bool,
    view: Callable[[], tuple[int, int]],
    epoch: int = 0,
    sampler_drop_last: bool = False,
) -> SharedBatches:
    sampler = GlobalOrderSampler(_base(n, world, rank, epoch, sampler_drop_last))
    return SharedBatches(sampler, batch_size, drop_last, view)


def _nominal(
    n: int, world: int, batch_size: int, drop_last: bool, epoch: int = 0, sampler_drop_last: bool = False
) -> list[list[list[int]]]:
    """Every nominal rank's batches as Lightning's own loader would make them (the reference, from torch alone)."""
    return [
        list(BatchSampler(_base(n, world, r, epoch, sampler_drop_last), batch_size, drop_last)) for r in range(world)
    ]


@pytest.mark.parametrize(("n", "world", "batch_size", "drop_last"), CASES)
@pytest.mark.parametrize("epoch", [0, 3])
@pytest.mark.parametrize("sampler_drop_last", [False, True])
def test_nominal_world_yields_what_torch_batch_sampler_yields(
    n: int, world: int, batch_size: int, drop_last: bool, epoch: int, sampler_drop_last: bool
) -> None:
    # Exact equality, in order: with no rank lost, live fault tolerance must train on the very batches (and the
    # very count of them, which Lightning's progress and resume count) that it would train on without it.
    nominal = _nominal(n, world, batch_size, drop_last, epoch, sampler_drop_last)
    for rank in range(world):
        live = _live(n, world, rank, batch_size, drop_last, lambda r=rank: (r, world), epoch, sampler_drop_last)
        assert len(live) == len(nominal[rank]), rank
        assert list(live) == nominal[rank], rank
        assert live.made == dict.fromkeys(range(len(nominal[rank])), (rank, world))


@pytest.mark.parametrize(("n", "world", "batch_size", "drop_last"), CASES)
def test_smaller_world_shares_are_the_micro_step_split_evenly(
    n: int, world: int, batch_size: int, drop_last: bool
) -> None:
    nominal = _nominal(n, world, batch_size, drop_last)
    steps = len(nominal[0])
    for k_world in range(1, world):
        lives = [_live(n, world, 0, batch_size, drop_last, lambda k=k, w=k_world: (k, w)) for k in range(k_world)]
        yielded = [list(live) for live in lives]  # iterating also loads the epoch's order that share() reads
        for j in range(steps):
            step = Counter(i for r in range(world) for i in nominal[r][j])
            shares = [live.share(j, k, k_world) for k, live in enumerate(lives)]
            # what each member yielded is its share (computed on its own copy of the sampler, as on its own host)
            assert [batches[j] for batches in yielded] == shares, (k_world, j)
            # Multiset equality of the summed shares with the micro-step: nothing dropped, nothing added, and no
            # sample counted by two members more often than the nominal ranks count it (padding repeats some).
            assert sum((Counter(s) for s in shares), Counter()) == step, (k_world, j)
            if max(step.values()) == 1:  # no padding repeat inside this micro-step: the shares are disjoint sets
                assert all(not set(a) & set(b) for x, a in enumerate(shares) for b in shares[x + 1 :]), (k_world, j)
            sizes = [len(s) for s in shares]
            assert max(sizes) - min(sizes) <= 1, (k_world, j, sizes)


@pytest.mark.parametrize(
    ("n", "world", "batch_size", "k_world"),
    [(48, 4, 3, 2), (48, 4, 3, 3), (48, 4, 3, 4), (20, 2, 6, 1), (29, 4, 3, 2)],
)
def test_weight_is_one_for_equal_shares(n: int, world: int, batch_size: int, k_world: int) -> None:
    live = _live(n, world, 0, batch_size, False, lambda: (0, k_world))
    list(live)
    checked = 0
    for j in range(len(live)):
        sizes = {len(live.share(j, k, k_world)) for k in range(k_world)}
        if len(sizes) == 1:
            # exactly 1.0, not approximately: the common case must leave the loss untouched bit for bit
            assert all(live.weight(j, k, k_world) == 1.0 for k in range(k_world)), j
            checked += 1
    assert checked, "no micro-step with equal shares: the case tests nothing"


@pytest.mark.parametrize(
    ("n", "world", "batch_size", "k_world"),
    # 12 per micro-step over 5 members; 8 over 3 (20's and 29's short last micro-steps, and every one of 23's)
    [(48, 4, 3, 5), (20, 2, 6, 3), (29, 4, 3, 3), (23, 2, 4, 3)],
)
def test_weighted_share_means_average_to_the_micro_step_mean(n: int, world: int, batch_size: int, k_world: int) -> None:
    # A per-sample value stands in for each sample's loss: each member averages its share (mean-loss), and the
    # strategy averages the members' weighted results; that must be the mean over the whole micro-step.
    values = torch.rand(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    live = _live(n, world, 0, batch_size, False, lambda: (0, k_world))
    list(live)
    uneven = 0
    for j in range(len(live)):
        step = live.share(j, 0, 1)
        whole = values[step].mean().item()
        shares = [live.share(j, k, k_world) for k in range(k_world)]
        uneven += len({len(s) for s in shares}) > 1
        members = sum(live.weight(j, k, k_world) * values[s].mean().item() for k, s in enumerate(shares)) / k_world
        assert members == pytest.approx(whole, abs=1e-12, rel=0), j
    assert uneven, "no micro-step with uneven shares: the weights are not exercised"


def test_is_stale_follows_the_membership_each_batch_was_made_for() -> None:
    place = (1, 4)
    live = _live(40, 4, 1, 2, False, lambda: place)
    batches = iter(live)
    next(batches)  # micro-step 0, made for (1, 4)
    assert not live.is_stale(0, 1, 4)
    # another rank of the same world, or the same rank of another, is another membership
    assert live.is_stale(0, 0, 4) and live.is_stale(0, 1, 3)
    place = (1, 3)  # a rank was lost: this member is now rank 1 of 3
    next(batches)  # micro-step 1, made for (1, 3)
    assert live.is_stale(0, 1, 3), "micro-step 0 was made for (1, 4)"
    assert not live.is_stale(1, 1, 3)
    assert live.is_stale(1, 1, 4), "micro-step 1 was made for (1, 3)"
    # micro-step 2 was never yielded (the loader has not prefetched it): nothing to train on, so stale. Asked
    # last because is_stale forgets the micro-steps before j - 1 (the loop has consumed them).
    assert live.is_stale(2, 1, 3) and live.is_stale(2, 1, 4)
    # a new iteration (the next epoch) forgets what the last one made
    place = (1, 4)
    next(iter(live))
    assert live.made == {0: (1, 4)}
    assert live.is_stale(1, 1, 3)


@pytest.mark.parametrize(
    ("n", "world", "batch_size", "drop_last"), [(40, 2, 3, False), (50, 4, 3, True), (23, 2, 4, False)]
)
@pytest.mark.parametrize("done", [1, 2])
@pytest.mark.parametrize("k_world", [None, 1, 3])
def test_resume_starts_at_the_saved_micro_step(
    n: int, world: int, batch_size: int, drop_last: bool, done: int, k_world: int | None
) -> None:
    epoch, rank = 2, 1
    members = world if k_world is None else k_world

    def view() -> tuple[int, int]:
        return (rank if k_world is None else members - 1, members)

    # the state an interrupted run saved after `done` micro-steps of `epoch`, from a sampler of its own
    saver = GlobalOrderSampler(_base(n, world, 0, epoch))
    state = saver.state(done, batch_size, epoch_done=False)
    assert state["position"] == done * batch_size * world

    uninterrupted = _live(n, world, rank, batch_size, drop_last, view, epoch)
    expected = list(uninterrupted)

    resumed = _live(n, world, rank, batch_size, drop_last, view, epoch=0)  # the fresh run's sampler is at epoch 0
    assert resumed.sampler.resume(state, batch_size) == done
    got = list(resumed)
    assert got, "the case leaves no micro-step after the resume position"
    assert got == expected[done:]
    assert sorted(resumed.made) == list(range(done, len(uninterrupted)))
    assert len(resumed) == len(uninterrupted), "len is the whole epoch: Lightning counts the resumed epoch's batches"
    # the saved micro-steps were never yielded in this run: stale, so never trained on from a prefetched batch
    assert resumed.is_stale(0, *view())

    # the next epoch starts at its beginning again
    resumed.sampler.set_epoch(epoch + 1)
    list(resumed)
    assert min(resumed.made) == 0


def test_membership_change_mid_epoch_switches_to_the_new_shares() -> None:
    n, world, batch_size = 50, 4, 3
    place = [2, 4]  # mutable: the strategy's membership changes under the running iteration
    live = _live(n, world, 2, batch_size, False, lambda: (place[0], place[1]))
    nominal = _nominal(n, world, batch_size, False)[2]
    got: list[list[int]] = []
    for j, batch in enumerate(live):
        got.append(batch)
        if j == 1:
            place[:] = [1, 3]  # a rank below this one was lost: it is rank 1 of 3 from micro-step 2 on
        elif j == 3:
            place[:] = [2, 4]  # a replacement brought the world back from micro-step 4 on
    memberships = [(2, 4)] * 2 + [(1, 3)] * 2 + [(2, 4)] * (len(live) - 4)
    assert live.made == dict(enumerate(memberships))
    assert got == [live.share(j, *m) for j, m in enumerate(memberships)]
    # the shares are not trivially the nominal batches: 12 entries over 3 members are 4 each, not 3
    assert [len(b) for b in got[2:4]] == [4, 4]
    assert got[:2] == nominal[:2] and got[4:] == nominal[4:]


def test_install_refuses_a_loader_without_the_global_order_naming_the_strategy_and_the_feature() -> None:
    from torch.utils.data import DataLoader, RandomSampler

    data = list(range(12))
    loader = DataLoader(data, batch_size=2, sampler=RandomSampler(data))
    with pytest.raises(ValueError) as refusal:
        SharedBatches.install(loader, lambda: (0, 2), "BucketedDDPStrategy", "rebalance=True")
    message = str(refusal.value)
    for said in ("BucketedDDPStrategy: rebalance=True shares out each global batch", "RandomSampler", "DataLoader("):
        assert said in message, (said, message)
    # the loader Lightning builds (its DistributedSampler made a GlobalOrderSampler) is taken, its batches ours
    ordered = DataLoader(data, batch_size=2, sampler=GlobalOrderSampler(_base(12, 2, 1)))
    batches = SharedBatches.install(ordered, lambda: (1, 2), "BucketedDDPStrategy", "rebalance=True")
    assert ordered.batch_sampler is batches
    assert [b.tolist() for b in ordered] == _nominal(12, 2, 2, False)[1]
