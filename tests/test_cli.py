"""The ``lightning-sync`` console script, run as a user would: real processes, real Hydra, real gloo ranks.

The default job and multirun go through the console script and Lightning's own launcher (rank 0 starts rank 1
as a fresh process). Jobs that test a model, a strategy, resume or an example rather than the launch run their
ranks as torchrun would (:mod:`support.cli_ranks`: ``python -m lightning_sync`` or the example's
``python <script>`` per rank, forked from the harness's preloaded forkserver), which spares a fresh import of
torch and Lightning per process."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf
from support.cli_ranks import run, run_script

from lightning_sync import cli

# Rank variables must not reach the CLI from the test process: the CLI would think it is a child rank.
_SCRUB = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "PL_GLOBAL_SEED")
_FINAL = re.compile(r"final metrics \((\d+) ranks, (\d+) steps\): (.*)")


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("lightning-sync")
    exe = str(script) if script.exists() else shutil.which("lightning-sync")
    assert exe, "the lightning-sync console script is not installed (pip install -e .)"
    return [exe]


def run_cli(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
    return subprocess.run([*_cli(), *args], cwd=cwd, env=env, text=True, capture_output=True, timeout=timeout)


def run_example(name: str, args: list[str], cwd: Path, world: int = 1) -> str:
    """``python examples/<name> <args>`` in ``cwd`` on ``world`` processes started as torchrun would (one: a
    plain run); every process must exit 0. Returns process 0's output."""
    return run_script(Path(__file__).resolve().parents[1] / "examples" / name, args, cwd, world=world, timeout=240)[0]


def run_ranks(args: list[str], run_dir: Path) -> str:
    """``lightning-sync train <args>`` on 2 ranks launched as torchrun would, in ``run_dir``; rank 0's output.
    Every rank must succeed."""
    return run(2, run_dir, args, timeout=240)[0]


def final_metrics(out: str) -> tuple[int, int, dict[str, float]]:
    match = _FINAL.search(out)
    assert match, f"no 'final metrics' line in the output:\n{out[-3000:]}"
    metrics = dict(kv.split("=") for kv in match.group(3).split())
    return int(match.group(1)), int(match.group(2)), {k: float(v) for k, v in metrics.items()}


def test_help_and_unknown_subcommand(tmp_path: Path) -> None:
    assert "usage: lightning-sync" in run_cli(["--help"], tmp_path, timeout=60).stdout
    bad = run_cli(["trian"], tmp_path, timeout=60)
    assert bad.returncode != 0 and "unknown subcommand 'trian'" in bad.stderr and "train" in bad.stderr


