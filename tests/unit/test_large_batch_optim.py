"""LAMB and LARS in build_optimizer and CharGPT, and the conf/optim group, in one process.

Training to 90% through the CLI is in tests/test_cli_optim.py (slow)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lightning_sync.cli import config_dir
from lightning_sync.lr_rules import ScaledWarmup
from lightning_sync.models import CharGPT, DigitsMLP
from lightning_sync.models._common import OPTIMIZERS, build_optimizer
from lightning_sync.models.synthetic import DeepMLP, WideMLP
from lightning_sync.models.topics import BagOfWordsClassifier

pytorch_optimizer = pytest.importorskip("pytorch_optimizer", reason="the optim extra: pip install -e .[optim]")

CONF = Path(config_dir())
OPTIM_OPTIONS = sorted(p.stem for p in (CONF / "optim").glob("*.yaml"))
_EXPECTED = {"lamb": pytorch_optimizer.Lamb, "lars": pytorch_optimizer.LARS}


def test_build_optimizer_names_and_classes() -> None:
    assert OPTIMIZERS == ("adam", "sgd", "lamb", "lars")
    params = list(nn.Linear(3, 2).parameters())
    lamb = build_optimizer(params, "lamb", 0.02, weight_decay=0.1)
    assert type(lamb) is pytorch_optimizer.Lamb and lamb.param_groups[0]["weight_decay"] == 0.1
    lars = build_optimizer(params, "lars", 2.0)
    assert type(lars) is pytorch_optimizer.LARS and lars.param_groups[0]["momentum"] == 0.9
    assert lars.param_groups[0]["lr"] == 2.0
    with pytest.raises(ValueError, match=r"optimizer must be one of \['adam', 'sgd', 'lamb', 'lars'\], got 'lion'"):
        build_optimizer(params, "lion", 0.1)


def test_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pytorch_optimizer", None)  # import pytorch_optimizer -> ImportError
    with pytest.raises(ImportError, match=r"optimizer='lamb' needs .*pip install \"lightning-sync\[optim\]\""):
        build_optimizer(nn.Linear(3, 2).parameters(), "lamb", 0.01)


def test_digits_mlp_steps_with_lamb_and_lars() -> None:
    for name in ("lamb", "lars"):
        torch.manual_seed(0)
        model = DigitsMLP(optimizer=name, lr=0.02)
        opt = model.configure_optimizers()
        assert type(opt) is _EXPECTED[name]
        before = [p.detach().clone() for p in model.parameters()]
        nn.functional.cross_entropy(model(torch.rand(8, 64)), torch.arange(8)).backward()
        opt.step()
        assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters())), name


def test_char_gpt_default_is_todays_adamw_bit_for_bit() -> None:
    model = CharGPT(n_layer=1, n_embd=32, n_head=2, block_size=8)
    assert model.hparams["optimizer"] == "adamw"
    opt = model.configure_optimizers()
    params = list(model.parameters())  # what configure_optimizers did before the optimizer argument
    reference = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=3e-3,
        betas=(0.9, 0.95),
    )
    assert type(opt) is torch.optim.AdamW
    assert opt.state_dict() == reference.state_dict()
    assert [g["params"] for g in opt.param_groups] == [g["params"] for g in reference.param_groups]


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_char_gpt_lamb_and_lars_keep_the_decay_groups(name: str) -> None:
    model = CharGPT(n_layer=1, n_embd=32, n_head=2, block_size=8, optimizer=name, weight_decay=0.05)
    opt = model.configure_optimizers()
    assert type(opt) is _EXPECTED[name]
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_char_gpt_bad_optimizer_lists_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match=r"\['adamw', 'adam', 'sgd', 'lamb', 'lars'\], got 'adamax'"):
        CharGPT(optimizer="adamax")


def _selected() -> set[str]:
    return {next(iter(d)) for d in OmegaConf.load(CONF / "train.yaml").defaults if isinstance(d, DictConfig)}


MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
_DEFAULT = {
    "digits_mlp": torch.optim.Adam,
    "char_gpt": torch.optim.AdamW,
    "wide_mlp": torch.optim.SGD,
    "deep_mlp": torch.optim.SGD,
    "bow_topics": torch.optim.SGD,
}


def _compose(overrides: list[str]) -> DictConfig:
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose("train", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("option", OPTIM_OPTIONS)
def test_optim_options_build_the_optimizer_and_the_callback(option: str, model: str) -> None:
    """Every model takes every optim option; bow_topics' sparse embedding only plain SGD (below)."""
    assert {"default", "lamb", "lars"} <= set(OPTIM_OPTIONS) and set(_DEFAULT) == set(MODELS)
    prefix = "" if "optim" in _selected() else "+"  # appended until train.yaml's defaults list selects the group
    sparse = ["model.sparse=false"] if model == "bow_topics" and option in _EXPECTED else []
    cfg = _compose([f"model={model}", f"{prefix}optim={option}", *sparse])
    built = instantiate(cfg.model, _convert_="all").configure_optimizers()
    assert type(built) is (_EXPECTED.get(option) or _DEFAULT[model])
    if option in _EXPECTED:
        assert built.param_groups[0]["lr"] == cfg.model.lr
    callback = ScaledWarmup(**OmegaConf.to_container(cfg.optim), global_batch_size=64)
    assert callback.lr_scaling == "none" and callback.warmup_steps == 0


