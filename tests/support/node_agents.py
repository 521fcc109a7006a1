"""Two emulated nodes on this machine: node 0's agent in the test's process, node 1's a process of its own.

Node 1's agent is started as a real node's would be (``python -m lightning_sync.launch.agent --node 1 ...``),
against node 0's store, so that killing it is losing a node.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from lightning_sync.launch.agent import Agent

__all__ = ["run_with_node_1"]


def run_with_node_1(agent: Agent, command: Sequence[str], nproc: int, env: dict[str, str]) -> tuple[int, int]:
    """Run ``agent`` (node 0's, built with ``nnodes=2``) to its end, with node 1's agent starting ``nproc`` rank
    processes of ``command`` under ``env``; node 0's status and node 1's agent's (killed if it outlives node 0)."""
    node1 = subprocess.Popen(
        [sys.executable, "-m", "lightning_sync.launch.agent", "--node", "1", "--nnodes", "2", "--host", "127.0.0.1",
         "--port", str(agent.store.port), "--nproc", str(nproc), "--", *command],
        env={**os.environ, **env},
    )  # fmt: skip
    try:
        status = agent.run()
        node1_status = node1.wait(timeout=60)
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    return status, node1_status
