"""Elastic resume on real Slurm: a job preempted on 2 nodes is resubmitted on 1 node and finishes the run.

Both jobs are the same rendered command (``lightning-sync sbatch``), ``batch.global_size=32
batch.per_device=16 ckpt_path=last`` in one run directory; only ``launch.nodes`` differs (and SlowRank in the
first, which only sleeps). The first job derives accumulate 1 at world 2; ``scancel --signal=USR1 --batch``
stops it at an optimizer step with a preemption checkpoint, not requeued (``launch.requeue=false``): the
operator resubmits it on the one node left. That job derives accumulate 2 at world 1, resumes from the newest
of the preemption checkpoint and ``ckpt_path=last``'s ``last.ckpt`` (both hold the stop), continues epoch 0 at
the position the first job reached and trains to the same ``max_steps``. Every global batch is then the
uninterrupted 2-rank run's (the same job on 2 local ranks), so its final weights must equal that run's up to
float32 rounding.

The run stays inside epoch 0 (1438 training samples: 44 full global batches of 32). The epoch's last global
batch is short (30 samples), and there world 2 (15 + 15 samples, averaged across ranks) and world 1 with
accumulation (16 + 14, each micro-batch's mean halved) weight its samples differently, so past it a world-1
run differs from a world-2 one by ~4e-3 (measured at 60 steps, resumed or from scratch alike): that is
Lightning's accumulation, not the resume.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from _local_runs import LocalRuns
from support.cli_ranks import weights
from support.slurm_cluster import SlurmCluster
from test_requeue_on_slurm import _wait_for
from test_train_on_slurm import submit_rendered

STEPS = 40  # inside epoch 0 (module docstring)
EVERY = 4  # a ModelCheckpoint every 4 steps: its first file says the first job is in its training loop
TRAIN = [
    "strategy=bucketed_ddp",
    "batch.global_size=32",
    "batch.per_device=16",
    f"trainer.max_steps={STEPS}",
    "trainer.max_epochs=-1",
    "trainer.enable_progress_bar=false",
    f"checkpoint.every_n_train_steps={EVERY}",
    "seed=0",
    "final_validate=false",
    "sample_chars=0",
    "ckpt_path=last",
]
# Rank 0 of the first job sleeps 99x its compute time per step (~1 s a step on a loaded 2-core machine): the
# signal, sent once the step-4 checkpoint exists, lands long before step 40 even where steps are 10x faster. The
# first job stops one step after it, so the factor costs a few seconds; the second job runs at full speed.
SLOW = "+trainer.callbacks=[{_target_:lightning_sync.diagnostics.SlowRank,rank:0,factor:100}]"
# Final weights against the uninterrupted 2-rank run: the same samples in every optimizer step, but summed per
# micro-batch and accumulated on one rank instead of all-reduced across two, so float32 rounding differs.
# Measured max |difference| over 40 Adam steps (lr 3e-3): 2.1e-7 to 4.0e-7 for stops at steps 5, 13 and 22 on
# local ranks, 4.0e-7 on Slurm (3 runs, each stopped at step 5); 5e-6 is >10x that. A resume one global batch
# past its position moves them by 2.7e-2, one step that weights its samples differently (the epoch's last,
# docstring) by 3.8e-3.
TOL = 5e-6


def _finish(slurm: SlurmCluster, job: str, log: Path, timeout: float) -> str:
    """The job's output once it has completed; the output's tail as well as the daemons' logs if it did not."""
    try:
        slurm.wait_job(job, timeout=timeout)
    except (RuntimeError, TimeoutError) as err:
        raise AssertionError(f"{err}\n--- {log.name} ---\n{log.read_text()[-4000:] if log.exists() else ''}") from None
    return log.read_text()


