"""Global batch accounting: ``lightning_sync.batch`` arithmetic and errors, and the train app's
``batch.*`` keys reaching the data module and the Trainer (``cli._apply_batch`` on a composed config)."""

from __future__ import annotations

import ast
import itertools
import logging
import re
import warnings
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate

from lightning_sync import batch, cli
from lightning_sync.batch import (
    LARGE_BATCH,
    BatchPlan,
    derive_batch,
    large_batch_warning,
    world_size_of,
)

KEYS = ("global_size", "per_device", "accumulate")
PAIRS = list(itertools.combinations(KEYS, 2))
# (per_device, accumulate): 1s, primes and powers of two, so a swapped or misplaced factor shows
FACTORS = [(1, 1), (1, 5), (7, 1), (32, 4), (6, 3), (64, 2)]


# --------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_any_two_keys_derive_the_third(world: int, pair: tuple[str, str]) -> None:
    for per_device, accumulate in FACTORS:
        triple = {"global_size": per_device * world * accumulate, "per_device": per_device, "accumulate": accumulate}
        expected = BatchPlan(world_size=world, **triple)
        plan = derive_batch(world, **{k: triple[k] for k in pair})
        assert plan == expected, (pair, triple)
        assert plan.global_size == plan.per_device * plan.world_size * plan.accumulate


@pytest.mark.parametrize("world", [1, 2, 3])
def test_all_three_consistent_keys_are_accepted_unchanged(world: int) -> None:
    for per_device, accumulate in FACTORS:
        plan = derive_batch(world, per_device * world * accumulate, per_device, accumulate)
        assert (plan.global_size, plan.per_device, plan.accumulate, plan.world_size) == (
            per_device * world * accumulate,
            per_device,
            accumulate,
            world,
        )


def test_describe_is_one_line_of_arithmetic() -> None:
    plan = derive_batch(2, global_size=256, per_device=32)
    assert plan.accumulate == 4
    assert plan.describe() == "global batch 256 = per_device 32 x world 2 x accumulate 4"


def test_plan_is_frozen() -> None:
    plan = derive_batch(1, per_device=8, accumulate=2)
    with pytest.raises(AttributeError):
        plan.accumulate = 3  # type: ignore[misc]


# --------------------------------------------------------------------------- errors name the numbers


@pytest.mark.parametrize(
    ("world", "kw", "message"),
    [
        (
            2,
            {"global_size": 1000, "per_device": 64},
            "global 1000 is not divisible by per_device 64 x world 2 (= 128); "
            "no world size does: 1000 is not a multiple of 64",
        ),
        (
            2,
            {"global_size": 32, "per_device": 32},
            "global 32 is not divisible by per_device 32 x world 2 (= 64); the nearest world sizes that hold it: 1",
        ),
        (
            3,
            {"global_size": 10, "accumulate": 4},
            "global 10 is not divisible by world 3 x accumulate 4 (= 12); no world size does",
        ),
        (
            3,
            {"global_size": 256, "per_device": 32},
            "global 256 is not divisible by per_device 32 x world 3 (= 96); "
            "the nearest world sizes that hold it: 2 and 4",
        ),
        (
            2,
            {"global_size": 1000, "per_device": 64, "accumulate": 4},
            "inconsistent batch: global 1000 != per_device 64 x world 2 x accumulate 4 (= 512)",
        ),
        (
            2,
            {"global_size": 256, "per_device": 32, "accumulate": 2},
            "inconsistent batch: global 256 != per_device 32 x world 2 x accumulate 2 (= 128)",
        ),
    ],
    ids=["nondiv-pd", "global-below-pd-x-world", "nondiv-acc", "nondiv-world3", "inconsistent", "inconsistent-2"],
)
def test_bad_combinations_raise_naming_every_number(world: int, kw: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        derive_batch(world, **kw)


@pytest.mark.parametrize(
    "given",
    [{}, {"global_size": 256}, {"per_device": 32}, {"accumulate": 4}],
    ids=["none", "global", "per_device", "accumulate"],
)
def test_fewer_than_two_keys_raise(given: dict[str, int]) -> None:
    got = ", ".join(f"{k}={v}" for k, v in given.items()) or "none"
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"give at least two of global_size, per_device, accumulate (the third is derived with world 2); got {got}"
        ),
    ):
        derive_batch(2, **given)


@pytest.mark.parametrize("bad", [0, -1, -64, True, False, 2.0, "32"], ids=repr)
@pytest.mark.parametrize("key", ["world_size", *KEYS])
def test_values_must_be_positive_ints(key: str, bad: object) -> None:
    kw: dict[str, object] = {"world_size": 2, "global_size": 256, "per_device": 32}
    kw[key] = bad
    with pytest.raises(ValueError, match=re.escape(f"{key} must be an int >= 1, got {bad!r}")):
        derive_batch(**kw)  # type: ignore[arg-type]


