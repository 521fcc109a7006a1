"""What ``lightning-sync --help`` and every subcommand's ``--help`` print, in this process (stdout captured).

The top-level help lists each subcommand with one line, the config groups of train and bench with every option
the config directory has, and the common overrides; each Hydra app's help lists its own groups (not the other
app's) above its composed config. The listed groups and overrides are checked against the shipped config, so
the help cannot drift from it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from lightning_sync import cli, cli_help


@pytest.fixture(autouse=True)
def _clean_hydra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["lightning-sync"])  # the CLI hands Hydra its arguments through sys.argv
    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


def _help(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """What ``lightning-sync <args>`` prints; Hydra's ``--help`` exits 0, the others return."""
    try:
        cli.main(list(args))
    except SystemExit as exit_:
        assert exit_.code in (0, None), exit_.code
    return capsys.readouterr().out


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in Path(cli.config_dir(), group).glob("*.yaml"))


def _groups_line(group: str, default: str | None) -> str:
    return f"{group}: " + ", ".join(f"{o}*" if o == default else o for o in _options(group))


def test_top_level_help_lists_subcommands_groups_and_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    out = _help(capsys, "--help")
    assert out.startswith("usage: lightning-sync {train,bench,sbatch,consolidate,launch}"), out[:200]
    for sub in cli.SUBCOMMANDS:
        assert sum(line.startswith(f"  {sub} ") for line in out.splitlines()) == 1, f"{sub}: one line each"
    groups = [p.name for p in Path(cli.config_dir()).iterdir() if p.is_dir() and any(p.glob("*.yaml"))]
    assert {"strategy", "model", "suite"} <= set(groups)
    defaults = {g: d for app in ("train", "bench") for g, _, d in cli_help.config_groups(app)}
    for group in groups:  # every group the config directory has, with every option and its default
        assert f"  {_groups_line(group, defaults.get(group))}\n" in out, group
    assert "strategy: async_ps, bucketed_ddp*," in out and "zero3" in out  # the default marked
    for override, _ in cli_help.COMMON_OVERRIDES:
        assert f"  {override} " in out, override
    for flag, _ in cli_help.HYDRA_FLAGS:
        assert f"  {flag} " in out, flag


def test_the_common_overrides_are_keys_of_the_train_config() -> None:
    """Hydra refuses an override of a key the config does not have, so composing them all proves each exists."""
    overrides = [override for override, _ in cli_help.COMMON_OVERRIDES]
    with initialize_config_dir(config_dir=cli.config_dir(), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    assert cfg.trainer.max_steps == 50 and cfg.batch.global_size == 256 and cfg.ckpt_path == "last"


@pytest.mark.parametrize(("app", "other_group"), [("train", "suite"), ("bench", "strategy")])
def test_each_hydra_app_lists_its_own_groups_and_its_config(
    capsys: pytest.CaptureFixture[str], app: str, other_group: str
) -> None:
    out = _help(capsys, app, "--help")
    assert f"usage: lightning-sync {app} " in out, out[:300]
    groups, config = out.split("== Configuration groups ==", 1)[1].split("== Config ==", 1)
    for group, _, default in cli_help.config_groups(app):
        assert f"\n{_groups_line(group, default)}\n" in groups, group
    assert f"\n{other_group}:" not in groups, f"{app} --help lists {other_group}, a group it does not compose"
    assert ("_target_: lightning_sync.strategies.bucketed_ddp" if app == "train" else "mode: run") in config
    if app == "train":
        assert "== Common overrides ==" in groups and "trainer.devices=2" in groups


def test_overrides_before_help_still_compose(capsys: pytest.CaptureFixture[str]) -> None:
    out = _help(capsys, "train", "strategy=zero3", "trainer.max_steps=7", "--help")
    config = out.split("== Config ==", 1)[1]
    assert "_target_: lightning_sync.strategies.sharded.ShardedStrategy" in config and "max_steps: 7" in config


def test_sbatch_help_lists_trains_groups_and_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    out = _help(capsys, "sbatch", "--help")
    assert out.startswith("usage: lightning-sync sbatch "), out[:200]
    for group, _, default in cli_help.config_groups("train"):
        assert f"  {_groups_line(group, default)}\n" in out, group
    assert "  trainer.devices=2 " in out and "#SBATCH" not in out, "help, not a script"


def test_consolidate_help_lists_its_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    out = _help(capsys, "consolidate", "--help")
    assert out.startswith("usage: lightning-sync consolidate CHECKPOINT_DIR OUTPUT_FILE [--trust-pickles]")
    for argument in ("checkpoint_dir", "output_file", "--trust-pickles", "optimizer state"):
        assert argument in out, argument


def test_launch_help_lists_the_agents_options(capsys: pytest.CaptureFixture[str]) -> None:
    out = _help(capsys, "launch", "--help")
    assert out.startswith("usage: lightning-sync launch"), out[:200]
    for option in ("--nproc", "--max-restarts", "--node", "--nnodes", "--hang-timeout", "command"):
        assert option in out, option
