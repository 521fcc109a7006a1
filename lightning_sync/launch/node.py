"""The rank processes of one node, and the agent of a node other than node 0.

Node 0's agent (:mod:`lightning_sync.launch.agent`) keeps the whole job's membership. Every other node runs a
:class:`NodeAgent`: a client of node 0's store that starts its node's rank processes, reports each exit to node 0
(an event in the store), starts or kills a rank process when node 0 orders it, and beats, so that node 0 sees the
node lost when the agent is. A rank process dies with its agent (``PR_SET_PDEATHSIG`` on Linux): a lost agent is a
lost node, and no rank it started trains on unwatched.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from lightning_sync._checks import check_int
from lightning_sync._process import die_with_parent
from lightning_sync.comms.membership_keys import ENV_MEMBER, ENV_STORE, MembershipKeys, place_of

__all__ = ["NodeAgent", "node_of", "start_rank"]

_POLL_S = 0.01  # between two looks at the rank processes and the orders
# NCCL, where a rank's collectives are NCCL's: wait() blocks until the collective completed and raises when its
# communicator is aborted, so a member votes on a step only once its all-reduce is done (gloo's wait already does),
# and NCCL's own watchdog does not end the process on an error the membership handles
NCCL_LIVE = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}


def node_of(member: str) -> int:
    """The node of a member id ``n<node>s<slot>i<incarnation>``."""
    return place_of(member)[0]


def start_rank(command: Sequence[str], env: dict[str, str], store: str, member: str) -> subprocess.Popen[bytes]:
    """Start one rank process of ``member`` against the store at ``store`` (``host:port``); it dies with this one."""
    full = {**os.environ, **NCCL_LIVE, **env, ENV_STORE: store, ENV_MEMBER: member}
    return subprocess.Popen(list(command), env=full, preexec_fn=die_with_parent)  # noqa: PLW1509


@dataclass
class NodeAgent:
    """The agent of node ``node`` > 0: starts ``nproc`` copies of ``command`` and carries out node 0's orders.

    Args:
        command: the rank program and its arguments.
        nproc: rank processes on this node (>= 1).
        node: this node's index (>= 1).
        host: node 0's store host.
        port: node 0's store port.
        env: extra environment for the rank processes.
        timeout: seconds to reach node 0's store.
        keys: the membership protocol's keys.
    """

    command: Sequence[str]
    nproc: int
    node: int
    host: str
    port: int
    env: dict[str, str] = field(default_factory=dict)
    timeout: float = 300.0
    keys: MembershipKeys = field(default_factory=MembershipKeys)

    def __post_init__(self) -> None:
        check_int("node", self.node, 1)  # node 0 runs Agent
        check_int("nproc", self.nproc, 1)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._reported: set[str] = set()

    def run(self) -> int:
        """Register with node 0, start the ranks, report and obey until node 0 says the run is over: 0, or 1 when
        node 0's store was lost (every rank process here is killed then)."""
        timeout = datetime.timedelta(seconds=self.timeout)
        store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout)
        address = f"{self.host}:{self.port}"
        store.set(self.keys.node(self.node), str(self.nproc).encode())
        for slot in range(self.nproc):
            member = f"n{self.node}s{slot}i0"
            self.processes[member] = start_rank(self.command, self.env, address, member)
        try:
            while True:
                store.add(self.keys.agent_beat(self.node), 1)
                self._report(store)
                self._obey(store, address)
                if store.check([self.keys.done]) and all(p.poll() is not None for p in self.processes.values()):
                    self._report(store)
                    store.set(self.keys.bye(self.node), b"1")
                    return 0
                time.sleep(_POLL_S)
        except (RuntimeError, dist.DistError) as exc:  # node 0 is gone, and the membership with it
            print(f"lightning-sync node agent {self.node}: lost node 0's store ({exc}); stopping", file=sys.stderr)
            return 1
        finally:
            for p in self.processes.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()

    def _report(self, store: dist.Store) -> None:
        for member, p in self.processes.items():
            if member not in self._reported and (code := p.poll()) is not None:
                self._reported.add(member)
                store.queue_push(self.keys.events, f"exit {member} {code}")

    def _obey(self, store: dist.Store, address: str) -> None:
        while True:
            try:
                order = store.queue_pop(self.keys.orders(self.node), block=False).decode()
            except dist.QueueEmptyError:
                return
            what, member = order.split()
            if what == "start":
                self.processes[member] = start_rank(self.command, self.env, address, member)
            elif what == "kill" and member in self.processes and self.processes[member].poll() is None:
                self.processes[member].kill()
