"""The rendered sbatch script, run by real bash, with a job name and overrides full of shell syntax
(``$(...)``, backticks, ``;``, single and double quotes): no injected command runs, and ``srun`` receives
every hostile string literally.

No Slurm here (tests/slurm/ submits to real daemons): bash runs the script as the batch step would,
with a stand-in ``srun`` first on ``PATH`` that records its argv, then signals the batch shell as Slurm's
``--signal`` would and waits for the shell to pass it on, so every line of the script runs, the
``trap`` included. The same for the script hydra-submitit-launcher writes for ``launch=slurm``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sync.launch.sbatch import main as sbatch_main

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

# Records its argv (NUL-separated) and OMP_NUM_THREADS; then, given a signal, waits until the batch shell
# has its trap for it set (SigCgt in /proc, polled), sends it that signal and expects the shell to forward it.
_FAKE_SRUN = r"""#!/bin/bash
printf '%s\0' "$@" > "$FAKE_SRUN_DIR/argv"
echo "OMP_NUM_THREADS=$OMP_NUM_THREADS" >> "$FAKE_SRUN_DIR/log"
[ -n "$FAKE_SRUN_SIGNAL" ] || exit 0
trap 'echo "srun got $FAKE_SRUN_SIGNAL" >> "$FAKE_SRUN_DIR/log"; exit 3' "$FAKE_SRUN_SIGNAL"
bit=$(( $(kill -l "$FAKE_SRUN_SIGNAL") - 1 ))
for _ in $(seq 500); do
    mask=$(awk '/^SigCgt:/ {print $2}' "/proc/$PPID/status")
    (( (16#$mask >> bit) & 1 )) && break
    sleep 0.01
done
kill -s "$FAKE_SRUN_SIGNAL" "$PPID"
for _ in $(seq 500); do sleep 0.01; done
echo "srun was never signalled" >> "$FAKE_SRUN_DIR/log"
exit 9
"""


def _hostile(tmp_path: Path) -> tuple[str, list[str]]:
    """A job name and overrides (valid Hydra) that would each run ``touch <tmp_path>/INJECTED-<n>`` if any
    part of them reached bash unquoted."""
    m = f"{tmp_path}/INJECTED-"
    job_name = f"launch.job_name='j$(touch {m}1)`touch {m}2`;touch {m}3;\"dq\"\\'sq'"
    overrides = [
        f"+notes='$(touch {m}4) `touch {m}5`; touch {m}6 \\'; touch {m}7; \\' \"; touch {m}8; \"'",
        f'+more="it\'s; touch {m}9 \\"q\\" $(touch {m}10) `touch {m}11`"',
        f"launch.partition='p;touch {m}12 $(touch {m}13)'",
        f"launch.python='python3;touch {m}14'",
    ]
    return job_name, overrides


def _run(script: str, tmp_path: Path, signal: str = "") -> subprocess.CompletedProcess[str]:
    (tmp_path / "bin").mkdir()
    srun = tmp_path / "bin" / "srun"
    srun.write_text(_FAKE_SRUN)
    srun.chmod(0o755)
    path = tmp_path / "job.sh"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(
        PATH=f"{tmp_path / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        FAKE_SRUN_DIR=str(tmp_path),
        FAKE_SRUN_SIGNAL=signal,
    )
    return subprocess.run(["bash", str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def _injected(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.glob("INJECTED-*"))


def test_the_sbatch_script_runs_no_injected_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job_name, overrides = _hostile(tmp_path)
    sbatch_main([job_name, *overrides])  # `lightning-sync sbatch ...`
    script = capsys.readouterr().out
    assert "#SBATCH --job-name='j$(touch" in script and "#SBATCH --partition='p;touch" in script
    done = _run(script, tmp_path, signal="USR1")
    assert _injected(tmp_path) == [], f"injected commands ran: {_injected(tmp_path)}\n{script}"
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr)  # srun's status is the job's
    log = (tmp_path / "log").read_text().splitlines()
    assert log == ["OMP_NUM_THREADS=1", "srun got USR1"], log  # the export ran; the trap passed the signal on
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    assert argv == [
        "python3;touch " + f"{tmp_path}/INJECTED-14",
        "-m",
        "lightning_sync",
        "train",
        "launch=slurm",
        job_name,
        *overrides,
    ], argv  # exactly the overrides given, each one argument
    for text in ("$(touch", "`touch", "; touch", "\\'", '"dq"', "it's"):
        assert any(text in a for a in argv[5:]), text


def _submitit_script(overrides: list[str], sweep_dir: Path) -> str:
    """The script hydra-submitit-launcher hands ``sbatch`` for ``train -m launch=slurm <overrides>``: the
    launcher Hydra instantiates from our config, and its executor's own rendering (no submission)."""
    submitit = pytest.importorskip("submitit")
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import instantiate
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    from lightning_sync.cli import config_dir

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            cfg = compose(
                "train",
                overrides=["launch=slurm", f"hydra.sweep.dir={sweep_dir}", *overrides],
                return_hydra_config=True,
            )
            HydraConfig.instance().set_config(cfg)
            params = dict(instantiate(cfg.hydra.launcher).params)
    finally:
        GlobalHydra.instance().clear()
    executor = submitit.AutoExecutor(cluster="slurm", folder=params.pop("submitit_folder"))
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    params.pop("max_num_timeout", None)
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    slurm = executor._executor
    return slurm._make_submission_file_text(slurm._submitit_command_str, "job")


def test_the_submitit_script_runs_no_injected_command(tmp_path: Path) -> None:
    """hydra-submitit-launcher puts our job name, partition, CPUs and signal into its script (shell-quoted
    by submitit) and passes overrides in a pickle, not on the command line."""
    job_name, overrides = _hostile(tmp_path)
    script = _submitit_script([job_name, *overrides], tmp_path / "sweep")
    assert "#SBATCH --job-name='j$(touch" in script and "#SBATCH --partition='p;touch" in script
    done = _run(script, tmp_path)
    assert _injected(tmp_path) == [], f"injected commands ran: {_injected(tmp_path)}\n{script}"
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    assert (tmp_path / "log").read_text().splitlines() == ["OMP_NUM_THREADS=1"]  # its setup line ran
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    assert argv[-4:-1] == ["-u", "-m", "submitit.core._submit"], argv
    assert not any("touch" in a for a in argv), argv  # the overrides are not on srun's command line


@pytest.mark.parametrize("key", ["launch.job_name", "launch.partition", "launch.signal"])
def test_a_value_spanning_lines_is_refused_before_submitit_writes_its_script(key: str, tmp_path: Path) -> None:
    """submitit shell-quotes each #SBATCH value, but a newline inside the quotes still ends the comment and
    the next line is a command (checked: bash runs it). Our Hydra callback refuses such values first."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from lightning_sync.cli import config_dir
    from lightning_sync.launch.sbatch import SlurmLauncherValues

    hostile = f"{key}='x\\'\ntouch {tmp_path}/INJECTED-nl\n#'"
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            cfg = compose("train", overrides=["launch=slurm", hostile], return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()
    callbacks = cfg.hydra.callbacks
    assert [c._target_ for c in callbacks.values()].count(
        f"{SlurmLauncherValues.__module__}.{SlurmLauncherValues.__qualname__}"
    ) == 1  # conf/launch/slurm.yaml
    named = rf"hydra\.launcher\..* \(set from .*\${{{re.escape(key)}}}.*\) must be one line"
    with pytest.raises(ValueError, match=named):
        SlurmLauncherValues().on_multirun_start(cfg)


def test_the_train_command_refuses_it_before_submitting(tmp_path: Path) -> None:
    """End to end: ``lightning-sync train -m launch=slurm`` with a job name spanning lines exits with the
    message before hydra-submitit-launcher runs ``sbatch`` (there is none on PATH here: it would fail later)."""
    hostile = f"launch.job_name='x\\'\ntouch {tmp_path}/INJECTED-nl\n#'"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_sync",
            "train",
            "-m",
            "launch=slurm",
            hostile,
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": os.path.dirname(sys.executable)},
    )
    assert done.returncode != 0
    assert "must be one line" in done.stderr + done.stdout, done.stderr[-2000:]
    assert not (tmp_path / "sweep" / ".submitit").exists()
    assert _injected(tmp_path) == []
