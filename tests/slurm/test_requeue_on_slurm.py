"""Preemption on real Slurm: ``scancel --signal=USR1 --batch`` mid-run on a 2-node job submitted from the
rendered sbatch script. The batch shell passes the signal to srun's tasks; they stop at one optimizer step,
save atomically, rank 0 runs ``scontrol requeue``; Slurm runs the job again (same id, same run directory),
it resumes from the checkpoint, skipping the batches already trained, and finishes. Its final weights must
equal an uninterrupted run's bitwise: the same batches through the same ops in the same order (the
uninterrupted reference is the same job on 2 local ranks, itself checked against a single process by the
multi-process tier).

SlowRank (factor 20 on rank 0, in the first attempt) stretches the run so the signal lands mid-run; it only
sleeps, so it does not change any weight. Slurm holds a requeued job back for about two minutes (BeginTime);
the test releases it after two seconds with ``scontrol update StartTime=now``, as an operator would (:func:`_release`).
"""

from __future__ import annotations

import math
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
from _local_runs import LocalRuns
from support.cli_ranks import weights
from support.slurm_cluster import SlurmCluster
from test_train_on_slurm import _cli, submit_rendered

STEPS = 300
TRAIN = [
    "strategy=bucketed_ddp",
    f"trainer.max_steps={STEPS}",
    "trainer.max_epochs=-1",
    "trainer.enable_progress_bar=false",
    "trainer.enable_checkpointing=false",
    "seed=0",
    "final_validate=false",
    "sample_chars=0",
]
# Slow in the first attempt only: Slurm sets SLURM_RESTART_COUNT (1) when it runs the requeued job, which then
# trains at full speed (factor 1) instead of spending most of the test sleeping through the remaining steps.
SLOW = (
    "+trainer.callbacks=[{_target_:lightning_sync.diagnostics.SlowRank,rank:0,"
    "factor:'${oc.decode:${oc.env:SLURM_RESTART_COUNT,20}}'}]"
)


def _wait_for(path: Path, pattern: str, timeout: float, slurm: SlurmCluster, job: str) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        match = re.search(pattern, text)
        if match:
            return match
        time.sleep(0.2)
    slurm.run("scancel", job, check=False)
    raise TimeoutError(
        f"{pattern!r} not in {path} after {timeout:.0f}s (job {slurm.job_state(job)}):\n{text[-3000:]}\n{slurm.logs()}"
    )


