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
from lightning_sync.resume import ExactResume, host_rng_state, rng_state, set_host_rng_state, set_rng_state
from lightning_sync.sampler import GlobalOrderSampler


def _distributed(n: int, world: int, rank: int, **kw: object) -> DistributedSampler:
    return DistributedSampler(range(n), num_replicas=world, rank=rank, **kw)  # type: ignore[arg-type]


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
    assert state == {"epoch": 4, "position": 18, "world_size": 3, "dataset_size": 40, "seed": 1}
    for r, s in enumerate(samplers):
        fresh = GlobalOrderSampler(_distributed(40, world, r, shuffle=True, seed=1))
        fresh.resume(state)
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


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"world_size": 3}, r"'world_size': 2}; this run has .*'world_size': 3}"),
        ({"dataset_size": 30}, r"'dataset_size': 24.*this run has \{'dataset_size': 30"),
        ({"seed": 4}, r"'seed': 3.*'seed': 4"),
    ],
)
def test_a_mid_epoch_position_needs_the_same_world_dataset_and_seed(change: dict[str, int], message: str) -> None:
    state = GlobalOrderSampler(_distributed(24, 2, 0, seed=3)).state(batches=2, batch_size=2, epoch_done=False)
    n, world, seed = change.get("dataset_size", 24), change.get("world_size", 2), change.get("seed", 3)
    with pytest.raises(ValueError, match=r"stopped inside epoch 0 at sample 8 .*" + message):
        GlobalOrderSampler(_distributed(n, world, 0, seed=seed)).resume(state)


def test_a_position_that_is_no_whole_global_batch_is_refused() -> None:
    state = {"epoch": 0, "position": 5, "world_size": 2, "dataset_size": 24, "seed": 0}
    with pytest.raises(ValueError, match="position 5 is not a multiple of the world size 2 within the epoch's 24"):
        GlobalOrderSampler(_distributed(24, 2, 0)).resume(state)


def _loader(**kw: object) -> DataLoader:
    ds = TensorDataset(torch.arange(32))
    return DataLoader(ds, batch_size=4, sampler=_distributed(32, 2, 1, seed=5), **kw)


def test_install_makes_a_training_loader_stateful_and_resumes_it() -> None:
    trained = {"batches": 3, "done": False}
    loader = ExactResume.install(_loader(), lambda: (trained["batches"], trained["done"]))
    assert isinstance(loader, _Stateful) and isinstance(loader, DataLoader)
    assert isinstance(loader.batch_sampler.sampler, GlobalOrderSampler)
    loader.sampler.set_epoch(2)  # what Lightning calls: the DistributedSampler, which the new sampler reads
    whole = [b[0].tolist() for b in loader]
    state = loader.state_dict()
    assert state["epoch"] == 2 and state["position"] == 3 * 4 * 2
    resumed = ExactResume.install(_loader(), lambda: (0, False))
    resumed.load_state_dict(state)
    assert [b[0].tolist() for b in resumed] == whole[3:]
    trained["done"] = True
    assert loader.state_dict()["epoch"] == 3 and loader.state_dict()["position"] == 0


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
        assert ExactResume.install(loader, lambda: (0, False)) is loader
        assert getattr(getattr(loader, "batch_sampler", None), "sampler", None) is sampler
    assert own.state_dict() == {"mine": 1} and not isinstance(custom, _Stateful)
    # a DistributedSampler behind a user's BatchSampler (batch_size None on the loader) is resumed too: the
    # batch sampler's own batch size counts
    assert isinstance(ExactResume.install(batch_sampler, lambda: (0, False)), _Stateful)


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


def test_rank_states_are_taken_per_rank_and_dropped_for_another_world_size(caplog: pytest.LogCaptureFixture) -> None:
    states = ExactResume.gather(comms.CommContext(), {"mine": 1})  # no process group: this process alone
    assert states is not None and len(states) == 1 and states[0]["mine"] == 1
    resume = ExactResume()
    assert resume.take(states, rank=0, world_size=1) == states[0]
    caplog.set_level(logging.INFO, logger="lightning_sync")
    assert resume.take(states * 2, rank=0, world_size=3) is None
    assert "holds the RNG states of 2 ranks, this run has 3" in caplog.text
    assert resume.take(None, rank=0, world_size=1) is None


def test_a_distributed_sampler_subclass_keeps_its_own_order_in_training_and_evaluation() -> None:
    from lightning_sync.sampler import shard_for_evaluation

    class Reversed(DistributedSampler):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return reversed(list(super().__iter__()))

    ds = TensorDataset(torch.arange(9))
    loader = DataLoader(ds, batch_size=2, sampler=Reversed(ds, num_replicas=2, rank=0, shuffle=False))
    sampler = loader.batch_sampler.sampler
    assert ExactResume.install(loader, lambda: (0, False)) is loader and not isinstance(loader, _Stateful)
    assert shard_for_evaluation(loader) == 0 and loader.batch_sampler.sampler is sampler
