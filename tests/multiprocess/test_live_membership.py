"""Survivors keep training: the fault-tolerance agent's membership epochs and the commit vote, with real processes,
real gloo groups and SIGKILL.

Each case starts 3 rank processes of :mod:`support.ft_worker` (least squares, 8 steps of a 12-sample global batch)
under :class:`~lightning_sync.launch.agent.Agent`; one or two of them kill themselves at a chosen point of a step.
The survivors must finish every step with no exit or restart, commit each step exactly once with the whole global
batch split over that epoch's members (every sample once), and end with the single-process weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support import ft_worker
from support.node_agents import run_with_node_1

from lightning_sync.launch.agent import Agent

WORKER = Path(ft_worker.__file__)
# float64 throughout; a different split of the global batch only reorders the additions of each gradient
TOL = 1e-12


def _run(
    tmp_path: Path, kill: str, max_restarts: int = 0, hang_timeout: float = 10.0, **env: str
) -> tuple[Agent, int, dict[str, list[dict[str, Any]]]]:
    """Run the agent with 3 ranks and ``FT_KILL=kill``; the agent, its exit status and each member's log."""
    command = [sys.executable, str(WORKER), str(tmp_path)]
    agent = Agent(command, 3, env={"FT_KILL": kill, **env}, max_restarts=max_restarts, hang_timeout=hang_timeout)
    status = agent.run()
    logs = {p.stem: [json.loads(line) for line in p.read_text().splitlines()] for p in sorted(tmp_path.glob("*.jsonl"))}
    return agent, status, logs


def _check_survivors(
    tmp_path: Path, logs: dict[str, list[dict[str, Any]]], lost: set[str], steps: int = ft_worker.STEPS
) -> None:
    """The members not ``lost`` logged every step from their first to the last (at least ``steps``; the loop may
    go on until a replacement is admitted), and hold the one-process weights; every step was committed once, by
    one epoch, whose members' slices split its global batch."""
    survivors = sorted(set(logs) - lost)
    assert survivors, logs.keys()
    steps = max(steps, logs[survivors[0]][-1]["step"] + 1)
    want_w, want_b = ft_worker.reference(steps)
    for m in survivors:
        assert [r["step"] for r in logs[m]] == list(range(logs[m][0]["step"], steps)), (m, logs[m])
        got = torch.load(tmp_path / f"{m}.pt")
        torch.testing.assert_close(got["w"], want_w, rtol=0, atol=TOL)
        torch.testing.assert_close(got["b"], want_b, rtol=0, atol=TOL)
    for step in range(steps):
        # one commit a step: every member that logged it names the same epoch and members, and its slice is its
        # share of the global batch at that epoch's size (the shares split the batch: every sample once; a lost
        # member that committed before dying may not have logged it)
        batch = ft_worker.global_batch(step)
        records = {m: r for m in logs for r in logs[m] if r["step"] == step}
        assert records and {m for m in survivors if logs[m][0]["step"] <= step} <= set(records), (step, records)
        assert len({(r["epoch"], tuple(r["members"])) for r in records.values()}) == 1, (step, records)
        for m, r in records.items():
            assert r["mine"] == ft_worker.share(batch, r["members"].index(m), len(r["members"])).tolist(), (step, m)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("kill", "lost"),
    [
        ("n0s2i0:3:between", {"n0s2i0"}),  # between two all-reduces of a step: the step is replayed at 2 ranks
        ("n0s0i0:2:before", {"n0s0i0"}),  # rank 0 itself: the store lives in the agent, so nothing else goes
        ("n0s1i0:4:voted", {"n0s1i0"}),  # voted to commit, then died: committed on every survivor or on none
        ("n0s1i0:3:between,n0s2i0:3:before", {"n0s1i0", "n0s2i0"}),  # two at once: one survivor goes on alone
        ("n0s2i0:1:between,n0s1i0:5:between", {"n0s1i0", "n0s2i0"}),  # two failures, four steps apart
        # survivors that disagree: n0s0i0's step completed, n0s1i0's failed as n0s2i0 died. Only a shared decision
        # keeps them together (both replay); deciding alone, n0s0i0 would go on to step 4 while n0s1i0 replays 3,
        # and their next all-reduce would sum two different steps' gradients
        ("n0s2i0:3:after,n0s1i0:3:error", {"n0s2i0"}),
    ],
)
def test_survivors_finish_every_step_once_with_the_single_process_weights(
    tmp_path: Path, kill: str, lost: set[str]
) -> None:
    agent, status, logs = _run(tmp_path, kill)
    assert status == 0, status
    assert {loss.member for loss in agent.losses} == lost
    assert all(loss.returncode == -9 for loss in agent.losses), agent.losses  # SIGKILL, as the worker sent
    assert agent.epoch >= 1
    _check_survivors(tmp_path, logs, lost)
    survivors = set(logs) - lost
    # the step of the (first) failure: replayed at least once by every survivor, unless the dead member's vote
    # completed a commit (the "voted" case), and then the next step is the one replayed
    replays = {m: sum(r["aborted"] for r in logs[m]) for m in survivors}
    assert all(n >= 1 for n in replays.values()), replays


