"""``LiveEnvironment``: Lightning's view of a rank started by the fault-tolerance agent.

The agent (:mod:`lightning_sync.launch.agent`) starts every rank process itself, so Lightning must start none
(``creates_processes_externally``). A rank's place in the job is not fixed: it is its index in the current
membership epoch, which changes when a member is lost or a replacement joins, so the global rank and world size
are read from the strategy's :class:`~lightning_sync.comms.membership.Membership` each time they are asked for.
Before it joined, the process reports its place at the start of the job (its slot), the only one it can know.
The local rank and node are those of the slot the agent started it in (``n<node>s<slot>i<k>``): a replacement
takes its predecessor's device.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.fabric.plugins.environments import ClusterEnvironment
from typing_extensions import override

from lightning_sync.comms.membership import Membership
from lightning_sync.comms.membership_keys import ENV_MEMBER, ENV_STORE, place_of

__all__ = ["LiveEnvironment", "check_live_settings", "live_requested", "refuse_under_agent"]


class LiveEnvironment(ClusterEnvironment):
    """The ranks of the current membership epoch (module docstring).

    Args:
        nominal_world_size: the job's size when every slot is filled (the agents' ``nproc`` summed over nodes).
    """

    def __init__(self, nominal_world_size: int = 1) -> None:
        self.member = os.environ.get(ENV_MEMBER, "n0s0i0")
        self.nominal_world_size = nominal_world_size
        self.membership: Membership | None = None  # set once joined
        self.replacing = False  # a replacement that has not joined yet (it sets itself up first)

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return os.environ.get(ENV_STORE, "127.0.0.1:0").rsplit(":", 1)[0]

    @property
    @override
    def main_port(self) -> int:
        return int(os.environ.get(ENV_STORE, "127.0.0.1:0").rsplit(":", 1)[1])

    @staticmethod
    @override
    def detect() -> bool:
        return ENV_MEMBER in os.environ

    @override
    def world_size(self) -> int:
        return self.membership.world_size if self._joined() else self.nominal_world_size

    @override
    def set_world_size(self, size: int) -> None:
        self.nominal_world_size = size  # Lightning's nodes x devices: the job's full size

    @override
    def global_rank(self) -> int:
        if self._joined():
            return self.membership.rank
        # a replacement setting itself up before it joins: the rank it takes when the job is whole again (the agent
        # lists replacements last), never rank 0's, whose logging and checkpoints are its peer's
        return self.nominal_world_size - 1 if self.replacing else self.local_rank()

    @override
    def set_global_rank(self, rank: int) -> None:
        """Ranks come from the membership, not from Lightning's arithmetic."""

    @override
    def local_rank(self) -> int:
        return place_of(self.member)[1]

    @override
    def node_rank(self) -> int:
        return place_of(self.member)[0]

    def _joined(self) -> bool:
        return self.membership is not None and self.membership.epoch >= 0


def live_requested(strategy: str, fault_tolerant: Any) -> bool:
    """Whether a strategy constructed with ``fault_tolerant`` runs live: None follows the environment (the agent
    started this process); True needs it; False refuses it, because the agent's ranks cannot form a fixed group."""
    if fault_tolerant is not None and not isinstance(fault_tolerant, bool):
        raise ValueError(f"{strategy}: fault_tolerant must be True, False or None, got {fault_tolerant!r}")
    started_by_agent = LiveEnvironment.detect()
    if fault_tolerant is True and not started_by_agent:
        raise ValueError(
            f"{strategy}: fault_tolerant=True needs the ranks started by the fault-tolerance agent, which keeps the "
            f"membership: `lightning-sync launch --nproc N -- python train.py` (or lightning-sync train "
            f"launch.fault_tolerant=true)"
        )
    if fault_tolerant is False and started_by_agent:
        raise ValueError(
            f"{strategy}: fault_tolerant=False, but this process was started by the fault-tolerance agent "
            f"({ENV_MEMBER} is set); pass fault_tolerant=True or None, or start it without the agent"
        )
    return started_by_agent


def check_live_settings(strategy: str, **settings: tuple[Any, tuple[Any, ...]]) -> None:
    """Refuse a setting live fault tolerance does not support yet, naming it and the values that work."""
    for name, (value, allowed) in settings.items():
        if value not in allowed:
            raise ValueError(
                f"{strategy}: {name}={value!r} is not supported with live fault tolerance; allowed: {list(allowed)}"
            )


def refuse_under_agent(strategy: str) -> None:
    """Refuse to build a strategy that cannot follow a live membership in a process the agent started: Lightning
    would start ranks of its own and wait for a fixed group that never forms."""
    if LiveEnvironment.detect():
        raise ValueError(
            f"{strategy} does not keep training through a lost rank yet, and this process was started by the "
            f"fault-tolerance agent ({ENV_MEMBER} is set). Use BucketedDDPStrategy (strategy=bucketed_ddp), "
            f"LocalSGDStrategy, DiLoCoStrategy or ShardedStrategy (zero1/2/3), or "
            f"start the job without the agent: a lost rank then ends the job, named by the hang watchdog, and a "
            f"rerun resumes from its newest checkpoint"
        )
