"""Live fault tolerance for ``local_sgd`` and ``diloco``: a period is committed whole or trained again.

Each case runs :mod:`support.ft_trainer` as 3 rank processes under the agent with the periodic strategy, and kills
one or two of them. The guarantee under test: a period is committed only by the members that finished it (its
sync inside the vote), and a period that lost a member is trained again from its start by the survivors, on the
same global batches shared out over them; so every sample of the global order is trained once, in committed
periods, and the run equals replicas trained on each committed period's shares. :mod:`support.periodic_reference`
trains exactly that in one process, following the membership rank 0 recorded for each step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support import ft_trainer
from support.periodic_reference import period_end, simulate
from test_live_lightning import _run

# float32 on 1-3 replicas: the shares and the averages only reorder additions (measured 6e-8 to 6e-7 after 12-40
# steps with losses, replays and a heal); the bar the issue sets for replicated strategies is 5e-5
TOL = 5e-5


def _period_end(env: dict[str, str], step: int) -> int:
    return period_end(env["FT_STRATEGY"], step, int(env["FT_SYNC_EVERY"]), int(env.get("FT_WARMUP", 0)))


pytestmark = [pytest.mark.timeout(240)]


def _check(
    env: dict[str, str], records: dict[str, dict[str, Any]], members: int, failures: int, counts: bool = True
) -> None:
    """Every member that finished ran every step and holds the one-process simulation's weights (and with
    ``counts``, counted each sample it trained once in its logged metrics)."""
    steps = int(env["FT_STEPS"])
    assert records, "no member finished"
    schedule = max((r["members"] for r in records.values()), key=len)  # a replacement's starts at its admission
    final = next(iter(records.values()))["final_members"]
    want = simulate(
        env["FT_STRATEGY"],
        schedule,
        int(env["FT_BATCH"]),
        int(env["FT_ACCUMULATE"]),
        steps,
        int(env["FT_SYNC_EVERY"]),
        int(env.get("FT_WARMUP", 0)),
        env["FT_LR_INTERVAL"],
        final,
    )
    for member, record in records.items():
        assert record["global_step"] == steps and record["ft/members"] == members, (member, record)
        mine = record["members"]
        assert mine == {step: schedule[step] for step in mine}, member  # every member saw the same memberships
        for name, value in want[member].items():
            torch.testing.assert_close(record["weights"][name], value, rtol=0, atol=TOL, msg=f"{member} {name}")
    # every sample of its committed shares counted once, in its torchmetrics metric (the whole run) and in
    # Lightning's epoch sum (the last epoch), the periods' failed attempts forgotten
    batch, accumulate = int(env["FT_BATCH"]), int(env["FT_ACCUMULATE"])
    per_epoch = -(-480 // batch) // accumulate  # 1438 samples padded to 1440: 480 a rank at the nominal 3
    for member, record in records.items() if counts else ():
        ends = {k: _period_end(env, int(k)) for k in record["members"]}
        committed = {k: schedule[str(end)] if end < steps else final for k, end in ends.items()}
        count = ft_trainer.samples_trained(member, committed, batch, accumulate, 3)
        last_epoch = ft_trainer.samples_trained(
            member, committed, batch, accumulate, 3, since=(steps - 1) // per_epoch * per_epoch
        )
        assert (record["seen_metric"], record["seen_logged"]) == (count, last_epoch), (member, record)
    survivors = [r for m, r in records.items() if m.endswith("i0")]
    assert all(r["ft/failures"] == failures for r in survivors), records
    # the test can tell: the same run without its losses ends elsewhere
    uninterrupted = {step: ["n0s0i0", "n0s1i0", "n0s2i0"] for step in schedule}
    other = simulate(env["FT_STRATEGY"], uninterrupted, int(env["FT_BATCH"]), int(env["FT_ACCUMULATE"]), steps,
                     int(env["FT_SYNC_EVERY"]), int(env.get("FT_WARMUP", 0)), env["FT_LR_INTERVAL"])  # fmt: skip
    first = next(m for m in records if m in other)  # one there all along
    gap = max((other[first][k] - want[first][k]).abs().max().item() for k in want[first])
    assert gap > 4 * TOL, gap  # 0.03 after 12 local steps; 4.5e-4 when most steps are the synchronous warm-up


def test_local_sgd_loses_a_rank_in_its_warm_up_and_another_inside_a_period(tmp_path: Path) -> None:
    """Rank 2 dies in a warm-up step's backward (its all-reduce in flight: that step, a period of its own, is
    trained again by two), rank 1 in the forward of an inner step: the period is trained again from its start by
    rank 0 alone. Micro-batches of 15 shared 8/7, accumulation 2, a learning rate that changes every step."""
    env = {"FT_STRATEGY": "local_sgd", "FT_SYNC_EVERY": "3", "FT_WARMUP": "2", "FT_STEPS": "14"}
    env.update(FT_BATCH="5", FT_ACCUMULATE="2", FT_LR_INTERVAL="step", FT_KILL="n0s2i0:1:backward,n0s1i0:6:forward")
    agent, status, records = _run(tmp_path, **env)
    assert status == 0 and [loss.member for loss in agent.losses] == ["n0s2i0", "n0s1i0"], agent.losses
    assert list(records) == ["n0s0i0"]
    assert records["n0s0i0"]["members"]["1"] == ["n0s0i0", "n0s1i0"]
    assert records["n0s0i0"]["members"]["7"] == ["n0s0i0"]  # the period 5-7 committed by rank 0 alone
    _check(env, records, members=1, failures=2)


def test_diloco_loses_rank_0_and_heals_a_replacement_across_an_epoch(tmp_path: Path) -> None:
    """Rank 0 dies before an inner step's optimizer step; the survivors train the period again and its successor
    takes over; the replacement is admitted at a period's start and takes the global model, the outer momentum
    and the counters from a live peer. The run crosses an epoch (30 steps of 48 samples each), with a period
    spanning it, and the learning rate changes every step."""
    env = {"FT_STRATEGY": "diloco", "FT_SYNC_EVERY": "4", "FT_STEPS": "40", "FT_BATCH": "16", "FT_ACCUMULATE": "1"}
    env.update(FT_LR_INTERVAL="step", FT_KILL="n0s0i0:5:step", FT_STEP_S="0.05", FT_UNTIL_MEMBER="n0s0i1")
    agent, status, records = _run(tmp_path, max_restarts=1, **env)
    assert status == 0 and agent.restarts == 1, agent.losses
    assert sorted(records) == ["n0s0i1", "n0s1i0", "n0s2i0"]
    assert records["n0s0i1"]["ft/failures"] == 0 and records["n0s0i1"]["rank"] == 2  # joined last
    _check(env, records, members=3, failures=1)


def test_local_sgd_checkpoints_inside_a_period_are_whole_or_passed_over(tmp_path: Path) -> None:
    """A checkpoint inside a period averages the replicas (a collective); rank 1 dies while the step-6 one is
    assembled: that one is passed over, every file written is whole, and the period is trained again."""
    env = {"FT_STRATEGY": "local_sgd", "FT_SYNC_EVERY": "4", "FT_STEPS": "12", "FT_BATCH": "8", "FT_ACCUMULATE": "1"}
    env.update(FT_LR_INTERVAL="epoch", FT_KILL="n0s1i0:6:save", FT_CKPT_EVERY="2")
    agent, status, records = _run(tmp_path, **env)
    assert status == 0 and [loss.member for loss in agent.losses] == ["n0s1i0"]
    _check(env, records, members=2, failures=1)
    saved = sorted(
        torch.load(path, weights_only=True)["global_step"] for path in (tmp_path / "run" / "ckpt").glob("*.ckpt")
    )
    assert saved == [2, 4, 8, 10, 12], saved


def test_a_loss_between_two_windows_replays_the_next_from_its_own_start(tmp_path: Path) -> None:
    """Rank 1 dies while the step-6 checkpoint is assembled, after warm-up step 5 was committed and before step 6,
    a period of its own, began: step 6's only micro-batch is skipped by the failure already recorded, and its
    replay must start from step 6's start, not from the last window that began (step 5's, already committed)."""
    env = {"FT_STRATEGY": "local_sgd", "FT_SYNC_EVERY": "3", "FT_WARMUP": "8", "FT_STEPS": "14", "FT_BATCH": "8"}
    env.update(FT_ACCUMULATE="1", FT_LR_INTERVAL="step", FT_KILL="n0s1i0:6:save", FT_CKPT_EVERY="2")
    agent, status, records = _run(tmp_path, **env)
    assert status == 0 and [loss.member for loss in agent.losses] == ["n0s1i0"]
    _check(env, records, members=2, failures=1)


def test_a_loss_in_the_last_period_a_fit_ends_inside_is_trained_again_at_its_end(tmp_path: Path) -> None:
    """The fit ends inside a period (14 steps, H = 4: steps 12 and 13 never reach a sync) and rank 2 dies in step
    12: at the fit's end the members vote on those steps, and the survivors train them again for the two of them,
    so each ends with its own replica trained on the shares of the whole global batches (not synchronized, as any
    fit that ends inside a period). The logged counts are not checked: Lightning logs the epoch's aggregates before
    the strategy's ``on_train_end``, where that vote runs, so they include the steps' first attempt."""
    env = {"FT_STRATEGY": "local_sgd", "FT_SYNC_EVERY": "4", "FT_STEPS": "14", "FT_BATCH": "8", "FT_ACCUMULATE": "1"}
    env.update(FT_LR_INTERVAL="step", FT_KILL="n0s2i0:12:forward")
    agent, status, records = _run(tmp_path, **env)
    assert status == 0 and [loss.member for loss in agent.losses] == ["n0s2i0"]
    assert records["n0s0i0"]["final_members"] == ["n0s0i0", "n0s1i0"]  # the fit's end committed by the two
    _check(env, records, members=2, failures=1, counts=False)
