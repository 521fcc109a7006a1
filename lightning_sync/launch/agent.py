"""The fault-tolerance agent: one per node, it starts the node's rank processes and keeps the job's membership.

torchrun's agent restarts every worker when one fails. This one does not: when a rank process exits with an
error (SIGKILL included), the agent closes the current membership epoch and publishes the next one without it
(:mod:`lightning_sync.comms.membership`), and the survivors, whose collectives with the lost rank failed, build
the next epoch's process group and replay the step that was not committed. No survivor exits or restarts.

The membership store is a TCPStore served by this process (node 0's agent), not by a rank, so the loss of any
rank process, rank 0's included, leaves the rendezvous alive. Each rank process gets the store's address
(:data:`~lightning_sync.comms.membership.ENV_STORE`) and its member id
(:data:`~lightning_sync.comms.membership.ENV_MEMBER`): ``n<node>s<slot>i<incarnation>``.

On more nodes, every other node runs a :class:`~lightning_sync.launch.node.NodeAgent` against this store: node 0
waits for each to register, lists the members node by node, and learns of their rank processes' exits through
the store; it orders their starts and kills there. A node whose agent stops beating is lost with all its ranks
(they die with their agent).

A rank process that exits with status 0 has finished; it is not a loss. The agent exits when every rank process
has exited: with status 0 when at least one finished and every other one was lost and tolerated, else with the
first failing status. Run it as ``python -m lightning_sync.launch.agent --nproc 3 -- python train.py``; on node
``k`` of ``N``, ``... --node k --nnodes N --host <node 0> --port <its port> --nproc M -- python train.py``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from lightning_sync._checks import check_int
from lightning_sync.comms.membership import MembershipKeys, parse_members, poll
from lightning_sync.launch.node import NodeAgent, node_of, start_rank

__all__ = ["Agent", "Loss", "main"]

_POLL_S = 0.01  # between two looks at the rank processes
#: seconds more a rank that closed its membership may stay silent before it is taken for hung: its exit (the
#: interpreter's teardown of torch and its groups) takes seconds on a loaded machine, and beats no more
LEAVING_S = 60.0


@dataclass
class Loss:
    """A rank process that exited with an error, and the epoch published without it."""

    member: str
    returncode: int
    at: float  # time.monotonic() when the agent saw it
    epoch: int  # the epoch published without it (-1: none, no member was left)


#: the status of the rank processes of a node whose agent was lost
NODE_LOST = -1


@dataclass
class _Rank:
    member: str
    process: subprocess.Popen[bytes] | None  # None: on another node
    done: bool = False
    code: int | None = None  # its exit status, once seen
    beats: int = 0  # the heartbeat counter last seen (0: not beating yet, so not judged)
    seen: float = 0.0  # time.monotonic() when it last moved


@dataclass
class Agent:
    """Starts ``nproc`` copies of ``command`` on this node and keeps their membership (see the module docstring).

    Args:
        command: the rank program and its arguments.
        nproc: rank processes on this node (>= 1).
        host: the interface the store listens on.
        port: the store's port (0: any free one).
        node: this node's index: 0, the node that serves the store (other nodes run ``NodeAgent``).
        nnodes: nodes in the job (>= 1); node 0 waits up to ``join_timeout`` s for the others to register.
        env: extra environment for the rank processes.
        max_restarts: how many times in all a lost rank process is started again (>= 0); the replacement waits to
            be admitted at the next committed step and takes the training state from a live member.
        hang_timeout: seconds a rank process's heartbeat may stand still before the agent kills it as hung (> 0):
            a stopped process, or one stuck where no collective fails; its peers then see it lost.
        keys: the membership protocol's keys.
    """

    command: Sequence[str]
    nproc: int
    host: str = "127.0.0.1"
    port: int = 0
    node: int = 0
    nnodes: int = 1
    join_timeout: float = 300.0
    env: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 0
    hang_timeout: float = 10.0
    keys: MembershipKeys = field(default_factory=MembershipKeys)
    losses: list[Loss] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_int("nproc", self.nproc, 1)
        check_int("max_restarts", self.max_restarts, 0)
        check_int("nnodes", self.nnodes, 1)
        if (
            isinstance(self.hang_timeout, bool)
            or not isinstance(self.hang_timeout, (int, float))
            or not (self.hang_timeout > 0)
        ):
            raise ValueError(f"Agent: hang_timeout={self.hang_timeout!r}; allowed: seconds > 0")
        if not self.command:
            raise ValueError("Agent: command=[] is empty; give the rank program, e.g. ['python', 'train.py']")
        if self.node != 0:
            raise ValueError(f"Agent: node={self.node!r}; allowed: 0 (the other nodes run NodeAgent)")
        self.store = dist.TCPStore(self.host, self.port, is_master=True, wait_for_workers=False)
        self.epoch = -1
        self._open = 0  # the first epoch not closed yet
        self.members: list[str] = []  # the current epoch's
        self.restarts = 0
        self.hung: list[str] = []  # members killed for a heartbeat that stood still
        self._looked = time.monotonic()  # the last look at the heartbeats
        self.waiting: list[str] = []  # replacements started and not admitted yet
        self._ranks: list[_Rank] = []
        self._finished = False  # a rank process exited with status 0: the run is over, nothing more is started
        self._nodes: dict[int, list[float]] = {}  # other node -> [beats last seen, when they last moved]
        self.lost_nodes: list[int] = []

    @property
    def address(self) -> str:
        return f"{self.host}:{self.store.port}"

    def run(self) -> int:
        """Start the ranks, keep the membership until every rank exited; the exit status (module docstring)."""
        members = [f"n0s{slot}i0" for slot in range(self.nproc)]
        for node in range(1, self.nnodes):  # their agents start their own first ranks
            members += [f"n{node}s{slot}i0" for slot in range(self._registered(node))]
            self._nodes[node] = [0, time.monotonic()]
        self._publish(members)
        for member in members:
            self._ranks.append(_Rank(member, self._start(member) if node_of(member) == 0 else None))
        try:
            while not all(r.done for r in self._ranks):
                self._watch()
                time.sleep(_POLL_S)
        finally:
            for r in self._ranks:  # an interrupted agent leaves no rank process behind
                if r.process is not None and r.process.poll() is None:
                    r.process.kill()
                    r.process.wait()
            self.store.set(self.keys.done, b"1")
            self._farewell()
        return self._status()

    def _farewell(self) -> None:
        """Keep the store up until every node still there has seen that the run is over (or ``hang_timeout``)."""
        nodes = [self.keys.bye(n) for n in self._nodes if n not in self.lost_nodes]
        if nodes:
            poll(lambda: self.store.check(nodes), self.hang_timeout)

    def _registered(self, node: int) -> int:
        """Wait for node ``node``'s agent to register; its number of rank processes."""
        if not poll(lambda: self.store.check([self.keys.node(node)]), self.join_timeout):
            raise RuntimeError(f"Agent: node {node} did not register within {self.join_timeout:g} s")
        return int(self.store.get(self.keys.node(node)))

    def _start(self, member: str) -> subprocess.Popen[bytes] | None:
        """Start ``member``'s rank process here, or order its node's agent to (None)."""
        if node_of(member) == 0:
            return start_rank(self.command, self.env, self.address, member)
        self.store.queue_push(self.keys.orders(node_of(member)), f"start {member}")
        return None

    def _kill(self, r: _Rank) -> None:
        if r.process is None:
            self.store.queue_push(self.keys.orders(node_of(r.member)), f"kill {r.member}")
        elif r.process.poll() is None:
            r.process.kill()
            r.process.wait()

    def _exits(self) -> None:
        """Take in the exits the other nodes reported, and lose every rank of a node whose agent stopped beating."""
        while True:
            try:
                _, member, code = self.store.queue_pop(self.keys.events, block=False).decode().split()
            except dist.QueueEmptyError:
                break
            for r in self._ranks:
                if r.member == member and r.code is None:
                    r.code = int(code)
        now = time.monotonic()
        for node, seen in self._nodes.items():
            beats = int(self.store.add(self.keys.agent_beat(node), 0))
            if beats != seen[0]:
                seen[0], seen[1] = beats, now
            elif node not in self.lost_nodes and now - seen[1] > self.hang_timeout:
                self.lost_nodes.append(node)
                print(f"lightning-sync agent: node {node}'s agent stopped beating: node lost", file=sys.stderr)
                for r in self._ranks:
                    if node_of(r.member) == node and r.code is None:
                        r.code = NODE_LOST
        for r in self._ranks:
            if r.process is not None and r.code is None:
                r.code = r.process.poll()

    def _watch(self) -> None:
        self._kill_hung()
        self._exits()
        lost = []
        for r in list(self._ranks):
            if r.done or (code := r.code) is None:
                continue
            r.done = True
            if code == 0 and not self._finished:
                self._finished = True
                self._stop_waiting()
            elif code != 0 and r.member in self.waiting:  # a replacement lost before it was admitted
                self._set_waiting([m for m in self.waiting if m != r.member])
                self.losses.append(Loss(r.member, code, time.monotonic(), self.epoch))
                self._restart(r.member)
            elif code != 0 and r.member in self.members:
                lost.append((r, code))
        if lost:  # every loss seen in one look goes in one new epoch
            self._lose(lost)
        if self.store.check([self.keys.admit(self.epoch)]):
            self._admit()

    def _lose(self, lost: list[tuple[_Rank, int]]) -> None:
        """Close the epoch (its open votes abort), publish the next one without the ``lost`` ranks, and start
        their replacements while restarts are left."""
        for epoch in range(self._open, self.epoch + 1):  # members may still be in an epoch before the newest
            self.store.set(self.keys.closed(epoch), b"1")  # (the admitting one is entered at their next step)
        self._open = self.epoch + 1
        gone = {r.member for r, _ in lost}
        left = [m for m in self.members if m not in gone]
        epoch = self._publish(left) if left else -1
        now = time.monotonic()
        for r, code in lost:
            self.losses.append(Loss(r.member, code, now, epoch))
            print(f"lightning-sync agent: rank process {r.member} exited with status {code}", file=sys.stderr)
        print(
            f"lightning-sync agent: epoch {epoch} continues with {len(left)} members: {', '.join(left)}"
            if left
            else "lightning-sync agent: no member left",
            file=sys.stderr,
            flush=True,
        )
        for r, _ in lost:
            if left:
                self._restart(r.member)

    def _kill_hung(self) -> None:
        """Kill every rank process whose heartbeat stood still for ``hang_timeout`` (it is then seen as lost). After a
        pause of the agent itself (a loaded machine) the clocks restart: it did not watch, so it judges no one. A rank
        that closed its membership (it exits) has :data:`LEAVING_S` more: its interpreter's teardown beats no more."""
        now = time.monotonic()
        paused, self._looked = now - self._looked > self.hang_timeout / 4, now
        for r in self._ranks:
            if r.done or r.code is not None:
                continue
            key = self.keys.beat(r.member)
            beats = int(self.store.add(key, 0)) if self.store.check([key]) else 0
            if beats != r.beats or paused:
                r.beats, r.seen = beats, now
            elif beats and now - r.seen > self.hang_timeout + (LEAVING_S if self._leaving(r.member) else 0.0):
                print(
                    f"lightning-sync agent: rank process {r.member} has not beaten for {now - r.seen:.1f} s: hung; "
                    f"killing it",
                    file=sys.stderr,
                    flush=True,
                )
                self._kill(r)
                self.hung.append(r.member)
                r.seen = now  # its exit comes next (from another node, through the store)

    def _leaving(self, member: str) -> bool:
        return self.store.check([self.keys.leaving(member)])

    def _restart(self, member: str) -> None:
        """Start a replacement for ``member``'s slot (its next incarnation) if restarts are left."""
        if self._finished or self.restarts >= self.max_restarts or node_of(member) in self.lost_nodes:
            return
        self.restarts += 1
        slot, incarnation = member.rsplit("i", 1)
        new = f"{slot}i{int(incarnation) + 1}"
        self._set_waiting([*self.waiting, new])  # before it starts: it must find itself there
        self._ranks.append(_Rank(new, self._start(new)))
        print(
            f"lightning-sync agent: started {new} in place of {member} (restart {self.restarts} of "
            f"{self.max_restarts})",
            file=sys.stderr,
            flush=True,
        )

    def _admit(self) -> None:
        """The current epoch committed a step that admits replacements: publish the next epoch with them, last (the
        members that hold the training state keep ranks 0..; the newcomers heal from rank 0)."""
        step, _, names = self.store.get(self.keys.admit(self.epoch)).decode().partition(":")
        alive = {r.member for r in self._ranks if not r.done}
        admitted = [m for m in parse_members(names) if m in self.waiting and m in alive]
        self._set_waiting([m for m in self.waiting if m not in admitted])
        self.store.set(self.keys.start(self.epoch + 1), str(int(step) + 1).encode())
        epoch = self._publish([*self.members, *admitted])
        print(
            f"lightning-sync agent: epoch {epoch} admits {', '.join(admitted) or 'none'} after step {step}",
            file=sys.stderr,
            flush=True,
        )

    def _set_waiting(self, members: list[str]) -> None:
        self.waiting = members
        self.store.set(self.keys.waiting, ",".join(members).encode())

    def _stop_waiting(self) -> None:
        """The run is over: replacements still waiting have nothing left to join, nor have those admitted to an
        epoch the members finished before entering (it never had all its members)."""
        present = [f"{self.keys.present(self.epoch)}/{m}" for m in self.members]
        stranded = set(self.members) if self.epoch >= 0 and not self.store.check(present) else set()
        for r in self._ranks:
            if (r.member in self.waiting or r.member in stranded) and r.code is None:
                self._kill(r)
        self._set_waiting([])

    def _publish(self, members: list[str]) -> int:
        self.epoch += 1
        self.members = members
        self.store.set(self.keys.members(self.epoch), ",".join(members).encode())
        self.store.set(self.keys.epoch, str(self.epoch).encode())  # after its members: never an epoch without them
        return self.epoch

    def _status(self) -> int:
        codes = [r.code if r.code is not None else 1 for r in self._ranks]
        if any(c == 0 for c in codes):
            return 0
        return next((c if c > 0 else 128 - c for c in codes if c != 0), 1)


def main(argv: Sequence[str] | None = None, prog: str = "python -m lightning_sync.launch") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Start N rank processes that keep training when one of them is lost.",
    )
    parser.add_argument("--nproc", type=int, required=True, help="rank processes on this node")
    parser.add_argument("--node", type=int, default=0, help="this node's index (0 serves the store)")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes in the job")
    parser.add_argument("--host", default="127.0.0.1", help="the interface the membership store listens on")
    parser.add_argument("--port", type=int, default=0, help="the membership store's port (0: any free one)")
    parser.add_argument("--max-restarts", type=int, default=0, help="lost rank processes started again, in all")
    parser.add_argument("--hang-timeout", type=float, default=10.0, help="seconds without a heartbeat: hung")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the rank program and its arguments")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.node > 0:
        return NodeAgent(command, args.nproc, args.node, args.host, args.port).run()
    agent = Agent(
        command,
        args.nproc,
        host=args.host,
        port=args.port,
        max_restarts=args.max_restarts,
        hang_timeout=args.hang_timeout,
        nnodes=args.nnodes,
    )
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
