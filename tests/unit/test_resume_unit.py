"""Exact resume in one process: the global-order sampler against torch's ``DistributedSampler``, its resume
position, the loader it makes stateful, and the RNG states a checkpoint carries. The 2-rank resumes (signal
and checkpoint, with and without DataLoader workers) are ``tests/multiprocess/test_exact_resume.py``."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from lightning.fabric.utilities.types import _Stateful
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, TensorDataset

from lightning_sync import comms
from lightning_sync.resume import (
    POSITIONS,
    ExactResume,
    host_rng_state,
    rng_state,
    set_host_rng_state,
    set_rng_state,
    stash_positions,
    unstash_positions,
)
from lightning_sync.sampler import GlobalOrderSampler


def _distributed(n: int, world: int, rank: int, **kw: object) -> DistributedSampler:
    return DistributedSampler(range(n), num_replicas=world, rank=rank, **kw)  # type: ignore[arg-type]


class _Loop:
    """A training loop as the data position sees it (the TrainingLoop protocol): ``batches`` of this epoch
    trained on each rank, ``accumulate`` micro-batches per step; records what a resume asks it to count."""

    def __init__(self, batches: int = 0, done: bool = False, accumulate: int = 1) -> None:
        self.batches, self.done, self.micro = batches, done, accumulate
        self.restarted: list[int] = []

    def trained(self) -> tuple[int, bool]:
        return self.batches, self.done

    def accumulate(self) -> int:
        return self.micro

    def restart_at(self, batches: int) -> None:
        self.restarted.append(batches)


@pytest.mark.parametrize("n", [23, 24, 25])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize(("shuffle", "drop_last"), [(True, False), (False, False), (True, True)])
def test_the_global_order_is_what_distributed_sampler_yields(
    n: int, world: int, shuffle: bool, drop_last: bool
) -> None:
    for rank in range(world):
        base = _distributed(n, world, rank, shuffle=shuffle, seed=7, drop_last=drop_last)
        ours = GlobalOrderSampler(_distributed(n, world, rank, shuffle=shuffle, seed=7, drop_last=drop_last))
        for epoch in (0, 3):
            base.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert list(ours) == list(base) and len(ours) == len(base)


def test_a_resume_position_skips_a_prefix_of_the_global_order_in_that_epoch_only() -> None:
    world, batch = 3, 2
    samplers = [GlobalOrderSampler(_distributed(40, world, r, shuffle=True, seed=1)) for r in range(world)]
    full = []
    for s in samplers:
        s.set_epoch(4)
        full.append(list(s))
    # 3 batches of 2 trained on every rank: the first 18 entries of the epoch's order are consumed
    state = samplers[0].state(batches=3, batch_size=batch, epoch_done=False)
    assert state == {
        "epoch": 4,
        "position": 18,
        "world_size": 3,
        "dataset_size": 40,
        "seed": 1,
        "batch_size": 2,
        "global_batch": 6,
        "epoch_done": False,
    }
    for r, s in enumerate(samplers):
        fresh = GlobalOrderSampler(_distributed(40, world, r, shuffle=True, seed=1))
        assert fresh.resume(state, batch) == 3
        assert fresh.epoch == 4  # set before any iterator exists: workers prefetch at creation
        assert list(fresh) == full[r][3 * batch :]
        assert len(fresh) == len(full[r])  # Lightning counts the resumed epoch's batches from the whole
        assert list(fresh) == full[r][3 * batch :]  # the same epoch again (a second iterator) resumes alike
        fresh.set_epoch(5)
        s.set_epoch(5)
        assert list(fresh) == list(s)  # the next epoch is whole


def test_a_finished_epoch_resumes_at_the_start_of_the_next_at_any_world_size() -> None:
    state = GlobalOrderSampler(_distributed(24, 2, 0, seed=3)).state(batches=6, batch_size=2, epoch_done=True)
    assert state["epoch"] == 1 and state["position"] == 0
    other = GlobalOrderSampler(_distributed(24, 3, 2, seed=3))
    other.resume(state)
    base = _distributed(24, 3, 2, seed=3)
    base.set_epoch(1)
    assert list(other) == list(base)


def _global_batches(world: int, batch: int, accumulate: int, state: dict | None, steps: int) -> list[list[int]]:
    """The sample ids of ``steps`` global batches trained by ``world`` ranks of ``batch`` x ``accumulate``
    micro-batches from ``state`` (None: the epoch's start), each sorted: a global batch is a set."""
    ranks = []
    for r in range(world):
        s = GlobalOrderSampler(_distributed(50, world, r, shuffle=True, seed=3))
        if state is not None:
            s.resume(state, batch, accumulate)
        ranks.append(list(s))
    per_step = batch * accumulate
    return [sorted(i for order in ranks for i in order[n * per_step : (n + 1) * per_step]) for n in range(steps)]


def test_a_mid_epoch_position_resplits_to_another_world_size_with_the_same_global_batch() -> None:
    # global batch 12 = 2 x world 2 x accumulate 3 = 2 x 3 x 2 = 2 x 1 x 6 = 3 x 2 x 2: after 2 steps at
    # world 2 every later global batch is the same set of samples as in the uninterrupted world-2 run
    whole = _global_batches(2, 2, 3, None, 4)
    state = GlobalOrderSampler(_distributed(50, 2, 0, shuffle=True, seed=3)).state(6, 2, False, accumulate=3)
    assert (state["position"], state["global_batch"]) == (24, 12)
    for world, batch, accumulate in ((3, 2, 2), (1, 2, 6), (2, 3, 2), (2, 2, 3)):
        assert _global_batches(world, batch, accumulate, state, 2) == whole[2:], (world, batch, accumulate)
        # the trained batches each rank of the new shape counts: 24 samples in batches of batch x world
        s = GlobalOrderSampler(_distributed(50, world, 0, shuffle=True, seed=3))
        assert s.resume(state, batch, accumulate) == 24 // (batch * world)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dataset_size": 30}, r"24 samples, seed 3; this run has world 2 x batch 2 \(global batch 8\), 30 samples"),
        ({"seed": 4}, r"seed 3; this run has .* seed 4"),
        # another world size must hold the global batch; the accumulation that would is named
        ({"world_size": 4}, r"\(global batch 8\), 24 samples.*\(global batch 16\).*accumulate 1 micro-batches"),
        ({"world_size": 3}, r"global batch 12.*Resume with the checkpoint's settings, or from .* an epoch's end"),
        ({"batch_size": 4}, r"world 2 x batch 4 \(global batch 16\).*accumulate 1 micro-batches of 4 on 2"),
    ],
)
def test_a_mid_epoch_position_needs_the_same_data_and_global_batch(change: dict[str, int], message: str) -> None:
    sampler = GlobalOrderSampler(_distributed(24, 2, 0, seed=3))
    state = sampler.state(batches=2, batch_size=2, epoch_done=False, accumulate=2)
    assert state["global_batch"] == 8
    n, world, seed = change.get("dataset_size", 24), change.get("world_size", 2), change.get("seed", 3)
    batch = change.get("batch_size", 2)
    with pytest.raises(ValueError, match=r"stopped inside epoch 0 at sample 8 .*" + message):
        GlobalOrderSampler(_distributed(n, world, 0, seed=seed)).resume(state, batch, accumulate=2)


