"""A lost process under the asynchronous strategies, through the CLI: ``async_ps`` (one process per rank) with a
worker or the server SIGKILLed, and ``hogwild`` with a worker SIGKILLed.

None is survivable (both refuse the fault-tolerance agent): the job must end, naming what was lost, and a rerun
resumes from the newest checkpoint as for any strategy.

* **A worker lost.** It never pushes again, so the others end up waiting for it (on the staleness bound, or at the
  end of training for every worker to finish). The server fails every waiting and later request once a worker it
  waits for has sent nothing for the strategy's ``timeout``, naming it; every rank then exits non-zero.
* **The server lost.** Every worker's next request fails at once, naming the server's rank.
* **A Hogwild worker lost.** Lightning's launcher, waiting on its worker processes, ends the job at once, naming the
  process and the signal (its other workers are stopped with it).
* **Hogwild's launching process lost** (it holds no state: it waits on the workers): every worker dies with it,
  instead of training on unwatched to the end of its run (torch's workers ask for SIGINT when their parent dies,
  which a background job started by a shell ignores).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.cli_ranks import finish, launch

TIMEOUT_S = 8  # the strategy's timeout: how long the server waits on a silent worker
# a hang guard for the survivor's exit, not a timing assertion: the timeout plus a loaded machine's slack
WITHIN_S = TIMEOUT_S + 60


def _kill(tmp_path: Path, victim: int) -> tuple[int, str]:
    """Two ranks of the digits job under ``async_ps`` (the server on rank 0); ``victim`` dies by SIGKILL in the
    forward of step 5. The survivor's exit code and output."""
    fault = (
        f"+diagnostics.fault={{_target_: lightning_sync.diagnostics.faults.KillAtStep, rank: {victim}, step: 5, "
        f"phase: forward}}"
    )
    overrides = ["trainer.max_steps=40", "strategy=async_ps", f"strategy.timeout={TIMEOUT_S}", fault]
    procs = launch(2, tmp_path, overrides)
    survivor = procs[1 - victim]
    try:
        procs[victim].wait(timeout=240)
        assert procs[victim].returncode == -9, procs[victim].returncode
        try:
            text, _ = survivor.communicate(timeout=WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {1 - victim} was still running {WITHIN_S} s after rank {victim} died")
    finally:
        finish(procs, timeout=5)
    return survivor.returncode, text


@pytest.mark.timeout(300)
def test_a_lost_worker_ends_the_job_after_the_timeout_naming_it(tmp_path: Path) -> None:
    code, text = _kill(tmp_path, victim=1)
    assert code != 0, text[-3000:]
    assert f"parameter server: worker 1 sent nothing for {TIMEOUT_S} s" in text, text[-3000:]


@pytest.mark.timeout(300)
def test_a_lost_server_ends_every_worker_at_its_next_request_naming_it(tmp_path: Path) -> None:
    code, text = _kill(tmp_path, victim=0)
    assert code != 0, text[-3000:]
    assert "the parameter server on rank 0 is unreachable" in text, text[-3000:]


@pytest.mark.timeout(300)
def test_a_lost_hogwild_worker_ends_the_job_naming_it(tmp_path: Path) -> None:
    fault = "{_target_: lightning_sync.diagnostics.faults.KillAtStep, rank: 1, step: 5, phase: forward}"
    command = [sys.executable, "-m", "lightning_sync", "train", f"hydra.run.dir={tmp_path / 'run'}"]
    command += ["strategy=hogwild", "trainer.max_steps=40", f"+diagnostics.fault={fault}"]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "process 1 terminated with signal SIGKILL" in proc.stderr, proc.stderr[-3000:]


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "zombie" in status.read_text())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.timeout(300)
def test_hogwild_workers_die_with_their_launching_process(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "lightning_sync", "train", f"hydra.run.dir={tmp_path / 'run'}"]
    command += ["strategy=hogwild", "trainer.max_steps=100000", "trainer.max_epochs=1000"]
    # started as a shell starts a background job (`python train.py &`, a Slurm script's usual line), which ignores
    # SIGINT: torch's workers ask for SIGINT when their parent dies, so those would train on
    launcher = subprocess.Popen(
        command,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # noqa: PLW1509
    )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while len(workers) < 2 and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.5)
            workers = _children(launcher.pid)
        assert len(workers) == 2, f"the launcher did not start its 2 workers: {workers}"
        time.sleep(3)  # into training
        launcher.kill()
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 30  # a hang guard: the kernel signals them at once
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(w) for w in workers), f"workers {workers} outlived their launcher"
    finally:
        for pid in [launcher.pid, *workers]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