def _wait_for_file(directory: Path, pattern: str, timeout: float, slurm: SlurmCluster, job: str) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(directory.glob(pattern)) if directory.is_dir() else []
        if found:
            return found[0]
        time.sleep(0.2)
    slurm.run("scancel", job, check=False)
    raise TimeoutError(f"no {pattern} in {directory} after {timeout:.0f}s (job {slurm.job_state(job)})\n{slurm.logs()}")


@pytest.mark.timeout(600)
def test_a_job_preempted_on_two_nodes_resumes_on_one_with_the_uninterrupted_weights(
    slurm: SlurmCluster, tmp_path: Path, local_runs: LocalRuns
) -> None:
    run_dir = tmp_path / "run"
    same = [*TRAIN, "trainer.devices=1", "launch.requeue=false", f"hydra.run.dir={run_dir}"]
    started = time.monotonic()
    first, _ = submit_rendered(slurm, tmp_path, ["launch.nodes=2", *same, SLOW])
    log = tmp_path / f"slurm-{first}.out"
    _wait_for_file(run_dir / "checkpoints", f"*step={EVERY}.ckpt", 240, slurm, first)
    slurm.run("scancel", "--signal=USR1", "--batch", first)
    saved = _wait_for(
        log, r"requeue: SIGUSR1 received here [\d.]+ s ago; saving at global step (\d+)", 120, slurm, first
    )
    stop = int(saved.group(1))
    assert EVERY < stop < STEPS, saved.group(0)
    text = _finish(slurm, first, log, 120)
    first_s = time.monotonic() - started
    assert "batch: global batch 32 = per_device 16 x world 2 x accumulate 1" in text, text[-4000:]
    assert "ckpt_path=last: no complete checkpoint found, training from scratch" in text, text[-4000:]
    assert f"preempted at global step {stop}: checkpoint " in text, text[-4000:]
    assert "requeue off (launch.requeue=false): rerun the command to resume" in text, text[-4000:]

    second, _ = submit_rendered(
        slurm, tmp_path, ["launch.nodes=1", *same, f"final_checkpoint={tmp_path / 'slurm-final.ckpt'}"]
    )
    text = _finish(slurm, second, tmp_path / f"slurm-{second}.out", 300)
    second_s = time.monotonic() - started - first_s
    assert "batch: global batch 32 = per_device 16 x world 1 x accumulate 2" in text, text[-4000:]
    # the candidates are the preemption checkpoint and ckpt_path=last's last.ckpt, which the ModelCheckpoint
    # wrote again when the first job stopped: the same step and state, so either may be taken
    assert re.search(
        rf"resuming from \S+/(requeue/requeue-step{stop:09d}|checkpoints/last)\.ckpt \(global step {stop}, the "
        rf"newest complete of \['\S+/requeue/requeue-step{stop:09d}\.ckpt', '\S+/checkpoints/last\.ckpt'\]",
        text,
    ), text[-4000:]
    # mid-epoch: stop global batches of 32 into epoch 0 are 2 x stop micro-batches of 16 for the one rank
    assert (
        f"resume: epoch 0 continues at sample {32 * stop} of its global order of 1438 ({2 * stop} batches of 16 "
        "on each of 1 ranks already trained are skipped)" in text
    ), text[-4000:]
    assert f"final metrics (1 ranks, {STEPS} steps)" in text, text[-4000:]

    # Without the resume line above, these weights alone would not tell a resumed run from a world-1 run
    # trained from scratch: it trains the same global batches (2e-7 from the reference, measured).
    resumed = weights(tmp_path / "slurm-final.ckpt")
    started = time.monotonic()
    whole = local_runs.run(2, TRAIN).weights
    local_s = time.monotonic() - started
    assert resumed.keys() == whole.keys()
    worst = max((resumed[k] - whole[k]).abs().max().item() for k in whole)
    print(
        f"preempted at step {stop} on 2 nodes, resumed on 1: max |weight difference| {worst:.3g}; "
        f"first job {first_s:.1f} s, second {second_s:.1f} s, the local 2-rank run {local_s:.1f} s"
    )
    assert worst <= TOL, worst