def test_a_position_saved_without_its_global_batch_resumes_at_its_own_world_size_only() -> None:
    # what a checkpoint of an earlier version holds: no batch shape
    state = {"epoch": 0, "position": 8, "world_size": 2, "dataset_size": 24, "seed": 3}
    assert GlobalOrderSampler(_distributed(24, 2, 1, seed=3)).resume(state, 2) == 2
    with pytest.raises(ValueError, match=r"world 2 x batch \? \(global batch \?\).*Resume with the checkpoint"):
        GlobalOrderSampler(_distributed(24, 4, 1, seed=3)).resume(state, 2)


def test_a_position_that_is_no_whole_global_batch_is_refused() -> None:
    state = {"epoch": 0, "position": 5, "world_size": 2, "dataset_size": 24, "seed": 0}
    with pytest.raises(ValueError, match="position 5 is not a multiple of the world size 2 x batch 1 within the ep"):
        GlobalOrderSampler(_distributed(24, 2, 0)).resume(state)


def _loader(**kw: object) -> DataLoader:
    ds = TensorDataset(torch.arange(32))
    return DataLoader(ds, batch_size=4, sampler=_distributed(32, 2, 1, seed=5), **kw)


def test_install_makes_a_training_loader_stateful_and_resumes_it() -> None:
    loop = _Loop(batches=3)
    loader = ExactResume.install(_loader(), loop)
    assert isinstance(loader, _Stateful) and isinstance(loader, DataLoader)
    assert isinstance(loader.batch_sampler.sampler, GlobalOrderSampler)
    loader.sampler.set_epoch(2)  # what Lightning calls: the DistributedSampler, which the new sampler reads
    whole = [b[0].tolist() for b in loader]
    state = loader.state_dict()
    assert state["epoch"] == 2 and state["position"] == 3 * 4 * 2
    again = _Loop()
    resumed = ExactResume.install(_loader(), again)
    resumed.load_state_dict(state)
    assert [b[0].tolist() for b in resumed] == whole[3:] and again.restarted == [3]
    loop.done = True
    assert loader.state_dict()["epoch"] == 3 and loader.state_dict()["position"] == 0


