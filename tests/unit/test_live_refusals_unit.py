"""Under the fault-tolerance agent (its member id in the environment) only ``bucketed_ddp`` is built: every other
strategy refuses at construction, before Lightning could start ranks of its own, naming the one that works."""

from __future__ import annotations

import pytest

from lightning_sync.comms.membership_keys import ENV_MEMBER
from lightning_sync.strategies import (
    AsyncParameterServerStrategy,
    BucketedDDPStrategy,
    DiLoCoStrategy,
    HogwildStrategy,
    LocalSGDStrategy,
    ShardedStrategy,
)


@pytest.mark.parametrize(
    "build",
    [
        LocalSGDStrategy,
        DiLoCoStrategy,
        HogwildStrategy,
        AsyncParameterServerStrategy,
        lambda: ShardedStrategy(stage=3),
    ],
    ids=["local_sgd", "diloco", "hogwild", "async_ps", "zero3"],
)
def test_a_strategy_that_cannot_follow_the_membership_refuses_the_agents_process(
    build: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_MEMBER, "n0s1i0")
    with pytest.raises(ValueError, match=r"does not keep training through a lost rank yet.*BucketedDDPStrategy"):
        build()  # type: ignore[operator]


def test_bucketed_ddp_follows_the_agent_by_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    assert BucketedDDPStrategy().live is None  # no agent: Lightning's own process group
    monkeypatch.setenv(ENV_MEMBER, "n0s1i0")
    strategy = BucketedDDPStrategy()
    assert strategy.live is not None and strategy.cluster_environment is strategy.live.environment
    assert strategy.cluster_environment.creates_processes_externally  # Lightning starts no rank of its own
    assert (strategy.cluster_environment.node_rank(), strategy.cluster_environment.local_rank()) == (0, 1)
    with pytest.raises(ValueError, match="fault_tolerant=False, but this process was started by"):
        BucketedDDPStrategy(fault_tolerant=False)
    for setting, value in (("process_group_backend", "nccl"), ("compression", "powersgd"), ("start_method", "spawn")):
        with pytest.raises(ValueError, match=rf"{setting}={value!r} is not supported with live fault tolerance"):
            BucketedDDPStrategy(**{setting: value})
