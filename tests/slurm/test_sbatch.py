"""The rendered sbatch route on real Slurm: ``lightning-sync sbatch`` for 2 nodes x 2 tasks, submitted as
it is. World size, node and local ranks come from Slurm; the result equals the same job on 4 local
ranks; and a job name full of shell syntax stays a literal string (nothing in it runs)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from test_train_on_slurm import TOL, TRAIN, _cli, _metrics

from lightning_sync.testing.slurm_cluster import SlurmCluster


@pytest.mark.timeout(480)
def test_rendered_script_trains_two_by_two_and_shell_syntax_stays_literal(slurm: SlurmCluster,
                                                                         tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    hostile = f"launch.job_name='x$(touch {marker}); `touch {marker}` \"q'"
    render = subprocess.run([_cli(), "sbatch", "launch.nodes=2", "trainer.devices=2", *TRAIN,
                             f"hydra.run.dir={tmp_path / 'run'}", hostile], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert render.returncode == 0, render.stderr[-3000:]
    script = tmp_path / "job.sh"
    script.write_text(render.stdout)
    assert "#SBATCH --nodes=2" in render.stdout and "#SBATCH --ntasks-per-node=2" in render.stdout
    job = slurm.run("sbatch", "--parsable", f"--chdir={tmp_path}", str(script)).stdout.strip().split(";")[0]
    slurm.wait_job(job, timeout=420)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    banners = re.findall(r"node (\d) of 2 on host \S+: local rank 0, global rank (\d), world size 4, backend gloo", log)
    assert sorted(banners) == [("0", "0"), ("1", "2")], log[-4000:]  # ranks 0-1 on n1, 2-3 on n2
    name = slurm.run("scontrol", "show", "job", job).stdout
    assert f"JobName=x$(touch {marker}); `touch {marker}` \"q" in name, name  # the literal name
    assert not marker.exists(), "a command inside the job name ran"
    on_slurm = _metrics(log, ranks=4)
    local = subprocess.run([_cli(), "train", *TRAIN, "trainer.devices=4", f"hydra.run.dir={tmp_path / 'local'}"],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert local.returncode == 0, local.stderr[-3000:]
    expected = _metrics(local.stdout + local.stderr, ranks=4)
    for key in ("val_loss", "val_acc"):
        assert abs(on_slurm[key] - expected[key]) <= TOL, (key, on_slurm, expected)