def _checkpoint(states: list[dict[str, object]]) -> dict[str, object]:
    return {"loops": {"fit_loop": {"state_dict": {"combined_loader": states}}}, "global_step": 3}


def test_positions_travel_beside_lightnings_loop_state_and_come_back() -> None:
    """Lightning refuses loader states for loaders that keep none (a plain ddp run resuming from our checkpoint),
    so ours travel under their own key, and go back before Lightning restores the loops."""
    ours = ExactResume.install(_loader(), _Loop(batches=3)).state_dict()
    checkpoint = _checkpoint([ours])
    stash_positions(checkpoint)
    assert checkpoint[POSITIONS] == [ours] and checkpoint["loops"]["fit_loop"]["state_dict"] == {}
    unstash_positions(checkpoint)
    assert checkpoint == _checkpoint([ours])
    theirs = _checkpoint([{"mine": 1}, ours])  # a stateful loader of the user's: Lightning's to restore, all of it
    stash_positions(theirs)
    assert theirs == _checkpoint([{"mine": 1}, ours])
    unstash_positions(theirs)  # nothing to put back
    assert theirs == _checkpoint([{"mine": 1}, ours])


def test_install_leaves_loaders_it_cannot_resume_exactly_untouched() -> None:
    ds = TensorDataset(torch.arange(8))
    custom = DataLoader(ds, batch_size=2, sampler=RandomSampler(ds))
    batch_sampler = DataLoader(ds, batch_sampler=BatchSampler(_distributed(8, 2, 0), 2, False))

    class Stateful(DataLoader):
        def state_dict(self) -> dict:
            return {"mine": 1}

        def load_state_dict(self, state: dict) -> None:
            pass

    own = Stateful(ds, batch_size=2, sampler=_distributed(8, 2, 0))
    for loader in (custom, own, [1, 2]):
        sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
        assert ExactResume.install(loader, _Loop()) is loader
        assert getattr(getattr(loader, "batch_sampler", None), "sampler", None) is sampler
    assert own.state_dict() == {"mine": 1} and not isinstance(custom, _Stateful)
    # a DistributedSampler behind a user's BatchSampler (batch_size None on the loader) is resumed too: the
    # batch sampler's own batch size counts
    assert isinstance(ExactResume.install(batch_sampler, _Loop()), _Stateful)


def test_host_rng_state_round_trips_python_and_numpy_with_cached_gaussians() -> None:
    random.seed(3)
    np.random.seed(4)
    random.gauss(0, 1)  # both generators now hold a cached second Gaussian, part of the state
    np.random.standard_normal()
    state = host_rng_state()
    assert state.dtype == torch.float64 and state.numel() == 1255
    first = (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.standard_normal())
    random.seed(99)
    np.random.seed(99)
    set_host_rng_state(state)
    assert (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.standard_normal()) == first
    with pytest.raises(ValueError, match="holds 1255 numbers, got 3"):
        set_host_rng_state(torch.zeros(3))


def test_rng_states_restore_torch_python_and_numpy_and_cuda_on_cuda_only(caplog: pytest.LogCaptureFixture) -> None:
    cpu = torch.device("cpu")
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    state = rng_state(cpu)
    assert state["cuda"] is None
    first = (float(torch.rand(())), random.random(), float(np.random.random()))
    torch.manual_seed(9)
    set_rng_state(state, cpu)
    assert (float(torch.rand(())), random.random(), float(np.random.random())) == first
    # a CUDA state met by a CPU run is reported, never applied to a device that does not exist
    caplog.set_level(logging.INFO, logger="lightning_sync")
    set_rng_state({**state, "cuda": torch.zeros(16, dtype=torch.uint8)}, cpu)
    assert "holds a CUDA RNG state but this run is on cpu: not restored" in caplog.text


