"""Unit tests for lightning_sync.models: shapes, parameter counts, data splits, GPT behaviour."""

from __future__ import annotations

import re
from collections.abc import Callable

import lightning.pytorch as pl
import pytest
import torch
from torch.nn import functional as F

from lightning_sync.models import (
    VOCAB_SIZE,
    BagOfWordsClassifier,
    CharDataModule,
    CharGPT,
    DeepMLP,
    DigitsDataModule,
    DigitsMLP,
    SyntheticDataModule,
    TopicDataModule,
    WideMLP,
    decode,
    encode,
    load_corpus,
)

__all__: list[str] = []

DIGITS_TOTAL = 1797


def _num_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# --------------------------------------------------------------------------- shapes and sizes


def test_wide_mlp_has_about_8m_params_and_right_output_shape() -> None:
    model = WideMLP()
    count = _num_params(model)
    assert count == 8_403_978
    assert abs(count - 8_000_000) <= 0.10 * 8_000_000
    assert model(torch.randn(3, 1024)).shape == (3, 10)


def test_deep_mlp_has_about_2_1m_params_and_right_output_shape() -> None:
    model = DeepMLP()
    count = _num_params(model)
    assert count == 2_105_866
    assert abs(count - 2_100_000) <= 0.10 * 2_100_000
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 8
    assert model(torch.randn(3, 1024)).shape == (3, 10)


def test_digits_mlp_shape_and_hparams() -> None:
    model = DigitsMLP(hidden=32, depth=3, optimizer="sgd")
    assert model(torch.rand(5, 64)).shape == (5, 10)
    assert model.hparams["hidden"] == 32 and model.hparams["optimizer"] == "sgd"
    assert isinstance(model.configure_optimizers(), torch.optim.SGD)
    assert isinstance(DigitsMLP().configure_optimizers(), torch.optim.Adam)


def test_char_gpt_logits_shape() -> None:
    model = CharGPT(block_size=16, n_layer=1, n_head=2, n_embd=32)
    idx = torch.randint(0, VOCAB_SIZE, (2, 16))
    assert model(idx).shape == (2, 16, VOCAB_SIZE)
    with pytest.raises(ValueError, match="17"):
        model(torch.randint(0, VOCAB_SIZE, (1, 17)))


# --------------------------------------------------------------------------- data modules


def test_digits_split_is_deterministic_disjoint_and_complete() -> None:
    first, second = DigitsDataModule(seed=3), DigitsDataModule(seed=3)
    assert torch.equal(first.train_indices, second.train_indices)
    assert torch.equal(first.val_indices, second.val_indices)
    train, val = set(first.train_indices.tolist()), set(first.val_indices.tolist())
    assert not train & val
    assert train | val == set(range(DIGITS_TOTAL))
    assert len(val) == round(DIGITS_TOTAL * 0.2)
    other = DigitsDataModule(seed=4)
    assert not torch.equal(first.val_indices, other.val_indices)


def test_digits_loaders_give_normalised_batches() -> None:
    dm = DigitsDataModule(batch_size=16)
    assert (dm.num_features, dm.num_classes) == (64, 10)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (16, 64) and x.dtype == torch.float32
    assert y.shape == (16,) and y.dtype == torch.long
    x_all = dm.train_dataset.tensors[0]
    assert float(x_all.min()) >= 0.0 and float(x_all.max()) <= 1.0
    assert float(x_all.max()) == 1.0
    first_val = next(iter(dm.val_dataloader()))[1]
    assert torch.equal(first_val, dm.val_dataset.tensors[1][:16])  # no shuffling


def test_synthetic_data_is_seeded_and_labelled_by_a_teacher() -> None:
    kwargs = {"num_samples": 256, "in_features": 32, "num_classes": 5, "val_samples": 64}
    first, second = SyntheticDataModule(**kwargs), SyntheticDataModule(**kwargs)
    for a, b in zip(first.train_dataset.tensors, second.train_dataset.tensors):
        assert torch.equal(a, b)
    x, y = first.train_dataset.tensors
    assert x.shape == (256, 32) and y.shape == (256,)
    assert first.val_dataset.tensors[0].shape == (64, 32)
    assert set(y.tolist()) == set(range(5))
    other = SyntheticDataModule(seed=1, **kwargs)
    assert not torch.equal(x, other.train_dataset.tensors[0])