@pytest.mark.parametrize("option", sorted(_EXPECTED))
def test_bow_topics_sparse_embedding_refuses_stateful_optimizers(option: str) -> None:
    """LAMB and LARS keep per-row state, which a sparse gradient cannot feed: a clear error, not a crash in step."""
    prefix = "" if "optim" in _selected() else "+"
    cfg = _compose(["model=bow_topics", f"{prefix}optim={option}"])
    message = (
        rf"optimizer must be one of \['sgd'\] \(with sparse=True only plain SGD; "
        rf"set sparse=False for the others\), got '{option}'"
    )
    with pytest.raises(InstantiationException, match=message):
        instantiate(cfg.model, _convert_="all")


def test_bow_topics_default_stays_plain_sgd_and_dense_adam_steps() -> None:
    plain = BagOfWordsClassifier(vocab_size=16, num_classes=2, embed_dim=4).configure_optimizers()
    assert type(plain) is torch.optim.SGD
    assert plain.param_groups[0]["momentum"] == 0 and plain.param_groups[0]["weight_decay"] == 0
    with pytest.raises(ValueError, match=r"optimizer must be one of \['adam', 'sgd', 'lamb', 'lars'\], got 'lion'"):
        BagOfWordsClassifier(vocab_size=16, num_classes=2, sparse=False, optimizer="lion")
    model = BagOfWordsClassifier(vocab_size=16, num_classes=2, embed_dim=4, sparse=False, optimizer="adam", lr=0.1)
    opt = model.configure_optimizers()
    assert type(opt) is torch.optim.Adam
    before = [p.detach().clone() for p in model.parameters()]
    nn.functional.cross_entropy(model(torch.randint(0, 16, (4, 3))), torch.tensor([0, 1, 0, 1])).backward()
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize("cls", [WideMLP, DeepMLP])
def test_synthetic_mlps_take_the_optimizer_argument(cls: type) -> None:
    small = {"in_features": 8, "hidden": 16, "num_classes": 3}
    default = cls(**small).configure_optimizers()  # unchanged default: SGD with momentum 0.9
    assert type(default) is torch.optim.SGD and default.param_groups[0]["momentum"] == 0.9
    with pytest.raises(ValueError, match=r"optimizer must be one of \['adam', 'sgd', 'lamb', 'lars'\], got 'lion'"):
        cls(**small, optimizer="lion")
    for name, expected in _EXPECTED.items():
        torch.manual_seed(0)
        model = cls(**small, optimizer=name, lr=0.02)
        assert model.hparams["optimizer"] == name  # saved, so a checkpoint rebuilds the same optimizer
        opt = model.configure_optimizers()
        assert type(opt) is expected
        before = [p.detach().clone() for p in model.parameters()]
        nn.functional.cross_entropy(model(torch.randn(6, 8)), torch.arange(6) % 3).backward()
        opt.step()
        assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters())), name