@pytest.mark.timeout(120)
def test_without_a_failure_one_epoch_commits_every_step(tmp_path: Path) -> None:
    agent, status, logs = _run(tmp_path, "")
    assert status == 0 and agent.losses == [] and agent.epoch == 0
    assert all(r["aborted"] == 0 and r["epoch"] == 0 and len(r["members"]) == 3 for v in logs.values() for r in v)
    _check_survivors(tmp_path, logs, set())


@pytest.mark.timeout(60)
def test_the_agent_runs_from_the_command_line_and_reports_the_loss(tmp_path: Path) -> None:
    env = {**os.environ, "FT_KILL": "n0s1i0:2:before"}
    cmd = [sys.executable, "-m", "lightning_sync.launch.agent", "--nproc", "2", "--", sys.executable, str(WORKER)]
    done = subprocess.run([*cmd, str(tmp_path)], env=env, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert "rank process n0s1i0 exited with status -9" in done.stderr
    assert "epoch 1 continues with 1 members: n0s0i0" in done.stderr
    logs = {p.stem: [json.loads(line) for line in p.read_text().splitlines()] for p in tmp_path.glob("*.jsonl")}
    _check_survivors(tmp_path, logs, {"n0s1i0"})


# 40 steps of 50 ms, and on until the replacement a test names (FT_UNTIL_MEMBER) has committed a step: a replacement
# (a fresh interpreter that imports torch, 2 s or more here) joins mid-run however long it takes to start
SLOW = {"FT_STEPS": "40", "FT_STEP_S": "0.05"}


def _epochs(logs: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    """The members of each epoch that committed a step, in epoch order."""
    return [list(m) for _, m in sorted({(r["epoch"], tuple(r["members"])) for v in logs.values() for r in v})]


@pytest.mark.timeout(120)
def test_a_replacement_heals_from_a_live_member_and_the_job_is_back_to_three(tmp_path: Path) -> None:
    agent, status, logs = _run(tmp_path, "n0s2i0:3:between", max_restarts=1, FT_UNTIL_MEMBER="n0s2i1", **SLOW)
    assert status == 0 and agent.restarts == 1
    assert _epochs(logs) == [["n0s0i0", "n0s1i0", "n0s2i0"], ["n0s0i0", "n0s1i0"], ["n0s0i0", "n0s1i0", "n0s2i1"]]
    first = logs["n0s2i1"][0]["step"]
    assert first > 3, first  # admitted at a later step boundary, after the survivors went on at 2 ranks
    # it started from zeros: only the heal from a live member can give it the survivors' (and one process's) weights
    _check_survivors(tmp_path, logs, {"n0s2i0"}, steps=40)


@pytest.mark.timeout(120)
def test_a_replacement_lost_while_it_heals_is_replaced_again(tmp_path: Path) -> None:
    agent, status, logs = _run(
        tmp_path, "n0s2i0:3:between,n0s2i1:*:heal", max_restarts=2, FT_UNTIL_MEMBER="n0s2i2", **SLOW
    )
    assert status == 0 and agent.restarts == 2
    assert [loss.member for loss in agent.losses] == ["n0s2i0", "n0s2i1"]
    assert "n0s2i1" not in logs or logs["n0s2i1"] == []  # it never committed a step
    assert _epochs(logs)[-1] == ["n0s0i0", "n0s1i0", "n0s2i2"]
    _check_survivors(tmp_path, logs, {"n0s2i0", "n0s2i1"}, steps=40)


@pytest.mark.timeout(120)
def test_rank_0_lost_and_replaced_hands_rank_0_to_a_member_that_holds_the_state(tmp_path: Path) -> None:
    agent, status, logs = _run(tmp_path, "n0s0i0:2:before", max_restarts=1, FT_UNTIL_MEMBER="n0s0i1", **SLOW)
    assert status == 0
    # the replacement comes last: rank 0, the heal's source, is a member that trained all along
    assert _epochs(logs)[1:] == [["n0s1i0", "n0s2i0"], ["n0s1i0", "n0s2i0", "n0s0i1"]]
    _check_survivors(tmp_path, logs, {"n0s0i0"}, steps=40)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_five_losses_in_one_run_with_replacements(tmp_path: Path) -> None:
    """A rank lost, then each of its replacements lost a few steps after it joined, at points all over a step, five
    losses in all; the job keeps going, the sixth incarnation joins, and every step is committed once with the
    one-process result."""
    kill = "n0s2i0:2:between,n0s2i1:+2:before,n0s2i2:+3:after,n0s2i3:+1:voted,n0s2i4:+2:between"
    agent, status, logs = _run(
        tmp_path, kill, max_restarts=5, FT_STEPS="20", FT_STEP_S="0.03", FT_UNTIL_MEMBER="n0s2i5"
    )
    assert status == 0
    lost = {f"n0s2i{i}" for i in range(5)}
    assert {loss.member for loss in agent.losses} == lost, agent.losses
    _check_survivors(tmp_path, logs, lost, steps=20)
    assert _epochs(logs)[-1] == ["n0s0i0", "n0s1i0", "n0s2i5"]


@pytest.mark.timeout(120)
def test_a_hung_rank_is_killed_by_its_agent_and_replaced(tmp_path: Path) -> None:
    """SIGSTOP between a step's two all-reduces: its peers block in the second one with it (no socket closes). Its
    heartbeat stands still, so the agent kills it after 5 s (a healthy rank beats every 0.1 s; 5 s leaves room for
    a loaded 2-core machine); the survivors then see it lost and go on, and a replacement joins."""
    agent, status, logs = _run(
        tmp_path, "n0s2i0:3:hang", max_restarts=1, hang_timeout=5.0, FT_UNTIL_MEMBER="n0s2i1", **SLOW
    )
    assert status == 0
    assert agent.hung == ["n0s2i0"] and [(x.member, x.returncode) for x in agent.losses] == [("n0s2i0", -9)]
    assert _epochs(logs)[-1] == ["n0s0i0", "n0s1i0", "n0s2i1"]
    _check_survivors(tmp_path, logs, {"n0s2i0"}, steps=40)


def _run_two_nodes(
    tmp_path: Path, kill: str, max_restarts: int = 0, hang_timeout: float = 10.0, until: str = ""
) -> tuple[Agent, int, int, dict[str, list[dict[str, Any]]]]:
    """Two emulated nodes: node 0's agent here with 2 ranks, node 1's agent a process of its own with 1 rank
    (``python -m lightning_sync.launch.agent --node 1 ...``). The agent, its status, node 1's agent's status
    and each member's log."""
    env = {"FT_KILL": kill, **SLOW, "FT_UNTIL_MEMBER": until}
    agent = Agent(
        [sys.executable, str(WORKER), str(tmp_path)],
        2,
        nnodes=2,
        env=env,
        max_restarts=max_restarts,
        hang_timeout=hang_timeout,
    )
    status, node1_status = run_with_node_1(agent, [sys.executable, str(WORKER), str(tmp_path)], 1, env)
    logs = {p.stem: [json.loads(line) for line in p.read_text().splitlines()] for p in tmp_path.glob("*.jsonl")}
    return agent, status, node1_status, logs


@pytest.mark.timeout(120)
def test_a_rank_lost_on_another_node_is_replaced_by_that_nodes_agent(tmp_path: Path) -> None:
    agent, status, node1_status, logs = _run_two_nodes(tmp_path, "n1s0i0:3:between", max_restarts=1, until="n1s0i1")
    assert status == 0 and node1_status == 0
    assert [(x.member, x.returncode) for x in agent.losses] == [("n1s0i0", -9)]  # reported by node 1's agent
    assert _epochs(logs) == [["n0s0i0", "n0s1i0", "n1s0i0"], ["n0s0i0", "n0s1i0"], ["n0s0i0", "n0s1i0", "n1s0i1"]]
    _check_survivors(tmp_path, logs, {"n1s0i0"}, steps=40)


@pytest.mark.timeout(120)
def test_a_lost_node_leaves_the_other_node_training(tmp_path: Path) -> None:
    """Node 1's agent is killed: its rank dies with it (it waits for nothing else), node 0 sees the agent's beat
    stand still for 3 s and loses the node; node 0's two ranks finish every step."""
    agent, status, node1_status, logs = _run_two_nodes(tmp_path, "n1s0i0:3:agent", max_restarts=1, hang_timeout=3.0)
    assert status == 0 and node1_status == -9
    assert agent.lost_nodes == [1] and [(x.member, x.returncode) for x in agent.losses] == [("n1s0i0", -1)]
    assert agent.restarts == 0  # nowhere to start it: its node is gone
    assert _epochs(logs) == [["n0s0i0", "n0s1i0", "n1s0i0"], ["n0s0i0", "n0s1i0"]]
    _check_survivors(tmp_path, logs, {"n1s0i0"}, steps=40)
