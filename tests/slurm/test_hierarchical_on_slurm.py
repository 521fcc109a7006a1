"""Hierarchical all-reduce on real Slurm, 2 nodes x 2 tasks: BucketedDDP with ``comm_algorithm=hierarchical``
(reduce within each node, all-reduce between the two node leaders, broadcast within each node) trains
like the flat all-reduce on 4 local ranks, and its inter-node traffic crosses only between the leaders."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _local_runs import LocalRuns
from test_train_on_slurm import TRAIN, _metrics, assert_same_metrics, submit_rendered

from lightning_sync.testing.slurm_cluster import SlurmCluster


@pytest.mark.timeout(480)
def test_hierarchical_on_two_by_two_equals_flat(slurm: SlurmCluster, tmp_path: Path, local_runs: LocalRuns) -> None:
    overrides = [*TRAIN, "strategy.comm_algorithm=hierarchical", "launch.nodes=2", "trainer.devices=2"]
    job, _ = submit_rendered(slurm, tmp_path, [*overrides, f"hydra.run.dir={tmp_path / 'run'}"])
    slurm.wait_job(job, timeout=420)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert re.search(r"all-reduce: hierarchical", log), log[-3000:]
    on_slurm = _metrics(log, ranks=4)
    assert_same_metrics(on_slurm, _metrics(local_runs.run(4, TRAIN).text, ranks=4))  # the flat all-reduce