def test_plan_refuses_an_inconsistent_triple() -> None:
    with pytest.raises(ValueError, match=re.escape("global 100 != per_device 8 x world 2 x accumulate 4 (= 64)")):
        BatchPlan(global_size=100, per_device=8, accumulate=4, world_size=2)


@pytest.mark.parametrize(
    ("devices", "nodes", "world"), [(1, 1, 1), (2, 1, 2), (3, 2, 6), ("2", 1, 2), (" 4 ", 1, 4), ([0, 1], 2, 4)]
)
def test_world_size_is_devices_times_nodes(devices: object, nodes: int, world: int) -> None:
    assert world_size_of(devices, nodes) == world


@pytest.mark.parametrize("devices", ["auto", -1, 0, True, "0,1", [], None, 2.0], ids=repr)
def test_world_size_refuses_counts_left_to_the_machine(devices: object) -> None:
    with pytest.raises(ValueError, match=re.escape(f"devices={devices!r}: the batch arithmetic needs")):
        world_size_of(devices, 1)


@pytest.mark.parametrize("nodes", [0, -1, True, "2"], ids=repr)
def test_world_size_refuses_bad_node_counts(nodes: object) -> None:
    with pytest.raises(ValueError, match=re.escape(f"num_nodes must be an int >= 1, got {nodes!r}")):
        world_size_of(2, nodes)


def test_batch_module_imports_nothing_from_lightning() -> None:
    tree = ast.parse(Path(batch.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert names and not [m for m in names if m.split(".")[0] in ("lightning", "pytorch_lightning", "torch")], names


# --------------------------------------------------------------------------- large-batch warning


@pytest.mark.parametrize("optimizer", ["adam", "sgd", "torch.optim.AdamW", None])
def test_large_batch_without_lars_or_lamb_warns(optimizer: str | None) -> None:
    assert large_batch_warning(LARGE_BATCH, optimizer) is None  # at the threshold: no warning
    text = large_batch_warning(LARGE_BATCH + 1, optimizer)
    assert text is not None
    assert f"global batch {LARGE_BATCH + 1} > 32768" in text
    assert "generalization gap" in text and "Keskar et al. 2017" in text and "You et al. 2017" in text
    assert "LARS" in text and "LAMB" in text
    assert (repr(optimizer) if optimizer else "an optimizer the config does not name") in text


@pytest.mark.parametrize(
    "optimizer", ["lamb", "LARS", "pytorch_optimizer.Lamb", "pytorch_optimizer.LARS", "apex.optimizers.FusedLAMB"]
)
def test_large_batch_with_lars_or_lamb_is_quiet(optimizer: str) -> None:
    assert large_batch_warning(4 * LARGE_BATCH, optimizer) is None


# --------------------------------------------------------------------------- the train app's batch.* keys


@pytest.fixture
def composer():
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=cli.config_dir(), version_base="1.3"):
        yield lambda overrides, **kw: compose("train", overrides=overrides, **kw)
    GlobalHydra.instance().clear()


def test_batch_keys_reach_the_datamodule_and_the_trainer(composer, tmp_path: Path, caplog) -> None:
    cfg = composer(
        [
            "batch.global_size=256",
            "batch.per_device=32",
            "trainer.devices=2",
            "trainer.num_nodes=1",
            f"trainer.default_root_dir={tmp_path}",
            "trainer.logger=false",
            "trainer.enable_checkpointing=false",
        ]
    )
    with caplog.at_level(logging.INFO, logger="lightning_sync"), warnings.catch_warnings():
        warnings.simplefilter("error")  # 256 is no large batch: nothing to warn about
        plan = cli._apply_batch(cfg)
    assert plan == BatchPlan(global_size=256, per_device=32, accumulate=4, world_size=2)
    assert cfg.data.batch_size == 32 and cfg.trainer.accumulate_grad_batches == 4
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("batch: ")]
    assert logged == ["batch: global batch 256 = per_device 32 x world 2 x accumulate 4"]  # once
    # built as run_train builds them
    assert instantiate(cfg.data, _convert_="all").batch_size == 32
    trainer = instantiate(cfg.trainer, strategy=instantiate(cfg.strategy), callbacks=[])
    assert trainer.accumulate_grad_batches == 4 and trainer.world_size == 2


def test_every_datamodule_takes_the_derived_batch_size(composer) -> None:
    options = sorted(p.stem for p in (Path(cli.config_dir()) / "data").glob("*.yaml"))
    assert len(options) >= 4
    for option in options:
        cfg = composer(
            [f"data={option}", "batch.per_device=8", "batch.accumulate=3", "trainer.devices=2", "trainer.num_nodes=2"]
        )
        plan = cli._apply_batch(cfg)
        assert plan.global_size == 8 * 2 * 2 * 3
        assert instantiate(cfg.data, _convert_="all").batch_size == 8, option


