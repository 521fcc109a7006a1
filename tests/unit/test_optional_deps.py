"""A missing optional dependency fails before any work, naming the package and the extra that installs it.

matplotlib (the ``bench`` extra) draws the bench's figures, which come last; pytorch-optimizer (the ``optim``
extra) builds LAMB and LARS in ``configure_optimizers``, after the Trainer has started every rank. Found missing
only there, either costs minutes. ``sys.modules[name] = None`` makes ``import name`` raise ImportError, as an
absent package does; a tripwire on what would start the work (the bench's rank launcher, ``Trainer.fit``) fails
the test if the work starts first.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig

import lightning_sync.testing
from lightning_sync._config import config_dir
from lightning_sync.bench.app import run_bench
from lightning_sync.cli import run_train


def _compose(name: str, overrides: list[str]) -> DictConfig:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(name, overrides=overrides)
    GlobalHydra.instance().clear()
    return cfg


def _tripwire(what: str) -> Any:
    def started(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"{what} started before the missing package was reported")

    return started


@pytest.mark.parametrize(
    "overrides",
    [[], ["mode=calibrate"], ["suite=tradeoff"], ["suite=quick"]],
    ids=["default", "calibrate", "tradeoff", "quick"],
)
def test_bench_without_matplotlib_fails_before_any_rank_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, overrides: list[str]
) -> None:
    cfg = _compose("bench", overrides)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    # every bench mode starts its ranks (trials, the calibration sweep, the trade-off fits) through this
    monkeypatch.setattr(lightning_sync.testing, "run_distributed", _tripwire("a bench rank"))
    with pytest.raises(
        ImportError, match=re.escape('matplotlib, which is not installed: pip install "lightning-sync[bench]"')
    ):
        run_bench(cfg, tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing written either


def test_bench_that_draws_nothing_does_not_need_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The check is for runs that will plot: one with nothing to run must not demand the extra."""
    overrides = ["run_models=[]", "bucket_sweep.enabled=false", "tradeoff.enabled=false"]
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert run_bench(_compose("bench", overrides), tmp_path) is None


@pytest.mark.parametrize("model", ["digits_mlp", "char_gpt"])
@pytest.mark.parametrize("optim", ["lamb", "lars"])
def test_train_without_pytorch_optimizer_fails_before_fit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, optim: str, model: str
) -> None:
    # the run-time paths Hydra fills in a real run; trainer.devices=1 keeps a wrongly reached fit in this process
    overrides = [
        f"model={model}",
        f"optim={optim}",
        "trainer.devices=1",
        f"trainer.default_root_dir={tmp_path}",
        f"trainer.logger.save_dir={tmp_path}",
        f"checkpoint.dirpath={tmp_path}/checkpoints",
    ]
    cfg = _compose("train", overrides)
    monkeypatch.setitem(sys.modules, "pytorch_optimizer", None)
    monkeypatch.setattr(pl.Trainer, "fit", _tripwire("Trainer.fit"))
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # run_train seeds first: put them back as they were after
        monkeypatch.setenv(name, "")  # records the old value (delenv of an absent one records nothing)
        monkeypatch.delenv(name)
    # Hydra's instantiate wraps the model's error, keeping its message (what the user reads) and its cause
    with pytest.raises(InstantiationException) as info:
        run_train(cfg)
    cause = info.value.__cause__
    assert isinstance(cause, ImportError), repr(cause)
    expected = f"optimizer='{optim}' needs the pytorch-optimizer package, which is not installed: "
    assert str(cause) == expected + 'pip install "lightning-sync[optim]"'
    assert "pytorch-optimizer package" in str(info.value) and "lightning-sync[optim]" in str(info.value)


def test_the_bench_command_names_the_missing_extra_before_importing_lightning(tmp_path: Path) -> None:
    """``lightning-sync bench`` checks before it imports its runners, which import Lightning (seconds of start-up
    in a fresh interpreter): the missing extra is named first, and Lightning was never imported."""
    code = (
        "import atexit, sys\n"
        "sys.modules['matplotlib'] = None\n"  # as if not installed
        "atexit.register(lambda: print('lightning imported:', 'lightning' in sys.modules))\n"
        "from lightning_sync.cli import main\n"
        f"main(['bench', 'suite=quick', 'hydra.run.dir={tmp_path / 'run'}'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0, done.stdout[-2000:]
    assert 'pip install "lightning-sync[bench]"' in done.stderr, done.stderr[-2000:]
    assert "lightning imported: False" in done.stdout, (done.stdout[-2000:], done.stderr[-2000:])


def test_the_train_command_names_the_missing_extra_before_importing_lightning(tmp_path: Path) -> None:
    """``lightning-sync train optim=lamb`` checks for pytorch-optimizer before it imports Lightning."""
    code = (
        "import atexit, sys\n"
        "sys.modules['pytorch_optimizer'] = None\n"  # as if not installed
        "atexit.register(lambda: print('lightning imported:', 'lightning' in sys.modules))\n"
        "from lightning_sync.cli import main\n"
        f"main(['train', 'optim=lamb', 'hydra.run.dir={tmp_path / 'run'}'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0, done.stdout[-2000:]
    assert "optimizer='lamb' needs the pytorch-optimizer package" in done.stderr, done.stderr[-2000:]
    assert 'pip install "lightning-sync[optim]"' in done.stderr, done.stderr[-2000:]
    assert "lightning imported: False" in done.stdout, (done.stdout[-2000:], done.stderr[-2000:])