def test_encode_decode_round_trip_and_non_ascii() -> None:
    text = "".join(map(chr, range(128)))
    ids = encode(text)
    assert ids.dtype == torch.long and ids.tolist() == list(range(128))
    assert decode(ids) == text
    assert decode(encode("naïve ☃ café")) == "na?ve ? caf?"
    assert decode([104, 105]) == "hi"


def test_corpus_is_large_ascii_text() -> None:
    text = load_corpus()
    assert len(text) > 100_000
    assert load_corpus(max_chars=100) == text[:100]
    assert int(encode(text).max()) < VOCAB_SIZE


def test_char_windows_are_shifted_and_non_overlapping() -> None:
    dm = CharDataModule(block_size=16, batch_size=4, val_fraction=0.25, max_chars=2000)
    tokens = encode(load_corpus(2000))
    train, val = dm.train_dataset, dm.val_dataset
    assert len(train) == (1500 - 1) // 16 and len(val) == (500 - 1) // 16
    x0, y0 = train[0]
    x1, _ = train[1]
    assert torch.equal(y0[:-1], x0[1:])
    assert torch.equal(x0, tokens[:16]) and torch.equal(x1, tokens[16:32])
    assert torch.equal(val[0][0], tokens[1500:1516])
    xb, yb = next(iter(dm.val_dataloader()))
    assert xb.shape == yb.shape == (4, 16)


# --------------------------------------------------------------------------- CharGPT behaviour


def test_tied_weights_share_storage_only_when_requested() -> None:
    tied = CharGPT(n_embd=32, n_head=2)
    assert tied.head.weight is tied.tok_emb.weight
    assert tied.head.weight.data_ptr() == tied.tok_emb.weight.data_ptr()
    untied = CharGPT(n_embd=32, n_head=2, tie_weights=False)
    assert untied.head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()
    assert _num_params(untied) - _num_params(tied) == VOCAB_SIZE * 32
    groups = tied.configure_optimizers().param_groups
    assert sum(len(g["params"]) for g in groups) == len(list(tied.parameters()))


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = CharGPT(block_size=12, n_layer=2, n_head=2, n_embd=32).eval()
    idx = torch.randint(0, VOCAB_SIZE, (1, 12))
    t = 5
    changed = idx.clone()
    changed[0, t + 1] = (idx[0, t + 1] + 1) % VOCAB_SIZE
    with torch.no_grad():
        before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, : t + 1], after[:, : t + 1])
    assert not torch.allclose(before[:, t + 1], after[:, t + 1])


def test_generate_length_and_seed_reproducibility() -> None:
    model = CharGPT(block_size=8, n_layer=1, n_head=2, n_embd=16)
    model.train()
    long_prompt = "x" * 20  # longer than block_size: context gets cropped
    first = model.generate(long_prompt, max_new_tokens=30, seed=7, top_k=5)
    second = model.generate(long_prompt, max_new_tokens=30, seed=7, top_k=5)
    assert isinstance(first, str) and len(first) == 30
    assert first == second
    assert model.training  # previous mode restored
    assert len(model.generate("ab", max_new_tokens=0)) == 0
    assert all(ord(c) < VOCAB_SIZE for c in model.generate("é", 10, temperature=0.5, seed=1))


# --------------------------------------------------------------------------- argument checks