@pytest.mark.parametrize("sub", ["train", "bench", "sbatch"])
def test_every_subcommand_help_exits_0_with_usage(tmp_path: Path, sub: str) -> None:
    proc = run_cli([sub, "--help"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"usage: lightning-sync {sub} " in proc.stdout, proc.stdout[:2000]
    assert not (tmp_path / "outputs").exists(), "--help must not start a run"


def test_cfg_job_prints_composed_config(tmp_path: Path) -> None:
    proc = run_cli(["train", "--cfg", "job", "model=char_gpt", "trainer.max_steps=50"], tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "CharGPT" in proc.stdout and "CharDataModule" in proc.stdout and "max_steps: 50" in proc.stdout
    assert not (tmp_path / "outputs").exists(), "--cfg job must not create an output directory"


def test_wrong_override_lists_valid_options(tmp_path: Path) -> None:
    proc = run_cli(["train", "strategy=no_such_strategy"], tmp_path, timeout=60)
    assert proc.returncode != 0
    assert "no_such_strategy" in proc.stderr and "Available options" in proc.stderr
    assert "lightning_ddp" in proc.stderr
    for name in _options("strategy"):  # every one, as the user sees it
        assert f"\t{name}\n" in proc.stderr, name


def test_fault_tolerance_refuses_a_strategy_that_cannot_keep_training_naming_those_that_can(tmp_path: Path) -> None:
    proc = run_cli(
        ["train", "launch.fault_tolerant=true", "strategy=async_ps", "trainer.devices=2"], tmp_path, timeout=60
    )
    assert proc.returncode != 0
    assert "keeps training through a lost rank with strategy=bucketed_ddp, local_sgd, diloco or zero1" in proc.stderr
    assert "AsyncParameterServerStrategy" in proc.stderr, proc.stderr[-2000:]  # what this job has


def _options(group: str) -> list[str]:
    """The options of a config group: the YAML files in ``conf/<group>``."""
    names = sorted(p.stem for p in Path(cli.config_dir(), group).glob("*.yaml"))
    assert names, f"no options found in conf/{group}"
    return names


@pytest.mark.parametrize("group", ["strategy", "model"])
def test_unknown_strategy_or_model_lists_every_available_one(group: str) -> None:
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=cli.config_dir(), version_base="1.3"):
            with pytest.raises(MissingConfigException) as info:
                compose("train", overrides=[f"{group}=nope"])
    finally:
        GlobalHydra.instance().clear()
    msg = str(info.value)  # the CLI prints this message (test_wrong_override_lists_valid_options)
    assert f"Could not find '{group}/nope'" in msg and f"Available options in '{group}':" in msg
    listed = msg.split(f"Available options in '{group}':", 1)[1].split("Config search path:", 1)[0].split()
    assert listed == _options(group)


def _trainer_cfg(accelerator: object, devices: object) -> object:
    return OmegaConf.create({"trainer": {"accelerator": accelerator, "devices": devices}})


@pytest.mark.parametrize(("accelerator", "devices", "per_cpu"), [("cpu", 3, "1.5"), ("cpu", "8", "4"), ("CPU", 4, "2")])
def test_more_cpu_processes_than_cpus_warns_about_oversubscription(
    monkeypatch: pytest.MonkeyPatch, accelerator: str, devices: object, per_cpu: str
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with pytest.warns(UserWarning, match=rf"trainer.devices={int(devices)} .* 2 CPUs: oversubscription") as record:
        message = cli._warn_oversubscription(_trainer_cfg(accelerator, devices))
    assert len(record) == 1 and str(record[0].message) == message
    assert f"{per_cpu} processes per CPU" in message and "time-share the cores" in message
    assert "slower" in message and "timings are meaningless" in message


def test_accelerator_auto_without_cuda_counts_as_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(UserWarning, match="oversubscription"):
        assert cli._warn_oversubscription(_trainer_cfg("auto", 3)) is not None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli._warn_oversubscription(_trainer_cfg("auto", 3)) is None


@pytest.mark.parametrize(
    ("accelerator", "devices"),
    [
        ("cpu", 2),
        ("cpu", 1),
        ("cpu", "2"),
        ("cpu", "auto"),
        ("cpu", -1),
        ("cpu", [0, 1, 2]),
        ("cpu", True),
        ("gpu", 8),
        ("cuda", 8),
    ],
)
def test_no_oversubscription_no_warning(monkeypatch: pytest.MonkeyPatch, accelerator: str, devices: object) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cli._warn_oversubscription(_trainer_cfg(accelerator, devices)) is None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_digits_two_ranks_reaches_90_percent(tmp_path: Path) -> None:
    import torch

    from lightning_sync.models.digits import DigitsDataModule, DigitsMLP

    proc = run_cli(
        ["train", "trainer.enable_progress_bar=false", f"final_checkpoint={tmp_path / 'final.ckpt'}"], tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks, steps, metrics = final_metrics(proc.stdout + proc.stderr)
    assert ranks == 2 and steps > 0
    # The default digits job reaches >= 90% synced validation accuracy on 2 ranks.
    assert metrics["val_acc"] >= 0.90, metrics
    # ... counting each of the 359 validation samples once: the printed metrics are one process's over the set
    assert "replicates some samples" not in proc.stderr and "evaluated twice" not in proc.stderr
    data, model = DigitsDataModule(), DigitsMLP()
    data.setup("validate")
    model.load_state_dict(torch.load(tmp_path / "final.ckpt", map_location="cpu", weights_only=True)["state_dict"])
    x, y = (torch.cat(parts) for parts in zip(*data.val_dataloader()))
    with torch.no_grad():
        logits = model(x)
    assert len(y) == 359
    # printed with 4 decimals
    assert metrics["val_acc"] == pytest.approx(float((logits.argmax(1) == y).float().mean()), abs=5e-5)
    assert metrics["val_loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, y)), abs=5e-5)
    runs = list((tmp_path / "outputs").glob("*/*"))
    assert len(runs) == 1, f"ranks must share one Hydra output directory, got {runs}"
    assert (runs[0] / ".hydra" / "config.yaml").is_file()
    assert (runs[0] / "train_ddp_process_1.log").is_file(), "rank 1 must log into rank 0's directory"
    assert list((runs[0] / "logs").rglob("metrics.csv")), "the CSV logger writes into the run directory"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_zero3_twenty_steps(tmp_path: Path) -> None:
    out = run_ranks(["strategy=zero3", "trainer.max_steps=20", "final_validate=true"], tmp_path / "run")
    assert "ShardedStrategy: ZeRO stage 3" in out, out[-3000:]
    ranks, steps, metrics = final_metrics(out)
    assert (ranks, steps) == (2, 20)
    # 20 steps on digits (chance: 0.10) already reach ~0.87 with this seed; 0.5 leaves room, and a broken
    # gather or reduce-scatter stays near chance.
    assert metrics["val_acc"] >= 0.5, metrics


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_multirun_two_values_one_directory_per_job(tmp_path: Path) -> None:
    proc = run_cli(
        [
            "train",
            "-m",
            "trainer.max_steps=4,6",
            "trainer.max_epochs=-1",
            "trainer.enable_progress_bar=false",
            "final_validate=false",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = sorted(int(m.group(2)) for m in _FINAL.finditer(proc.stdout + proc.stderr))
    assert steps == [4, 6], proc.stdout[-3000:]
    assert not (tmp_path / "outputs").exists(), "child ranks must not create single-run directories"
    jobs = sorted(p.name for p in next((tmp_path / "multirun").glob("*/*")).iterdir() if p.is_dir())
    assert jobs == ["0", "1"], f"exactly one directory per job, got {jobs}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_char_gpt_50_steps_reports_bpc_and_sample(tmp_path: Path) -> None:
    out = run_ranks(
        ["trainer.max_steps=50", "model=char_gpt", "final_validate=true", "sample_chars=40"], tmp_path / "run"
    )
    ranks, steps, metrics = final_metrics(out)
    assert (ranks, steps) == (2, 50)
    # Uniform guessing over the 128-symbol vocabulary is 7 bits/char; 50 steps must already beat it clearly.
    assert metrics["val_bpc"] < 5.0, metrics
    assert "sample:" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plain_trainer_example_trains_on_two_ranks(tmp_path: Path) -> None:
    out = run_example("plain_trainer.py", ["--max-steps", "60"], tmp_path, world=2)
    match = re.search(r"final train_mse=([\d.]+) after (\d+) steps on (\d+) ranks", out)
    assert match, out[-2000:]
    # Targets are standardised, so predicting their mean scores 1.0; a trained net must do clearly better.
    assert float(match.group(1)) < 0.8 and match.group(2) == "60" and match.group(3) == "2"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_overlap_probe_example_reports_its_measurements(tmp_path: Path) -> None:
    out = run_example("overlap_probe.py", ["--caps", "0.5"], tmp_path)
    match = re.search(r"cap=0.5 MiB: (\{.*\})", out)
    assert match, out[-2000:]
    got = ast.literal_eval(match.group(1))  # the example prints a dict literal
    assert got["buckets"] > 2  # 0.5 MiB caps split deep_mlp's 8 MiB of gradients
    assert all(got[k] > 0 for k in ("compute_ms", "comm_alone_ms", "step_ms", "backward_ms"))
    assert got["backward_ms"] <= got["step_ms"]  # backward ends inside the step it is part of


_RESUMED = re.compile(r"resuming from (\S+) \(global step (\d+)")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resume_takes_the_newest_complete_checkpoint_not_the_preemption_one(tmp_path: Path) -> None:
    """A run preempted at step 3 was resumed and trained on to step 30, writing last.ckpt; extending it with
    ckpt_path=last must continue from step 30, not from the older preemption checkpoint. The run checkpoints
    every 3 steps as well as at epoch ends, as conf/train.yaml documents checkpoint.every_n_train_steps."""
    import torch

    from lightning_sync.launch.requeue import publish_checkpoint

    run_dir = tmp_path / "run"
    # checkpoint.every_n_train_steps is documented to save "as well" as at epoch ends (digits: 23 steps an epoch)
    common = [
        "checkpoint.every_n_train_steps=3",
        "+checkpoint.save_top_k=-1",
        "launch.signal=USR1",
    ]
    run_ranks(["trainer.max_steps=30", *common], run_dir)
    ckpts = run_dir / "checkpoints"
    written = sorted(p.name for p in ckpts.iterdir())
    steps = [f"epoch={s // 23}-step={s}.ckpt" for s in range(3, 31, 3)]
    assert written == sorted(["epoch=0-step=23.ckpt", *steps, "last.ckpt"]), written
    # the preemption checkpoint the run left at step 3 (what RequeueOnSignal publishes: an ordinary checkpoint)
    step3 = next(ckpts.glob("*step=3.ckpt"))
    assert torch.load(step3, map_location="cpu", weights_only=True)["global_step"] == 3
    shutil.copy(step3, tmp_path / ".preempted.tmp")
    (run_dir / "requeue").mkdir()
    publish_checkpoint(
        run_dir / "requeue", tmp_path / ".preempted.tmp", "requeue-step000000003.ckpt", {"global_step": 3}
    )

    out = run_ranks(["trainer.max_steps=32", "ckpt_path=last", *common], run_dir)
    match = _RESUMED.search(out)
    assert match and match.group(1) == str(ckpts / "last.ckpt") and match.group(2) == "30", out[-3000:]
    assert final_metrics(out)[1] == 32