def _release(slurm: SlurmCluster, job: str, timeout: float = 60.0) -> None:
    """Start the requeued job now instead of after Slurm's requeue hold (it must be PENDING again first).

    Not within the second its previous run was killed in: slurmd revokes a killed job's credential with a
    timestamp in whole seconds and refuses a launch whose new credential is no younger ("Job N already killed, do
    not launch batch job"; the job then ends FAILED), which is what Slurm's own requeue hold waits out. Releasing
    two whole seconds after the job is PENDING again (the kill came before that) leaves that second behind."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if slurm.job_state(job) == "PENDING":
            time.sleep(math.floor(time.time()) + 2 - time.time())
            slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
            return
        time.sleep(0.2)
    raise TimeoutError(
        f"job {job} is {slurm.job_state(job)}, not PENDING, {timeout:.0f}s after requeue\n{slurm.logs()}"
    )


@pytest.fixture(scope="module")
def uninterrupted(local_runs: LocalRuns) -> dict[str, torch.Tensor]:
    """Final weights of the same job on 2 local ranks, never interrupted (no SlowRank: it only sleeps)."""
    return local_runs.run(2, TRAIN).weights


@pytest.mark.timeout(600)
def test_usr1_mid_run_requeues_and_the_resumed_job_ends_with_the_uninterruptedweights(
    slurm: SlurmCluster, tmp_path: Path, uninterrupted: dict[str, torch.Tensor]
) -> None:
    run_dir = tmp_path / "run"
    job, _ = submit_rendered(
        slurm,
        tmp_path,
        [
            "launch.nodes=2",
            "trainer.devices=1",
            *TRAIN,
            SLOW,
            f"hydra.run.dir={run_dir}",
            f"final_checkpoint={tmp_path / 'slurm-final.ckpt'}",
        ],
    )
    log = tmp_path / f"slurm-{job}.out"
    _wait_for(log, r"node 1 of 2 on host", 180, slurm, job)
    time.sleep(6.0)  # past setup and the sanity check, into the training loop
    slurm.run("scancel", "--signal=USR1", "--batch", job)
    started = time.monotonic()
    saved = _wait_for(log, r"requeue: SIGUSR1 received here [\d.]+ s ago; saving at global step (\d+)", 120, slurm, job)
    stop_step = int(saved.group(1))
    assert 0 < stop_step < STEPS, saved.group(0)
    _wait_for(log, rf"requeue: job {job} requeued \(scontrol requeue\)", 60, slurm, job)
    _release(slurm, job)
    slurm.wait_job(job, timeout=420)
    requeue_s = time.monotonic() - started
    text = log.read_text()
    restarts = re.search(r"Restarts=(\d+)", slurm.run("scontrol", "show", "job", job).stdout)
    assert restarts and restarts.group(1) == "1", restarts
    assert re.search(
        rf"resuming from \S+requeue-step{stop_step:09d}\.ckpt \(global step {stop_step}, .*SLURM restart "
        r"count 1\)",
        text,
    ), text[-4000:]
    assert re.search(
        r"resume: epoch \d+ continues at sample \d+ of its global order of \d+ \(\d+ batches of \d+ on each of 2 "
        r"ranks already trained are skipped\)",
        text,
    ), text[-4000:]
    assert f"`Trainer.fit` stopped: `max_steps={STEPS}` reached." in text, text[-4000:]

    _assert_bitwise_equal(weights(tmp_path / "slurm-final.ckpt"), uninterrupted)
    print(f"preempted at step {stop_step}; signal to completion of the requeued job: {requeue_s:.1f} s")


@pytest.mark.timeout(600)
def test_the_hydra_submitit_route_requeues_and_resumes_too(
    slurm: SlurmCluster, tmp_path: Path, uninterrupted: dict[str, torch.Tensor]
) -> None:
    # submitit's batch shell does not trap signals, so the signal goes to the job's tasks (scancel without
    # --batch), which is where Slurm's --signal=USR1@90 sends it before the time limit as well
    sweep = tmp_path / "multirun"
    submit = subprocess.Popen(
        [
            _cli(),
            "train",
            "-m",
            "launch=slurm",
            "launch.nodes=2",
            "trainer.devices=1",
            *TRAIN,
            SLOW,
            f"hydra.sweep.dir={sweep}",
            f"final_checkpoint={tmp_path / 'slurm-final.ckpt'}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        env=slurm.env,
    )
    try:
        deadline = time.monotonic() + 120
        while not list(sweep.glob(".submitit/*/*_0_log.out")) and time.monotonic() < deadline:
            time.sleep(0.2)
        logs = list(sweep.glob(".submitit/*/*_0_log.out"))
        assert logs, "submitit never started the job"
        log, job = logs[0], logs[0].parent.name
        _wait_for(log, r"node 0 of 2 on host", 180, slurm, job)
        time.sleep(6.0)
        slurm.run("scancel", "--signal=USR1", job)
        saved = _wait_for(log, r"saving at global step (\d+)", 120, slurm, job)
        stop_step = int(saved.group(1))
        assert 0 < stop_step < STEPS, saved.group(0)
        _wait_for(log, rf"requeue: job {job} requeued \(scontrol requeue\)", 60, slurm, job)
        _release(slurm, job)
        out, _ = submit.communicate(timeout=420)  # the launcher waits through the requeue for the result
    finally:
        if submit.poll() is None:
            submit.kill()
            slurm.run("scancel", job, check=False)
    assert submit.returncode == 0, out[-4000:]
    text = log.read_text()
    assert re.search(rf"resuming from \S+requeue-step{stop_step:09d}\.ckpt \(global step {stop_step}", text), text[
        -4000:
    ]
    assert re.search(r"resume: epoch \d+ continues at sample \d+ of its global order", text), text[-4000:]
    assert f"final metrics (2 ranks, {STEPS} steps)" in text, text[-4000:]
    _assert_bitwise_equal(weights(tmp_path / "slurm-final.ckpt"), uninterrupted)
    # what the launcher wrote and Slurm made of it, 2 nodes x 1 task (test_submitit_on_slurm has 2 x 2)
    script = next(sweep.glob(".submitit/*/*_submission.sh")).read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script, script
    assert "#SBATCH --signal=USR1@90" in script and "#SBATCH --requeue" in script, script  # ours, not USR2
    every_log = "\n".join(p.read_text(errors="replace") for p in sorted(sweep.glob(".submitit/*/*_log.*")))
    banners = re.findall(
        r"node (\d) of 2 on host \S+: local rank 0, global rank (\d), world size 2, backend gloo", every_log
    )
    assert set(banners) == {("0", "0"), ("1", "1")}, every_log[-4000:]  # each attempt prints its own


def _assert_bitwise_equal(resumed: dict[str, torch.Tensor], whole: dict[str, torch.Tensor]) -> None:
    assert resumed.keys() == whole.keys()
    for key in whole:
        # bitwise: the same batches through the same ops in the same order (2 ranks, one thread each, both times)
        assert torch.equal(resumed[key], whole[key]), (key, (resumed[key] - whole[key]).abs().max().item())
