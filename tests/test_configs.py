"""Every option of every config group composes, and the objects it names can be built."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_sync.cli import config_dir

CONF = Path(config_dir())
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and not p.name.startswith("__"))
BENCH_GROUPS = {"suite"}  # groups of bench.yaml; every other group belongs to train.yaml
OPTIONS = [(g, f.stem) for g in GROUPS if g not in BENCH_GROUPS for f in sorted((CONF / g).glob("*.yaml"))]
SUITES = sorted(f.stem for f in (CONF / "suite").glob("*.yaml"))
# Groups whose objects are cheap enough to build here (trainer needs a Hydra run; built by the CLI tests).
BUILDABLE = {"strategy", "model", "data"}
# Groups train.yaml's defaults list selects; another group's options are appended (+group=option).
SELECTED = {next(iter(d)) for d in OmegaConf.load(CONF / "train.yaml").defaults if isinstance(d, DictConfig)}


@pytest.fixture
def composer():
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield lambda overrides: compose("train", overrides=overrides)
    GlobalHydra.instance().clear()


def test_expected_groups_exist() -> None:
    assert {"strategy", "model", "data", "trainer", "launch"} <= set(GROUPS)
    assert (CONF / "strategy" / "lightning_ddp.yaml").is_file(), "the Lightning DDP baseline must stay"


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_and_builds(composer, group: str, option: str) -> None:
    cfg = composer([f"{'' if group in SELECTED else '+'}{group}={option}"])
    for key in ("strategy", "model", "data", "trainer"):
        assert "_target_" in cfg[key], f"{group}={option}: {key} has no _target_"
        get_class(cfg[key]._target_)  # the target must import
    if group in BUILDABLE:
        obj = instantiate(cfg[group])
        assert isinstance(obj, get_class(cfg[group]._target_))


@pytest.mark.parametrize("model", ["digits_mlp", "char_gpt", "wide_mlp", "deep_mlp", "bow_topics"])
def test_model_selects_matching_data(composer, model: str) -> None:
    cfg = composer([f"model={model}"])
    expected = {
        "digits_mlp": "DigitsDataModule",
        "char_gpt": "CharDataModule",
        "wide_mlp": "SyntheticDataModule",
        "deep_mlp": "SyntheticDataModule",
        "bow_topics": "TopicDataModule",
    }[model]
    assert cfg.data._target_.endswith(expected)


@pytest.mark.parametrize("suite", SUITES)
def test_bench_suites_compose_and_name_importable_strategies(suite: str) -> None:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("bench", overrides=[f"suite={suite}"])
    GlobalHydra.instance().clear()
    assert cfg.tradeoff.enabled == (suite in ("tradeoff", "full"))
    assert cfg.memory.enabled == (suite == "memory")
    assert cfg.cost_model.enabled == (suite in ("full", "quick"))
    if suite == "full":  # the report: every model at 2, 3 and 4 ranks, every strategy row
        assert list(cfg.world_sizes) == [2, 3, 4] and cfg.run_strategies is None
        assert set(cfg.run_models) == {"wide_mlp", "deep_mlp", "char_gpt"} == set(cfg.scaling.models)
    if suite == "tradeoff":  # only the trade-off runs
        assert list(cfg.run_models) == [] and not cfg.bucket_sweep.enabled and not cfg.scaling.enabled
    for rows in cfg.tradeoff.rows.values():
        for node in rows.values():
            get_class(node._target_)
    for row in cfg.memory.rows.values():
        get_class(row.strategy._target_)
    for node in cfg.strategies.values():
        get_class(node._target_)
    periods = [int(n.sync_every) for rows in cfg.tradeoff.rows.values() for n in rows.values() if "sync_every" in n]
    assert all(cfg.tradeoff.steps % p == 0 for p in periods), "the budget must end on a sync of every periodic row"
    # the strategy rows' periodic syncs fall evenly in the timed window, so bytes/step is the exact amortized figure
    for n in cfg.strategies.values():
        if "sync_every" in n:
            assert cfg.steps % n.sync_every == 0, n


def test_model_trainer_keys_win_over_trainer_defaults(composer) -> None:
    cfg = composer(["model=char_gpt"])
    assert cfg.trainer.max_steps == 300 and cfg.trainer.max_epochs == -1
    cfg = composer(["model=char_gpt", "trainer.max_steps=7"])  # the command line still wins
    assert cfg.trainer.max_steps == 7


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_configs_build_sharded_strategies_of_their_stage(composer, stage: int) -> None:
    from torch import nn

    from lightning_sync import ShardedStrategy
    from lightning_sync.sync.zero import resolve_wrap_policy

    strategy = instantiate(composer([f"strategy=zero{stage}"]).strategy)
    assert type(strategy) is ShardedStrategy and strategy.stage == stage
    if stage == 3:  # the YAML's wrap policy resolves and selects Linear layers (and nothing else)
        policy = resolve_wrap_policy(strategy.wrap_policy)
        assert policy is not None and policy(nn.Linear(2, 2), 6) and not policy(nn.Embedding(2, 2), 4)


@pytest.mark.parametrize("option", sorted(f.stem for f in (CONF / "diagnostics").glob("*.yaml")))
def test_diagnostics_options_build_callbacks(composer, option: str) -> None:
    import lightning.pytorch as pl

    cfg = composer([f"diagnostics={option}"])
    built = {key: instantiate(spec) for key, spec in cfg.diagnostics.items()}
    assert all(isinstance(cb, pl.Callback) for cb in built.values()), built
    expected = {
        "none": set(),
        "default": {"watchdog"},
        "full": {"watchdog", "straggler", "replica_drift", "nonfinite"},
    }[option]
    assert set(built) == expected
