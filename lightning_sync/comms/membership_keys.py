"""The store keys of the live-membership protocol (:mod:`lightning_sync.comms.membership`): what the fault-tolerance
agent writes and the ranks read, under one job prefix, and the few constants both sides share."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BEAT_S", "ENV_MEMBER", "ENV_STORE", "MembershipKeys", "parse_members", "place_of"]

#: the environment variable that names the agent's store, ``host:port``
ENV_STORE = "LIGHTNING_SYNC_FT_STORE"
#: the environment variable that names this process's member id
ENV_MEMBER = "LIGHTNING_SYNC_FT_MEMBER"
#: seconds between two heartbeats of a member
BEAT_S = 0.1


@dataclass(frozen=True)
class MembershipKeys:
    """The store keys of the membership protocol, under one job prefix (the agent writes, the ranks read)."""

    prefix: str = "ft"

    @property
    def epoch(self) -> str:
        """The newest epoch's number (decimal)."""
        return f"{self.prefix}/epoch"

    def members(self, epoch: int) -> str:
        """Epoch ``epoch``'s member ids in rank order, comma separated."""
        return f"{self.prefix}/e{epoch}/members"

    def closed(self, epoch: int) -> str:
        """Present once epoch ``epoch`` has ended (a member was lost); its open votes abort."""
        return f"{self.prefix}/e{epoch}/closed"

    @property
    def waiting(self) -> str:
        """The replacement members the agent started and the membership has not admitted yet, comma separated."""
        return f"{self.prefix}/waiting"

    def ready(self, member: str) -> str:
        """Present once replacement ``member`` is up and waiting to be admitted."""
        return f"{self.prefix}/ready/{member}"

    def admit(self, epoch: int) -> str:
        """``step:m1,m2``: the members admitted after ``step``, the last one epoch ``epoch`` commits."""
        return f"{self.prefix}/e{epoch}/admit"

    def start(self, epoch: int) -> str:
        """The step an admitting epoch runs first (its newcomers start there)."""
        return f"{self.prefix}/e{epoch}/start"

    def beat(self, member: str) -> str:
        """A counter ``member``'s heartbeat thread raises every :data:`BEAT_S`: the agent kills a member whose counter
        stands still (a hung process: stopped, or stuck where no collective fails)."""
        return f"{self.prefix}/beat/{member}"

    def leaving(self, member: str) -> str:
        """Present once ``member`` closed its membership (its run is over, it exits): it beats no more, and its
        silence while the interpreter tears down is not a hang."""
        return f"{self.prefix}/leaving/{member}"

    def node(self, node: int) -> str:
        """Node ``node``'s agent registers its number of rank processes here (node 0 waits for every node)."""
        return f"{self.prefix}/node/{node}"

    def agent_beat(self, node: int) -> str:
        """A counter node ``node``'s agent raises while it runs: node 0 sees the node lost when it stands still."""
        return f"{self.prefix}/node/{node}/beat"

    def bye(self, node: int) -> str:
        """Node ``node``'s agent saw :attr:`done` and stops: node 0 keeps its store up until every node said so."""
        return f"{self.prefix}/node/{node}/bye"

    def orders(self, node: int) -> str:
        """A queue of node 0's orders to node ``node``'s agent: ``start <member>`` or ``kill <member>``."""
        return f"{self.prefix}/node/{node}/orders"

    @property
    def events(self) -> str:
        """A queue of the other nodes' reports to node 0: ``exit <member> <status>``."""
        return f"{self.prefix}/events"

    @property
    def done(self) -> str:
        """Present once node 0's agent has seen every rank process exit."""
        return f"{self.prefix}/done"

    def present(self, epoch: int) -> str:
        """Under it, one key per member of epoch ``epoch`` that has shown up to build its group."""
        return f"{self.prefix}/e{epoch}/present"

    def group(self, epoch: int) -> str:
        """The store prefix of epoch ``epoch``'s process group."""
        return f"{self.prefix}/e{epoch}/pg/"

    def vote(self, epoch: int, step: int) -> str:
        return f"{self.prefix}/e{epoch}/s{step}"


def parse_members(value: bytes | str) -> list[str]:
    text = value.decode() if isinstance(value, bytes) else value
    return [m for m in text.split(",") if m]


def place_of(member: str) -> tuple[int, int]:
    """The node and local slot of a member id ``n<node>s<slot>i<incarnation>``."""
    node, rest = member[1:].split("s", 1)
    return int(node), int(rest.split("i", 1)[0])
