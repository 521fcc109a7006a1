"""``lightning-sync sbatch`` rendering in one process: directives from the config, every value shell-quoted,
values that would break out of an #SBATCH comment refused by name. (Submitting it: tests/slurm/.)"""

from __future__ import annotations

import shlex

import pytest

from lightning_sync.launch.sbatch import render_sbatch


def _srun_args(script: str) -> list[str]:
    (line,) = [line for line in script.splitlines() if line.startswith("srun ")]
    *args, background = shlex.split(line)[1:]
    assert background == "&"  # the batch shell waits for it, so it can pass signals on
    return args


def test_directives_follow_the_config() -> None:
    script = render_sbatch(
        [
            "launch.nodes=3",
            "trainer.devices=2",
            "launch.partition=gpu",
            "launch.time_min=30",
            "launch.signal=SIGUSR2",
            "launch.signal_delay_s=60",
            "launch.requeue=false",
            "launch.python=python3",
        ]
    )
    for directive in ("--nodes=3", "--ntasks-per-node=2", "--partition=gpu", "--time=30", "--signal=USR2@60"):
        assert f"#SBATCH {directive}" in script
    assert "--requeue" not in script
    assert _srun_args(script) == [
        "python3",
        "-m",
        "lightning_sync",
        "train",
        "launch=slurm",
        "launch.nodes=3",
        "trainer.devices=2",
        "launch.partition=gpu",
        "launch.time_min=30",
        "launch.signal=SIGUSR2",
        "launch.signal_delay_s=60",
        "launch.requeue=false",
        "launch.python=python3",
    ]


def test_shell_syntax_in_values_reaches_the_job_as_literal_text() -> None:
    hostile = "launch.job_name='a$(rm -rf /); `id`; \"b'"
    script = render_sbatch(["launch.python=python", hostile])
    assert _srun_args(script)[-1] == hostile  # bash hands the app exactly the override given
    assert "#SBATCH --job-name='a$(rm -rf /); `id`; \"b'" in script


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("launch.job_name='a\nrm -rf /'", "launch.job_name must be one line"),  # a real newline: a new bash line
        ("launch.nodes=0", "launch.nodes must be an int >= 1, got 0"),
        ("trainer.devices=0", "trainer.devices must be an int >= 1, got 0"),
        ("launch.signal=KILL", r"launch.signal must be one of \['USR1', 'USR2', .*got 'KILL'"),
        ("launch.time_min=-5", "launch.time_min must be an int >= 1, got -5"),
    ],
)
def test_bad_values_are_named(override: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        render_sbatch([override])


def test_the_batch_shell_forwards_the_requeue_signal_and_output_is_appended() -> None:
    script = render_sbatch(["launch.python=python", "launch.signal=USR2"])
    assert "#SBATCH --open-mode=append" in script  # a requeued run adds to the same log
    assert "trap 'kill -s USR2 \"$pid\" 2>/dev/null' USR2" in script
    assert script.rstrip().endswith('exit "$status"')


def test_the_shipped_example_is_what_the_command_renders() -> None:
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "train_2x2.sh"
    assert example.read_text() == render_sbatch(
        ["launch.nodes=2", "trainer.devices=2", "strategy=bucketed_ddp", "launch.python=python"]
    )
