"""Submission through Hydra on real Slurm: ``lightning-sync train -m launch=slurm ...`` hands the job to
hydra-submitit-launcher, which writes its own sbatch script, submits it and waits for the result. Checked
for 2 nodes x 2 tasks (2 x 1 is the requeue test's, test_requeue_on_slurm, which checks the same through a
requeue): Slurm's ranks (node, local, global, world size) in the banners, and final weights equal to the same
job on 4 local ranks (itself checked against a single process by
the multi-process tier). Both runs use one intra-op thread per rank (the launch config exports
OMP_NUM_THREADS=cpus_per_task; Lightning's local launcher does the same on 2 cores), so the same batches go
through the same ops in the same order: bitwise equal."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
from _local_runs import LocalRuns
from support.cli_ranks import weights
from support.slurm_cluster import SlurmCluster
from test_train_on_slurm import TRAIN as LOCAL_TRAIN
from test_train_on_slurm import _cli

TRAIN = [
    "strategy=bucketed_ddp",
    "trainer.max_steps=20",
    "trainer.max_epochs=-1",
    "trainer.enable_progress_bar=false",
    "trainer.enable_checkpointing=false",
    "seed=0",
    "final_validate=false",
    "sample_chars=0",
]


@pytest.mark.timeout(560)
def test_hydra_submitit_job_has_slurm_ranks_and_trains_like_local_ranks(
    slurm: SlurmCluster, tmp_path: Path, local_runs: LocalRuns
) -> None:
    tasks = 2
    world = 2 * tasks
    sweep = tmp_path / "multirun"
    submit = subprocess.run(
        [
            _cli(),
            "train",
            "-m",
            "launch=slurm",
            "launch.nodes=2",
            f"trainer.devices={tasks}",
            *TRAIN,
            f"hydra.sweep.dir={sweep}",
            f"final_checkpoint={tmp_path / 'slurm.ckpt'}",
        ],
        capture_output=True,
        text=True,
        timeout=480,
        cwd=tmp_path,
        env=slurm.env,
        check=False,
    )
    logs = "\n".join(p.read_text(errors="replace") for p in sorted(sweep.glob(".submitit/*/*_log.*")))
    assert submit.returncode == 0, f"{submit.stderr[-3000:]}\n{logs[-3000:]}\n{slurm.logs()}"
    script = next(sweep.glob(".submitit/*/*_submission.sh")).read_text()
    assert "#SBATCH --nodes=2" in script and f"#SBATCH --ntasks-per-node={tasks}" in script, script
    assert "#SBATCH --signal=USR1@90" in script and "#SBATCH --requeue" in script, script  # ours, not USR2
    banners = re.findall(
        rf"node (\d) of 2 on host \S+: local rank 0, global rank (\d), world size {world}, "
        r"backend gloo",
        logs,
    )
    assert sorted(banners) == [("0", "0"), ("1", str(tasks))], logs[-4000:]
    assert f"final metrics ({world} ranks, 20 steps)" in logs, logs[-4000:]
    # the local job with final validation: the weights are saved before it, so they are the same job's
    on_slurm, expected = weights(tmp_path / "slurm.ckpt"), local_runs.run(world, LOCAL_TRAIN).weights
    assert on_slurm.keys() == expected.keys()
    for key in expected:
        assert torch.equal(on_slurm[key], expected[key]), (key, (on_slurm[key] - expected[key]).abs().max().item())
