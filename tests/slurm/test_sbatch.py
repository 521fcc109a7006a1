"""The rendered sbatch route on real Slurm: ``lightning-sync sbatch`` for 2 nodes x 2 tasks, submitted as
it is. World size, node and local ranks come from Slurm; a job name full of shell syntax stays a literal
string (nothing in it runs); and the job trains with BucketedDDP's hierarchical all-reduce (reduce within
each node, all-reduce between the two node leaders, broadcast within each node), so the one 2 x 2 job also
checks that the node groups Slurm's layout yields reduce like the flat all-reduce of the same job on 4 local
ranks. (The flat all-reduce on Slurm nodes is the 2 x 1 tests', test_train_on_slurm and the submitit route's.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _local_runs import LocalRuns
from support.slurm_cluster import SlurmCluster
from test_train_on_slurm import TRAIN, _metrics, assert_same_metrics, submit_rendered


@pytest.mark.timeout(480)
def test_rendered_script_trains_two_by_two_hierarchically_and_shell_syntax_stays_literal(
    slurm: SlurmCluster, tmp_path: Path, local_runs: LocalRuns
) -> None:
    marker = tmp_path / "pwned"
    hostile = f"launch.job_name='x$(touch {marker}); `touch {marker}` \"q'"
    overrides = [
        "launch.nodes=2",
        "trainer.devices=2",
        *TRAIN,
        "strategy.comm_algorithm=hierarchical",
        f"hydra.run.dir={tmp_path / 'run'}",
        hostile,
    ]
    job, script = submit_rendered(slurm, tmp_path, overrides)
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=2" in script
    slurm.wait_job(job, timeout=420)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    banners = re.findall(r"node (\d) of 2 on host \S+: local rank 0, global rank (\d), world size 4, backend gloo", log)
    assert sorted(banners) == [("0", "0"), ("1", "2")], log[-4000:]  # ranks 0-1 on n1, 2-3 on n2
    name = slurm.run("scontrol", "show", "job", job).stdout
    assert f'JobName=x$(touch {marker}); `touch {marker}` "q' in name, name  # the literal name
    assert not marker.exists(), "a command inside the job name ran"
    assert re.search(r"all-reduce: hierarchical", log), log[-3000:]
    on_slurm = _metrics(log, ranks=4)
    assert_same_metrics(on_slurm, _metrics(local_runs.run(4, TRAIN).text, ranks=4))  # the flat all-reduce
