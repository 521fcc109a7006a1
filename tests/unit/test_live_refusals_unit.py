"""Under the fault-tolerance agent (its member id in the environment) only ``bucketed_ddp``, ``local_sgd``,
``diloco`` and ZeRO are built: every other strategy refuses at construction, before Lightning could start ranks of
its own, naming those that work. And what each keeps for a replacement and for a replay: ``bucketed_ddp`` its
compressor's state, the periodic strategies the whole period's start."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_sync.comms.membership_keys import ENV_MEMBER
from lightning_sync.strategies import (
    AsyncParameterServerStrategy,
    BucketedDDPStrategy,
    DiLoCoStrategy,
    HogwildStrategy,
    LocalSGDStrategy,
    ShardedStrategy,
)


@pytest.mark.parametrize("build", [HogwildStrategy, AsyncParameterServerStrategy], ids=["hogwild", "async_ps"])
def test_a_strategy_that_cannot_follow_the_membership_refuses_the_agents_process(
    build: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_MEMBER, "n0s1i0")
    pattern = (
        r"does not keep training through a lost rank yet.*BucketedDDPStrategy.*LocalSGDStrategy, DiLoCoStrategy or "
        r"ShardedStrategy \(zero1/2/3\)"
    )
    with pytest.raises(ValueError, match=pattern):
        build()  # type: ignore[operator]


def test_bucketed_ddp_follows_the_agent_by_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    assert BucketedDDPStrategy().live is None  # no agent: Lightning's own process group
    monkeypatch.setenv(ENV_MEMBER, "n0s1i0")
    strategy = BucketedDDPStrategy()
    assert strategy.live is not None and strategy.cluster_environment is strategy.live.environment
    assert strategy.cluster_environment.creates_processes_externally  # Lightning starts no rank of its own
    assert (strategy.cluster_environment.node_rank(), strategy.cluster_environment.local_rank()) == (0, 1)
    environment = strategy.cluster_environment
    environment.set_world_size(3)
    assert environment.global_rank() == 1  # before the membership: the slot's own
    environment.replacing = True  # a replacement setting itself up before it joins: never rank 0's duties
    assert environment.global_rank() == 2 and environment.world_size() == 3
    with pytest.raises(ValueError, match="fault_tolerant=False, but this process was started by"):
        BucketedDDPStrategy(fault_tolerant=False)
    assert BucketedDDPStrategy(process_group_backend="nccl").live is not None  # a communicator abort, on CUDA
    for setting, value in (("comm_algorithm", "ring"), ("start_method", "spawn")):
        with pytest.raises(ValueError, match=rf"{setting}={value!r} is not supported with live fault tolerance"):
            BucketedDDPStrategy(**{setting: value})


@pytest.mark.parametrize(
    "build", [BucketedDDPStrategy, lambda **kw: ShardedStrategy(stage=2, **kw)], ids=["ddp", "zero2"]
)
def test_rebalancing_is_refused_under_the_agent_naming_what_works(build: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # the membership already shares each global batch over the members training now; two splits would fight
    assert build(rebalance=True).rebalance is not None  # no agent: rebalancing on
    monkeypatch.setenv(ENV_MEMBER, "n0s1i0")
    with pytest.raises(
        ValueError, match=r"rebalance=True is not supported under the fault-tolerance agent.*rebalance=False"
    ):
        build(rebalance=True)
    assert build(rebalance=False).rebalance is None


@pytest.mark.parametrize(
    "build",
    [LocalSGDStrategy, DiLoCoStrategy, lambda **kw: ShardedStrategy(stage=3, **kw)],
    ids=["local_sgd", "diloco", "zero3"],
)
def test_the_windowed_strategies_follow_the_agent_by_themselves(build: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert build().live is None
    monkeypatch.setenv(ENV_MEMBER, "n0s2i0")
    strategy = build()
    assert strategy.live is not None and strategy.cluster_environment is strategy.live.environment
    assert strategy._live_step_in_vote  # the period's sync (ZeRO: the snapshot) is inside the vote: a replay undoes it
    with pytest.raises(ValueError, match="fault_tolerant=False, but this process was started by"):
        build(fault_tolerant=False)
    with pytest.raises(ValueError, match=r"start_method='spawn' is not supported with live fault tolerance"):
        build(start_method="spawn")


def test_powersgd_state_for_a_replacement_and_for_a_replay() -> None:
    """A replacement takes the shared low-rank factors Q and starts its own error feedback at zero; a replay starts
    from the compressor state kept at the window's start, however often the failed attempts wrote into it."""
    source, replacement = BucketedDDPStrategy(compression="powersgd"), BucketedDDPStrategy(compression="powersgd")
    source._compressor._q = {3: torch.arange(6.0).reshape(3, 2)}
    source._compressor._error = {3: torch.ones(4, 3)}
    replacement._live_load(source._live_state())
    torch.testing.assert_close(replacement._compressor._q[3], source._compressor._q[3], rtol=0, atol=0)
    assert replacement._compressor._error == {}  # a rank's residual is its own: lost with the lost rank
    source._live_mark()
    for _ in range(2):  # two failed attempts, each writing into the state in place, each followed by a replay
        source._compressor._error[3].add_(5.0)
        source._compressor._q[3].mul_(-1.0)
        source._live_reset()
        torch.testing.assert_close(source._compressor._error[3], torch.ones(4, 3), rtol=0, atol=0)
        torch.testing.assert_close(source._compressor._q[3], torch.arange(6.0).reshape(3, 2), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("setting", "value"), [("fragments", 2), ("overlap_steps", 1), ("outer_dtype", "int4"), ("outer_dtype", "int8")]
)
def test_streaming_diloco_is_refused_under_the_agent(setting: str, value: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A live period is committed or trained again whole: a fragment's sync inside it, a sync in flight across its
    end, or error feedback a replay would count twice are refused, naming the values that work."""
    monkeypatch.setenv(ENV_MEMBER, "n0s1i0")
    with pytest.raises(ValueError, match=rf"{setting}={value!r} is not supported with live fault tolerance"):
        DiLoCoStrategy(sync_every=4, **{setting: value})
    assert DiLoCoStrategy(sync_every=4, outer_dtype="bf16").live is not None  # no state of its own: allowed