BAD_ARGS: list[tuple[Callable[..., object], dict[str, object], str]] = [
    (DigitsMLP, {"optimizer": "rmsprop"}, "'rmsprop'"),
    (DigitsMLP, {"hidden": 0}, "0"),
    (DigitsMLP, {"lr": -1.0}, "-1.0"),
    (DigitsDataModule, {"val_fraction": 1.5}, "1.5"),
    (DigitsDataModule, {"batch_size": 0}, "0"),
    (CharGPT, {"n_embd": 130, "n_head": 4}, "130"),
    (CharGPT, {"dropout": 1.0}, "1.0"),
    (CharGPT, {"block_size": -2}, "-2"),
    (CharDataModule, {"max_chars": 0}, "0"),
    (CharDataModule, {"val_fraction": 0.0}, "0.0"),
    (WideMLP, {"hidden": -5}, "-5"),
    (DeepMLP, {"depth": 0}, "0"),
    (DeepMLP, {"num_classes": 1}, "1"),
    (SyntheticDataModule, {"num_samples": 0}, "0"),
    # the sparse topic classifier and its data (models/topics.py)
    (TopicDataModule, {"num_topics": 1}, "1"),
    (TopicDataModule, {"num_topics": 500}, "500"),
    (TopicDataModule, {"num_topics": 2.5}, "2.5"),
    (TopicDataModule, {"window": 0}, "0"),
    (TopicDataModule, {"stride": -3}, "-3"),
    (TopicDataModule, {"val_fraction": 1.0}, "1.0"),
    (TopicDataModule, {"block_words": 0}, "0"),
    (TopicDataModule, {"block_words": 31}, "31"),  # shorter than the default 32-word window
    (TopicDataModule, {"block_words": 64.0}, "64.0"),
    (TopicDataModule, {"vocab_size": 1}, "1"),
    (TopicDataModule, {"batch_size": 0}, "0"),
    (BagOfWordsClassifier, {"vocab_size": 0}, "0"),
    (BagOfWordsClassifier, {"num_classes": 1}, "1"),
    (BagOfWordsClassifier, {"embed_dim": -1}, "-1"),
    (BagOfWordsClassifier, {"sparse": "yes"}, "'yes'"),
    (BagOfWordsClassifier, {"lr": 0.0}, "0.0"),
]


@pytest.mark.parametrize(("factory", "kwargs", "shown"), BAD_ARGS)
def test_bad_constructor_args_raise_value_error(
    factory: Callable[..., object], kwargs: dict[str, object], shown: str
) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=rf"{name}.*{re.escape(shown)}"):
        factory(**kwargs)


def test_optimizer_error_lists_allowed_choices() -> None:
    with pytest.raises(ValueError, match=r"\['adam', 'sgd', 'lamb', 'lars'\].*'rmsprop'"):
        DigitsMLP(optimizer="rmsprop")


def test_bad_generate_and_decode_args_raise_value_error() -> None:
    model = CharGPT(block_size=8, n_layer=1, n_head=2, n_embd=16)
    with pytest.raises(ValueError, match="temperature.*0"):
        model.generate("a", temperature=0)
    with pytest.raises(ValueError, match="top_k.*0"):
        model.generate("a", top_k=0)
    with pytest.raises(ValueError, match="prompt.*''"):
        model.generate("")
    with pytest.raises(ValueError, match="200"):
        decode([65, 200])


# --------------------------------------------------------------------------- training


def _val_loss(model: DigitsMLP, dm: DigitsDataModule) -> float:
    x, y = dm.val_dataset.tensors
    was_training = model.training
    model.eval()
    with torch.no_grad():
        loss = float(F.cross_entropy(model(x), y))
    model.train(was_training)
    return loss


def test_short_digits_training_lowers_loss() -> None:
    torch.manual_seed(0)  # not pl.seed_everything: that leaves PL_GLOBAL_SEED in os.environ
    dm = DigitsDataModule(batch_size=32)
    model = DigitsMLP()
    initial = _val_loss(model, dm)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=60,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, dm)
    final = _val_loss(model, dm)
    assert initial > 2.0  # about ln(10) for an untrained 10-way classifier
    assert final < initial - 1.0, (initial, final)
    assert float(trainer.callback_metrics["val_acc"]) > 0.7
