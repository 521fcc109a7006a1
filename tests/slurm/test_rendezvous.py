"""On real Slurm: the job's first node (n1) does not resolve on this machine, so every task of a 2-node
job must agree on the fallback address (n1's NodeAddr, 127.0.0.1) and on the port from the job id,
without hanging."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support.slurm_cluster import SlurmCluster

PROBE = """
import os
from lightning_sync.launch import prepare
rdv = prepare()
print(os.environ["SLURM_PROCID"], os.environ["SLURM_NODEID"], rdv.address, rdv.port, rdv.source, flush=True)
"""


@pytest.mark.timeout(180)
def test_unresolvable_first_node_falls_back_without_hanging(slurm: SlurmCluster, tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\nsrun {sys.executable} {probe}\n")
    job = slurm.submit_two_nodes(script, tmp_path)
    slurm.wait_job(job, timeout=120)
    lines = sorted((tmp_path / f"out.{job}").read_text().split("\n"))
    rows = [line.split(" ", 4) for line in lines if line and line[0].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("0", "0"), ("1", "1")], lines  # one task on each node
    port = str(15000 + int(job) % 10000)
    for rank, _node, address, got_port, source in rows:
        assert (address, got_port) == ("127.0.0.1", port), (rank, address, got_port, source)
        assert "'n1' does not resolve, using its NodeAddr 127.0.0.1" in source, source
