"""Hierarchical all-reduce on real Slurm, 2 nodes x 2 tasks: BucketedDDP with ``comm_algorithm=hierarchical``
(reduce within each node, all-reduce between the two node leaders, broadcast within each node) trains
like the flat all-reduce on 4 local ranks, and its inter-node traffic crosses only between the leaders."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from test_train_on_slurm import TOL, TRAIN, _cli, _metrics

from lightning_sync.testing.slurm_cluster import SlurmCluster


@pytest.mark.timeout(480)
def test_hierarchical_on_two_by_two_equals_flat(slurm: SlurmCluster, tmp_path: Path) -> None:
    overrides = [*TRAIN, "strategy.comm_algorithm=hierarchical", "launch.nodes=2", "trainer.devices=2"]
    render = subprocess.run([_cli(), "sbatch", *overrides, f"hydra.run.dir={tmp_path / 'run'}"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert render.returncode == 0, render.stderr[-3000:]
    script = tmp_path / "job.sh"
    script.write_text(render.stdout)
    job = slurm.run("sbatch", "--parsable", f"--chdir={tmp_path}", str(script)).stdout.strip().split(";")[0]
    slurm.wait_job(job, timeout=420)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert re.search(r"all-reduce: hierarchical", log), log[-3000:]
    on_slurm = _metrics(log, ranks=4)
    flat = subprocess.run([_cli(), "train", *TRAIN, "trainer.devices=4", f"hydra.run.dir={tmp_path / 'flat'}"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert flat.returncode == 0, flat.stderr[-3000:]
    expected = _metrics(flat.stdout + flat.stderr, ranks=4)
    for key in ("val_loss", "val_acc"):
        assert abs(on_slurm[key] - expected[key]) <= TOL, (key, on_slurm, expected)
