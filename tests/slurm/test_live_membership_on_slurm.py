"""On real Slurm: one fault-tolerance agent per node under ``srun``, the agents starting the ranks.

A 2-node job (n1, n2; one ``srun`` task a node) runs ``python -m lightning_sync.launch.agent`` on each node: the
task on node 0 serves the membership store, the other registers with it. Each agent starts 2 rank processes of
the plain-torch loop of ``support/ft_worker.py``. Two things must hold: a rank process killed on one node is
replaced without ending the job step, and a whole node lost (its agent killed) leaves the other node training.
Each is checked against one process's weights on the same global batches (float64, 1e-12). And the documented
recipe for a Trainer script, ``lightning-sync launch`` a node, keeps a 4-rank Lightning fit through a lost rank.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support import ft_trainer, ft_worker
from support.slurm_cluster import SlurmCluster

WORKER = Path(ft_worker.__file__)
TOL = 1e-12  # float64; another split of a global batch only reorders its additions
STEPS = 40


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(
    slurm: SlurmCluster, tmp_path: Path, kill: str, done: tuple[str, ...], until: str = '""'
) -> tuple[str, dict[str, Any]]:
    """Submit the 2-node job with ``FT_KILL=kill``; its output and each member's log."""
    port = _free_port()
    agent = (
        f"{sys.executable} -m lightning_sync.launch.agent --node $SLURM_NODEID --nnodes 2 --host 127.0.0.1 "
        f"--port {port} --nproc 2 --max-restarts 1 --hang-timeout 3 -- {sys.executable} {WORKER} {tmp_path}"
    )
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"export FT_KILL={kill} FT_STEPS={STEPS} FT_STEP_S=0.05 FT_UNTIL_MEMBER={until} "
        f"PYTHONPATH={WORKER.parents[1]}\n"
        f"srun --kill-on-bad-exit=0 bash -c '{agent}; echo \"agent on node $SLURM_NODEID exited $?\"'\n"
    )
    job = slurm.submit_two_nodes(script, tmp_path)
    slurm.wait_job(job, timeout=150, done=done)
    out = (tmp_path / f"out.{job}").read_text()
    logs = {p.stem: [json.loads(line) for line in p.read_text().splitlines()] for p in tmp_path.glob("*.jsonl")}
    return out, logs


def _check(tmp_path: Path, logs: dict[str, Any], survivors: list[str]) -> None:
    last = logs[survivors[0]][-1]["step"] + 1  # STEPS, or more until a replacement was admitted
    assert last >= STEPS
    want_w, want_b = ft_worker.reference(last)
    for m in survivors:
        steps = [r["step"] for r in logs[m]]
        assert steps == list(range(steps[0], last)), (m, steps)
        got = torch.load(tmp_path / f"{m}.pt")
        torch.testing.assert_close(got["w"], want_w, rtol=0, atol=TOL)
        torch.testing.assert_close(got["b"], want_b, rtol=0, atol=TOL)


@pytest.mark.timeout(240)
def test_a_rank_killed_on_one_node_is_replaced_without_ending_the_job_step(slurm: SlurmCluster, tmp_path: Path) -> None:
    out, logs = _job(slurm, tmp_path, "n1s1i0:3:between", done=("COMPLETED",), until="n1s1i1")
    assert "agent on node 0 exited 0" in out and "agent on node 1 exited 0" in out, out
    assert "rank process n1s1i0 exited with status -9" in out and "started n1s1i1 in place of n1s1i0" in out, out
    final = sorted({(r["epoch"], tuple(r["members"])) for v in logs.values() for r in v})[-1][1]
    assert final == ("n0s0i0", "n0s1i0", "n1s0i0", "n1s1i1"), final
    _check(tmp_path, logs, list(final))


@pytest.mark.timeout(240)
def test_a_node_lost_leaves_the_other_node_training(slurm: SlurmCluster, tmp_path: Path) -> None:
    # node 1's agent dies (its task is killed, so the job step ends FAILED), and both its ranks with it
    out, logs = _job(slurm, tmp_path, "n1s0i0:3:agent", done=("COMPLETED", "FAILED"))
    assert "agent on node 0 exited 0" in out, out
    assert "node 1's agent stopped beating: node lost" in out, out
    _check(tmp_path, logs, ["n0s0i0", "n0s1i0"])
    assert all(r["step"] < 4 for m in ("n1s0i0", "n1s1i0") for r in logs.get(m, []))


@pytest.mark.timeout(300)
def test_a_trainer_script_under_one_agent_a_node_replaces_a_lost_rank(slurm: SlurmCluster, tmp_path: Path) -> None:
    """The documented recipe: ``srun ... lightning-sync launch --node $SLURM_NODEID ...`` on each node, starting 2
    ranks of a plain Trainer script (``support/ft_trainer.py``, ``Trainer(devices=2, num_nodes=2)``). A rank of
    node 1 is killed in its forward; the 3 survivors replay the step, node 1's agent starts a replacement, which
    heals and trains to the end; every member ends with one process's weights on the same global batches."""
    script, port = Path(ft_trainer.__file__), _free_port()
    env = {"FT_DEVICES": "2", "FT_NODES": "2", "FT_BATCH": "4", "FT_STEPS": "30", "FT_STEP_S": "0.05"}
    env.update(FT_KILL="n1s1i0:3:forward", FT_UNTIL_MEMBER="n1s1i1", PYTHONPATH=str(script.parents[1]))
    launch = (
        f"{Path(sys.executable).parent / 'lightning-sync'} launch --node $SLURM_NODEID --nnodes 2 --host 127.0.0.1 "
        f"--port {port} --nproc 2 --max-restarts 1 -- {sys.executable} {script} {tmp_path}"
    )
    job_script = tmp_path / "job.sh"
    job_script.write_text(
        "#!/bin/bash\n"
        f"export {' '.join(f'{k}={v}' for k, v in env.items())}\n"
        f"srun --kill-on-bad-exit=0 bash -c '{launch}; echo \"agent on node $SLURM_NODEID exited $?\"'\n"
    )
    job = slurm.submit_two_nodes(job_script, tmp_path)
    slurm.wait_job(job, timeout=200, done=("COMPLETED",))
    out = (tmp_path / f"out.{job}").read_text()
    assert "agent on node 0 exited 0" in out and "agent on node 1 exited 0" in out, out[-4000:]
    assert "started n1s1i1 in place of n1s1i0" in out and "epoch 2 admits n1s1i1" in out, out[-4000:]
    records = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("n*.json")}
    assert sorted(records) == ["n0s0i0", "n0s1i0", "n1s0i0", "n1s1i1"], sorted(records)
    reference = tmp_path / "reference"
    reference.mkdir()
    subprocess.run(
        [sys.executable, str(script), str(reference)],
        env={**os.environ, **env, "FT_REFERENCE": "1", "FT_KILL": ""},
        check=True,
        capture_output=True,
        timeout=120,
    )
    want = torch.load(reference / "reference.pt")
    for member, record in records.items():
        assert record["global_step"] == 30 and record["ft/members"] == 4, (member, record)
        got = torch.load(tmp_path / f"{member}.pt")
        for name, value in want.items():  # float32 over 4 ranks; the bar of the live tests
            torch.testing.assert_close(got[name], value, rtol=0, atol=5e-5, msg=f"{member} {name}")