def test_no_batch_keys_change_nothing(composer) -> None:
    cfg = composer(["trainer.accumulate_grad_batches=3", "data.batch_size=16"])
    assert cli._apply_batch(cfg) is None
    assert cfg.data.batch_size == 16 and cfg.trainer.accumulate_grad_batches == 3


def test_bad_batch_config_fails_naming_the_numbers(composer) -> None:
    cfg = composer(["batch.global_size=1000", "batch.per_device=64", "trainer.devices=2"])
    with pytest.raises(
        ValueError,
        match=re.escape(
            "batch.global_size=1000 batch.per_device=64 with trainer.devices=2 x trainer.num_nodes=1: "
            "global 1000 is not divisible by per_device 64 x world 2 (= 128)"
        ),
    ):
        cli._apply_batch(cfg)
    cfg = composer(["batch.global_size=48", "batch.per_device=8", "trainer.devices=5"])
    with pytest.raises(ValueError, match=re.escape("(= 40); the nearest world sizes that hold it: 3 and 6")):
        cli._apply_batch(cfg)


@pytest.mark.parametrize(("devices", "per_device"), [(1, 48), (2, 24), (3, 16)])
def test_a_global_size_alone_derives_the_per_device_batch_at_the_trainers_accumulation(
    composer, devices: int, per_device: int
) -> None:
    cfg = composer(["batch.global_size=48", f"trainer.devices={devices}"])
    plan = cli._apply_batch(cfg)
    assert (plan.per_device, plan.accumulate) == (per_device, 1)
    assert cfg.data.batch_size == per_device and cfg.trainer.accumulate_grad_batches == 1
    cfg = composer(["batch.global_size=48", f"trainer.devices={devices}", "trainer.accumulate_grad_batches=2"])
    assert cli._apply_batch(cfg).per_device == per_device // 2


def test_devices_auto_is_refused(composer) -> None:
    cfg = composer(["batch.global_size=256", "batch.per_device=32", "trainer.devices=auto"])
    with pytest.raises(ValueError, match=re.escape("trainer.devices='auto' x trainer.num_nodes=1: devices='auto'")):
        cli._apply_batch(cfg)


def test_explicit_accumulate_grad_batches_must_agree(composer) -> None:
    base = ["batch.global_size=256", "batch.per_device=32", "trainer.devices=2"]
    cfg = composer([*base, "trainer.accumulate_grad_batches=2"])
    with pytest.raises(
        ValueError,
        match=re.escape("trainer.accumulate_grad_batches=2 contradicts the batch config, which derives accumulate 4"),
    ):
        cli._apply_batch(cfg)
    cfg = composer([*base, "trainer.accumulate_grad_batches=4"])  # agrees: fine
    assert cli._apply_batch(cfg).accumulate == 4


def test_explicit_accumulate_of_one_on_the_command_line_is_refused_too(composer) -> None:
    # 1 is also trainer/default.yaml's value: only Hydra's record of the command line tells them apart
    cfg = composer(
        ["batch.global_size=256", "batch.per_device=32", "trainer.devices=2", "trainer.accumulate_grad_batches=1"],
        return_hydra_config=True,
    )
    HydraConfig.instance().set_config(cfg)
    try:
        with pytest.raises(ValueError, match=re.escape("trainer.accumulate_grad_batches=1 contradicts")):
            cli._apply_batch(cfg)
    finally:
        HydraConfig.instance().cfg = None  # type: ignore[assignment]


def test_large_batch_warns_once_without_lars_or_lamb(composer) -> None:
    cfg = composer(["model=digits_mlp", "batch.global_size=65536", "batch.per_device=32768", "trainer.devices=2"])
    with pytest.warns(UserWarning) as record:
        plan = cli._apply_batch(cfg)
    assert plan.accumulate == 1
    texts = [str(w.message) for w in record if "generalization gap" in str(w.message)]
    assert len(texts) == 1 and "optimizer 'adam'" in texts[0], texts


@pytest.mark.parametrize("optimizer", ["lamb", "lars"])
def test_large_batch_with_lars_or_lamb_from_the_config_is_quiet(composer, optimizer: str) -> None:
    # the optim=lamb / optim=lars configs select the optimizer through model.optimizer
    cfg = composer(
        [
            "model=digits_mlp",
            f"model.optimizer={optimizer}",
            "batch.global_size=65536",
            "batch.per_device=32768",
            "trainer.devices=2",
        ]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cli._apply_batch(cfg).global_size == 65536
