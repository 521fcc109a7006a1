"""``ReplicaDriftCheck`` in one process: arguments, the strategies it refuses, the exact checksum, and the
decision from (faked) gathered fingerprints. The 2-rank runs: ``tests/multiprocess/test_replica_drift.py``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from torch import nn

from lightning_sync import (
    AsyncParameterServerStrategy,
    BucketedDDPStrategy,
    DiLoCoStrategy,
    HogwildStrategy,
    LocalSGDStrategy,
    ShardedStrategy,
    comms,
)
from lightning_sync.diagnostics import ReplicaDriftCheck, drift
from lightning_sync.diagnostics.drift import checksum, value_fingerprint


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_steps": 0}, "every_n_steps must be an int >= 1, got 0"),
        ({"every_n_steps": -3}, "every_n_steps must be an int >= 1, got -3"),
        ({"every_n_steps": True}, "every_n_steps must be an int >= 1, got True"),
        ({"every_n_steps": 2.0}, "every_n_steps must be an int >= 1, got 2.0"),
        ({"every_n_steps": None}, "every_n_steps must be an int >= 1, got None"),
        ({"action": "ignore"}, r"action must be one of \['raise', 'warn'\], got 'ignore'"),
        ({"action": "RAISE"}, r"action must be one of \['raise', 'warn'\], got 'RAISE'"),
        ({"action": None}, r"action must be one of \['raise', 'warn'\], got None"),
        ({"buffers": "yes"}, "buffers must be True or False, got 'yes'"),
    ],
)
def test_bad_arguments_are_named_with_the_allowed_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReplicaDriftCheck(**kwargs)


@pytest.mark.parametrize(
    ("strategy", "name", "why"),
    [
        (LocalSGDStrategy(), "local_sgd", "every rank steps its own replica between averages"),
        (DiLoCoStrategy(), "diloco", "the replicas agree only right after an outer step"),
        (AsyncParameterServerStrategy(), "async_ps", "stale copies of the server's parameters"),
        (HogwildStrategy(), "hogwild", "one shared-memory model"),
        (FSDPStrategy(), "fsdp", "it shards the parameters"),
    ],
    ids=["local_sgd", "diloco", "async_ps", "hogwild", "fsdp"],
)
def test_periodic_async_and_foreign_sharded_strategies_are_refused_at_setup(strategy: Any, name: str, why: str) -> None:
    with pytest.raises(
        ValueError,
        match=rf"does not support the '{name}' strategy \({type(strategy).__name__}\): "
        rf".*{why}.*It checks synchronous strategies",
    ):
        ReplicaDriftCheck().setup(SimpleNamespace(strategy=strategy), None, "fit")  # type: ignore[arg-type]
    # evaluation only (trainer.validate / test): the check never runs there, so nothing is refused
    ReplicaDriftCheck().setup(SimpleNamespace(strategy=strategy), None, "validate")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "strategy",
    [
        BucketedDDPStrategy(),
        DDPStrategy(),
        ShardedStrategy(stage=1),
        ShardedStrategy(stage=2),
        ShardedStrategy(stage=3),
    ],
)
def test_synchronous_strategies_are_accepted(strategy: Any) -> None:
    ReplicaDriftCheck().setup(SimpleNamespace(strategy=strategy), None, "fit")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.uint8,
        torch.bool,
        torch.complex64,
    ],
)
def test_one_flipped_bit_of_one_element_changes_the_checksum(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(37, 11, generator=g) * 1e3).to(dtype) if dtype != torch.bool else torch.rand(37, 11) > 0.5
    base = checksum(t)
    assert torch.equal(base, checksum(t.clone()))
    bits = t.view(torch.uint8).clone()
    for flat_byte in (0, 5, bits.numel() - 1):  # the lowest bit of the first, of a middle, of the last byte
        flipped = bits.clone().reshape(-1)
        flipped[flat_byte] ^= 1
        assert not torch.equal(checksum(flipped.view_as(bits).view(dtype)), base), flat_byte


def test_a_tiny_change_next_to_large_values_is_still_seen() -> None:
    # a float64 sum of these would lose the last bit of the 1e-30 (its ulp is ~1e-13 next to 1e3 values)
    t = torch.full((1000,), 1e3, dtype=torch.float32)
    t[17] = 1e-30
    u = t.clone()
    u[17] = torch.nextafter(u[17], torch.tensor(1.0))
    assert t.double().sum() == u.double().sum()
    assert not torch.equal(checksum(t), checksum(u))


def test_swapped_elements_change_the_position_weighted_sum_and_layout_does_not_matter() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    u = t.clone()
    u[0, 1], u[2, 3] = t[2, 3], t[0, 1]
    a, b = checksum(t), checksum(u)
    assert a[0] == b[0] and a[1] != b[1]
    wide = torch.zeros(3, 8)
    wide[:, ::2] = t  # a non-contiguous view with the same values
    assert torch.equal(checksum(wide[:, ::2]), a)


def test_the_checksum_is_exact_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    whole = checksum(t)
    monkeypatch.setattr(drift, "_CHUNK", 7)  # many chunks, the last one partial
    assert torch.equal(checksum(t), whole)


def test_the_fingerprint_skips_norm_running_statistics_and_what_it_is_told_to() -> None:
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    net.register_buffer("table", torch.arange(5.0))
    items = [item for item, _ in value_fingerprint(net)]
    assert items == [
        "parameter 0.weight",
        "parameter 0.bias",
        "parameter 1.weight",
        "parameter 1.bias",
        "buffer table",
        "buffer 1.num_batches_tracked",
    ]
    assert [item for item, _ in value_fingerprint(net, buffers=False)] == items[:4]
    assert [item for item, _ in value_fingerprint(net, skip={id(net[0].weight), id(net.table)})] == [
        "parameter 0.bias",
        "parameter 1.weight",
        "parameter 1.bias",
        "buffer 1.num_batches_tracked",
    ]
    assert value_fingerprint(net)[0][1].startswith("shape (3, 4), torch.float32, checksum ")


class _Module(nn.Linear):
    def __init__(self) -> None:
        super().__init__(3, 2)
        self.logged: list[tuple[str, float]] = []

    def log(self, name: str, value: float, **kwargs: Any) -> None:
        self.logged.append((name, value))


def _trainer(step: int, accumulate: bool = False, world: int = 3) -> Any:
    loop = SimpleNamespace(epoch_loop=SimpleNamespace(_should_accumulate=lambda: accumulate))
    return SimpleNamespace(global_step=step, world_size=world, strategy=BucketedDDPStrategy(), fit_loop=loop)


def _fake_gather(monkeypatch: pytest.MonkeyPatch, altered: list[set[int]]) -> list[list[int]]:
    """Each call returns 3 ranks' fingerprints: this process's, with the ranks in ``altered.pop(0)`` changed
    at their second item. Returns the altered ranks of each call so far."""
    calls: list[list[int]] = []

    def gather(mine: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
        bad = altered.pop(0)
        calls.append(sorted(bad))
        return [
            [(item, desc + (" (changed)" if r in bad and i == 1 else "")) for i, (item, desc) in enumerate(mine)]
            for r in range(3)
        ]

    # the strategy's communication context is where the callback gathers
    monkeypatch.setattr(comms.CommContext, "all_gather_object", lambda self, mine: gather(mine))
    return calls


def test_the_majority_is_the_reference_and_every_rank_decides_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gather(monkeypatch, [{0}])
    check, module = ReplicaDriftCheck(every_n_steps=2), _Module()
    with pytest.raises(
        RuntimeError,
        match=r"^replicas diverged at global step 4: rank 0 differs from ranks \[1, 2\]; "
        r"first difference: parameter bias: rank 0 has .* \(changed\); rank 1 has ",
    ):
        check.on_train_batch_end(_trainer(4), module, None, None, 0)
    assert check.first_divergent_step == 4 and check.divergences == [(4, [0], "parameter bias")]
    assert module.logged == [("replica_drift/diverged", 1.0)]


def test_checks_only_on_step_boundaries_every_n_steps_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_gather(monkeypatch, [set()] * 3)
    check, module = ReplicaDriftCheck(every_n_steps=3, action="warn"), _Module()
    for step, accumulate in [
        (1, False),
        (2, True),
        (3, True),
        (3, False),
        (3, False),
        (4, False),
        (6, False),
        (9, False),
    ]:
        check.on_train_batch_end(_trainer(step, accumulate), module, None, None, 0)
    assert check.checked_steps == [3, 6, 9] and len(calls) == 3 and check.compared == 2
    assert module.logged == [("replica_drift/diverged", 0.0)] * 3
    check.on_train_batch_end(_trainer(12, world=1), module, None, None, 0)  # one process: nothing to compare
    assert check.checked_steps == [3, 6, 9]


def test_warn_once_per_divergence(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gather(monkeypatch, [set(), {2}, {2}, set(), {1, 2}])
    check, module = ReplicaDriftCheck(every_n_steps=1, action="warn"), _Module()

    def five_steps() -> None:
        for step in range(1, 6):
            check.on_train_batch_end(_trainer(step), module, None, None, 0)

    with pytest.warns(UserWarning) as record:
        five_steps()
    ours = [str(w.message) for w in record if "replicas diverged" in str(w.message)]
    assert len(ours) == 2, ours
    assert ours[0].startswith("replicas diverged at global step 2: rank 2 differs from ranks [0, 1]; ")
    # ranks 1 and 2 changed alike: they are the majority now, and rank 0 the one that differs
    assert ours[1].startswith("replicas diverged at global step 5: rank 0 differs from ranks [1, 2]; ")
    assert check.first_divergent_step == 2
    assert check.divergences == [(2, [2], "parameter bias"), (5, [0], "parameter bias")]
    assert [v for _, v in module.logged] == [0.0, 1.0, 1.0, 0.0, 1.0]