def test_rank_states_are_taken_per_rank_and_another_world_size_continues_the_rng_of_the_ranks_both_have(
    caplog: pytest.LogCaptureFixture,
) -> None:
    states = ExactResume.gather(comms.CommContext(), {"mine": 1})  # no process group: this process alone
    assert states is not None and len(states) == 1 and states[0]["mine"] == 1
    resume = ExactResume()
    assert resume.take(states, rank=0, world_size=1) == states[0]
    torch.manual_seed(0)
    two = [{"rng": rng_state(torch.device("cpu")), "mine": r} for r in range(2)]
    first = float(torch.rand(()))
    caplog.set_level(logging.INFO, logger="lightning_sync")
    # a strategy's own entry belongs to a rank of the other run: none; rank 1's RNG streams go on
    assert resume.take(two, rank=0, world_size=3) is None  # rank 0 says so
    assert resume.take(two, rank=1, world_size=3) is None
    assert "holds the RNG states of 2 ranks, this run has 3: ranks 0-1 continue their streams, ranks 2-2 keep" in (
        caplog.text
    )
    torch.manual_seed(9)
    resume.restore_rng(torch.device("cpu"))
    assert float(torch.rand(())) == first
    assert resume.take(two, rank=2, world_size=3) is None
    torch.manual_seed(9)
    expected = float(torch.rand(()))
    torch.manual_seed(9)
    resume.restore_rng(torch.device("cpu"))  # nothing taken for rank 2: its own seeding stands
    assert float(torch.rand(())) == expected
    assert resume.take(None, rank=0, world_size=1) is None


def test_a_distributed_sampler_subclass_keeps_its_own_order_in_training_and_evaluation() -> None:
    from lightning_sync.sampler import shard_for_evaluation

    class Reversed(DistributedSampler):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return reversed(list(super().__iter__()))

    ds = TensorDataset(torch.arange(9))
    loader = DataLoader(ds, batch_size=2, sampler=Reversed(ds, num_replicas=2, rank=0, shuffle=False))
    sampler = loader.batch_sampler.sampler
    assert ExactResume.install(loader, _Loop()) is loader and not isinstance(loader, _Stateful)
    assert shard_for_evaluation(loader) == 0 and loader.batch_sampler.sampler is sampler


_ATTRIBUTES = ("dataset", "num_replicas", "rank", "epoch", "shuffle", "seed", "drop_last", "num_samples", "total_size")


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("rank", [0, 2])
def test_both_samplers_are_distributed_samplers_with_the_attributes_of_lightnings(rank: int, drop_last: bool) -> None:
    """``isinstance(sampler, DistributedSampler)`` holds, and every attribute means what it means on the
    sampler each one stands for: torch's in training, Lightning's unrepeated one in evaluation."""
    from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler

    from lightning_sync.sampler import EvaluationShardSampler

    base = _distributed(25, 3, rank, shuffle=True, seed=7, drop_last=drop_last)
    training = GlobalOrderSampler(base)
    # Lightning's unrepeated sampler shuffles by the epoch alone, ours by seed + epoch (the training order's
    # permutation): at seed 0 both orders are one (Lightning evaluates unshuffled anyway)
    unrepeated = UnrepeatedDistributedSampler(
        range(25),  # type: ignore[arg-type]
        num_replicas=3,
        rank=rank,
        shuffle=True,
        seed=0,
        drop_last=drop_last,  # kept as an attribute; its sizes are the unrepeated shard's either way
    )
    evaluation = EvaluationShardSampler(_distributed(25, 3, rank, shuffle=True, seed=0, drop_last=drop_last))
    for ours, theirs in ((training, base), (evaluation, unrepeated)):
        assert isinstance(ours, DistributedSampler)
        for epoch in (0, 3):
            ours.set_epoch(epoch)  # what Lightning and user code call, through the isinstance check
            theirs.set_epoch(epoch)
            assert {a: getattr(ours, a) for a in _ATTRIBUTES} == {a: getattr(theirs, a) for a in _ATTRIBUTES}
            assert (len(ours), list(ours)) == (len(theirs), list(theirs))
    # attributes are the wrapped sampler's, written through too: the order follows what a user sets
    training.epoch = 5
    assert base.epoch == 5 and list(training) == list(base.__iter__())
    training.shuffle = False
    assert list(training) == list(DistributedSampler.__iter__(base))


def test_our_samplers_are_not_replaced_again() -> None:
    """Once in place they are DistributedSampler subclasses, which evaluation sharding and resume leave alone
    (they wrap only the plain ``DistributedSampler``): a second pass changes nothing."""
    from lightning_sync.sampler import shard_for_evaluation

    ds = TensorDataset(torch.arange(32))
    loader = DataLoader(ds, batch_size=4, sampler=_distributed(32, 2, 1, seed=5))
    assert shard_for_evaluation(loader) == 0
    shards = loader.batch_sampler.sampler
    assert shard_for_evaluation(loader) == 0 and loader.batch_sampler.sampler is shards
    assert ExactResume.install(loader, _Loop()) is loader and loader.batch_sampler.sampler is shards
    training = DataLoader(ds, batch_size=4, sampler=_distributed(32, 2, 1, seed=5))
    ExactResume.install(training, _Loop())
    ordered = training.batch_sampler.sampler
    assert isinstance(ordered, GlobalOrderSampler)
    assert shard_for_evaluation(training) == 0 and training.batch_sampler.sampler is ordered
