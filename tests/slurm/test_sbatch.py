"""The rendered sbatch route on real Slurm: ``lightning-sync sbatch`` for 2 nodes x 2 tasks, submitted as
it is. World size, node and local ranks come from Slurm; the result equals the same job on 4 local
ranks; and a job name full of shell syntax stays a literal string (nothing in it runs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _local_runs import LocalRuns
from test_train_on_slurm import TRAIN, _metrics, assert_same_metrics, submit_rendered

from lightning_sync.testing.slurm_cluster import SlurmCluster


@pytest.mark.timeout(480)
def test_rendered_script_trains_two_by_two_and_shell_syntax_stays_literal(
    slurm: SlurmCluster, tmp_path: Path, local_runs: LocalRuns
) -> None:
    marker = tmp_path / "pwned"
    hostile = f"launch.job_name='x$(touch {marker}); `touch {marker}` \"q'"
    job, script = submit_rendered(
        slurm, tmp_path, ["launch.nodes=2", "trainer.devices=2", *TRAIN, f"hydra.run.dir={tmp_path / 'run'}", hostile]
    )
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=2" in script
    slurm.wait_job(job, timeout=420)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    banners = re.findall(r"node (\d) of 2 on host \S+: local rank 0, global rank (\d), world size 4, backend gloo", log)
    assert sorted(banners) == [("0", "0"), ("1", "2")], log[-4000:]  # ranks 0-1 on n1, 2-3 on n2
    name = slurm.run("scontrol", "show", "job", job).stdout
    assert f'JobName=x$(touch {marker}); `touch {marker}` "q' in name, name  # the literal name
    assert not marker.exists(), "a command inside the job name ran"
    on_slurm = _metrics(log, ranks=4)
    assert_same_metrics(on_slurm, _metrics(local_runs.run(4, TRAIN).text, ranks=4))
