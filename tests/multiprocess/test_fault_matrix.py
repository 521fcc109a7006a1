"""The fault matrix: a rank SIGKILLed at each phase of a step, for each strategy, through the CLI, launched
the way torchrun or a cluster launches (one process per rank, rank variables in the environment).

For every cell (phase x strategy), rank 1 dies by SIGKILL in optimizer step 7 (``lightning_sync.diagnostics.faults.
KillAtStep``; the checkpoint phase at the step-8 checkpoint, the requeue phase in the preemption checkpoint
that its own SIGUSR1 asks for at the end of step 7):

* **The job fails fast, naming the lost rank.** Rank 0 exits non-zero within ``LOST_WITHIN_S`` seconds of
  rank 1's death, its error naming rank 1 (the hang watchdog, on by default in ``lightning-sync train``).
* **The relaunch resumes from the newest complete checkpoint** (``ckpt_path=last`` with ``launch.signal``:
  the step-6 checkpoint in every cell; a half-written step-8 or preemption checkpoint is passed over) and
  trains to step 10.
* **Its final weights equal the uninterrupted run's**, bitwise: the data position, the RNG streams, the
  optimizer state and, for local SGD and DiLoCo, every rank's replica and the outer state are restored,
  so the resumed run performs the same operations on the same values.

Each cell's figures (rank 0's exit time, the step resumed from, the largest weight difference) are written
to ``$LIGHTNING_SYNC_FAULT_MATRIX`` as JSON when that variable names a file; ``docs/reliability.md`` holds the
table of a full run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.cli_ranks import Rank, finish, launch, weights

WORLD, STEPS, KILL_STEP = 2, 10, 7
CHECKPOINT_EVERY = 2  # so the newest complete checkpoint before the kill is step 6's
LOST_WITHIN_S = 30.0  # rank 0's exit after rank 1's death (measured: 2-7 s; a hang would be the 300 s timeout)
STRATEGIES = {  # every periodic strategy syncs every 4 steps: a sync falls on both sides of the kill
    "bucketed_ddp": ["strategy=bucketed_ddp", "strategy.bucket_cap_mb=0.01"],
    "zero3": ["strategy=zero3"],
    "local_sgd": ["strategy=local_sgd", "strategy.sync_every=4"],
    "diloco": ["strategy=diloco", "strategy.sync_every=4"],
}
PHASES = {
    "forward": KILL_STEP,
    "backward": KILL_STEP,
    "optimizer_step": KILL_STEP,
    "checkpoint": KILL_STEP + 1,
    "requeue": KILL_STEP,
}


def _launch(run_dir: Path, strategy: str, *overrides: str) -> list[Rank | subprocess.Popen[str]]:
    return launch(
        WORLD,
        run_dir,
        [
            f"trainer.max_steps={STEPS}",
            f"checkpoint.every_n_train_steps={CHECKPOINT_EVERY}",
            "launch.signal=USR1",
            *STRATEGIES[strategy],
            *overrides,
        ],
    )


def _run_ok(run_dir: Path, strategy: str, *overrides: str) -> str:
    results = finish(_launch(run_dir, strategy, *overrides), timeout=240)
    for rank, (code, text) in enumerate(results):
        assert code == 0, f"{run_dir.name} rank {rank} failed:\n{text[-3000:]}"
    return results[0][1]


def _record(cell: dict[str, Any]) -> None:
    target = os.environ.get("LIGHTNING_SYNC_FAULT_MATRIX")
    if target:
        with open(target, "a") as f:
            f.write(json.dumps(cell) + "\n")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    finals = {}
    for strategy in STRATEGIES:
        run_dir = tmp_path_factory.mktemp(f"uninterrupted-{strategy}")
        _run_ok(run_dir, strategy)
        finals[strategy] = weights(run_dir / "final.ckpt")
    return finals


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("phase", list(PHASES))
def test_a_rank_killed_at_any_phase_is_named_and_the_relaunch_ends_where_an_uninterrupted_run_does(
    tmp_path: Path, uninterrupted: dict[str, dict[str, torch.Tensor]], strategy: str, phase: str
) -> None:
    fault = (
        f"+diagnostics.fault={{_target_: lightning_sync.diagnostics.faults.KillAtStep, rank: 1, "
        f"step: {PHASES[phase]}, phase: {phase}}}"
    )
    procs = _launch(tmp_path, strategy, fault)
    try:
        procs[1].wait(timeout=240)
        died = time.monotonic()
        try:  # the bound as the wait's timeout: a hang guard, not a timing assertion on a healthy run
            rank0_text, _ = procs[0].communicate(timeout=LOST_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"[{strategy} {phase}] rank 0 was still running {LOST_WITHIN_S} s after rank 1 died")
        exit_s = time.monotonic() - died
    finally:
        finish(procs, timeout=5)
    assert procs[1].returncode == -signal.SIGKILL, f"rank 1 was to die by SIGKILL: {procs[1].returncode}"
    assert procs[0].returncode != 0, f"rank 0 exited 0 after losing rank 1:\n{rank0_text[-3000:]}"
    assert re.search(r"RankLost: .*ranks \[1\] lost", rank0_text), f"rank 0 did not name rank 1:\n{rank0_text[-3000:]}"

    out = _run_ok(tmp_path, strategy, "ckpt_path=last")
    resumed_from = re.search(r"resuming from (\S+) \(global step (\d+)", out)
    assert resumed_from and int(resumed_from.group(2)) == KILL_STEP - 1, out[-3000:]
    resumed, reference = weights(tmp_path / "final.ckpt"), uninterrupted[strategy]
    assert resumed.keys() == reference.keys()
    diff = max((resumed[k].double() - reference[k].double()).abs().max().item() for k in reference)
    _record(
        {
            "strategy": strategy,
            "phase": phase,
            "exit_s": round(exit_s, 2),
            "resumed_step": int(resumed_from.group(2)),
            "max_abs_diff": diff,
        }
    )
    for name in reference:  # bitwise: same data order, same arithmetic, restored optimizer and strategy state
        assert torch.equal(resumed[name], reference[name]), f"[{strategy} {phase}] {name} differs by {diff}"
