"""Unit tests for the bag-of-words topic classifier: split, vocabulary, sparsity, training."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator

import lightning.pytorch as pl
import pytest
import torch
from torch.nn import functional as F

from lightning_sync.models import (
    UNKNOWN_WORD,
    BagOfWordsClassifier,
    TopicDataModule,
    load_topics,
    tokenize,
    window_starts,
)
from lightning_sync.models.topics import block_splits

__all__: list[str] = []


@pytest.fixture(scope="module")
def dm() -> TopicDataModule:
    """The default data module, built once (building it is deterministic)."""
    module = TopicDataModule(batch_size=32)
    module.setup()
    return module


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Train on one CPU thread (timings comparable across machines); restore the count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# The defaults of TopicDataModule, spelled out so that the tests check the split independently.
WINDOW, BLOCK, EVERY = 32, 256, 5  # val_fraction 0.2: block i is validation when i % 5 == 4


def _training_words(words: tuple[str, ...]) -> list[str]:
    """The words of the default training blocks (every block but each fifth)."""
    return [w for i, w in enumerate(words) if (i // BLOCK) % EVERY != EVERY - 1]


# --------------------------------------------------------------------------- data


def test_tokenize_gives_lowercase_identifier_words() -> None:
    assert tokenize("The __init__() method, x2 = 3.5; 'Foo_Bar'!") == ["the", "__init__", "method", "x2", "foo_bar"]


def test_topics_are_the_longest_distinct_ones_first_ties_by_name(dm: TopicDataModule) -> None:
    from pydoc_data.topics import topics

    ranked = sorted(topics, key=lambda name: (-len(topics[name]), name))
    joined = {name: f" {' '.join(tokenize(topics[name]))} " for name in topics}
    names = [name for name, _ in load_topics()]
    assert names == [name for name in ranked if name in names]  # the order is kept
    for i, name in enumerate(ranked):  # left out if its words are a run in a longer/earlier one
        inside = [
            other
            for j, other in enumerate(ranked)
            if j != i and joined[name] in joined[other] and (len(joined[other]) > len(joined[name]) or j < i)
        ]
        assert (name in names) == (not inside), (name, inside)
    for section, whole in [
        ("attribute-access", "specialnames"),
        ("customization", "specialnames"),
        ("try", "compound"),
        ("typesseq-mutable", "typesseq"),
    ]:
        assert section not in names and whole in names
    assert dm.topic_names == tuple(names[:8])
    assert "typesmapping" in dm.topic_names and "attribute-access" not in dm.topic_names
    assert dm.num_classes == 8 and dm.vocab_size == 4096
    labels = torch.cat([dm.train_dataset.tensors[1], dm.val_dataset.tensors[1]])
    assert set(labels.tolist()) == set(range(8))


@pytest.mark.parametrize(
    ("num_words", "block_words", "val_fraction", "val_blocks"),
    [
        (2600, 256, 0.2, [4, 9]),  # 11 blocks, the last of 40 words: every fifth is validation
        (1000, 100, 0.5, [1, 3, 5, 7, 9]),
        (1000, 100, 0.3, [3, 6, 9]),  # 3/10 exactly: floor((i + 1) * 0.3) > floor(i * 0.3)
        (100, 100, 0.2, []),  # one block: no validation block
        (0, 16, 0.2, []),
    ],
)
def test_block_splits_interleave_validation_blocks(
    num_words: int, block_words: int, val_fraction: float, val_blocks: list[int]
) -> None:
    train, val = block_splits(num_words, block_words, val_fraction)
    blocks = [range(s, min(s + block_words, num_words)) for s in range(0, num_words, block_words)]
    assert val == [blocks[i] for i in val_blocks]
    assert train == [b for i, b in enumerate(blocks) if i not in val_blocks]


@pytest.mark.parametrize(
    ("num_words", "window", "stride", "val_fraction", "block_words"),
    [
        (2600, 32, 4, 0.2, 256),
        (1000, 16, 4, 0.2, 100),
        (1001, 5, 3, 0.3, 37),
        (570, 7, 10, 0.5, 7),
        (600, 16, 1, 0.25, 50),
    ],
)
def test_window_starts_stay_inside_their_blocks(
    num_words: int, window: int, stride: int, val_fraction: float, block_words: int
) -> None:
    train, val = window_starts(num_words, window, stride, val_fraction, block_words)
    train_blocks, val_blocks = block_splits(num_words, block_words, val_fraction)
    for starts, blocks in ((train, train_blocks), (val, val_blocks)):
        # Windows start every `stride` words from each block's start and end inside the block.
        assert starts == [s for b in blocks for s in range(b.start, b.stop - window + 1, stride)]
        assert all(s // block_words == (s + window - 1) // block_words for s in starts)
    train_words = {p for s in train for p in range(s, s + window)}
    val_words = {p for s in val for p in range(s, s + window)}
    assert train_words and val_words and not train_words & val_words
    assert max(train_words | val_words) < num_words


def test_data_module_windows_hold_the_words_at_their_positions_without_overlap(
    dm: TopicDataModule,
) -> None:
    ids = {word: i for i, word in enumerate(dm.vocabulary)}
    topics = load_topics(8)
    for positions, dataset in ((dm.train_positions, dm.train_dataset), (dm.val_positions, dm.val_dataset)):
        x, y = dataset.tensors
        assert positions.shape == (len(x), 2) and torch.equal(positions[:, 0], y)
        for row in (0, len(x) // 2, len(x) - 1):
            topic, first = positions[row].tolist()
            words = topics[topic][1][first : first + WINDOW]
            assert x[row].tolist() == [ids.get(word, 0) for word in words]
    for topic, (name, words) in enumerate(topics):
        covered = []
        for positions, is_val in ((dm.train_positions, False), (dm.val_positions, True)):
            firsts = positions[positions[:, 0] == topic, 1].tolist()
            assert firsts, f"topic {name!r} has no windows in one split"
            blocks = {s // BLOCK for s in firsts}
            # No window crosses a block boundary, and every block of the split that can hold
            # a window has windows: each fifth block for validation, the others for training.
            assert blocks == {(s + WINDOW - 1) // BLOCK for s in firsts}, name
            assert blocks == {
                b
                for b in range(-(-len(words) // BLOCK))
                if (b % EVERY == EVERY - 1) == is_val and len(words) - b * BLOCK >= WINDOW
            }, name
            covered.append({p for s in firsts for p in range(s, s + WINDOW)})
        train_words, val_words = covered
        assert not train_words & val_words, name
        assert max(train_words | val_words) < len(words), name
    # Validation comes from all through a topic, not only its tail.
    specialnames = dm.val_positions[dm.val_positions[:, 0] == 0, 1]
    assert sorted({s // BLOCK for s in specialnames.tolist()}) == [4, 9, 14, 19, 24, 29, 34]


def test_vocabulary_is_built_from_training_words_only(dm: TopicDataModule) -> None:
    topics = load_topics(8)
    train_counts = Counter(w for _, words in topics for w in _training_words(words))
    val_only = {w for _, words in topics for w in words} - set(train_counts)
    assert val_only  # the validation blocks bring words the training blocks never use
    vocabulary = dm.vocabulary
    assert vocabulary[0] == UNKNOWN_WORD
    # Fewer distinct training words than vocab_size - 1: every training word gets its own id.
    assert set(vocabulary[1:]) == set(train_counts) and len(vocabulary) < dm.vocab_size
    assert not val_only & set(vocabulary)
    val_x = dm.val_dataset.tensors[0]
    assert int(dm.train_dataset.tensors[0].max()) < len(vocabulary)
    assert (val_x == 0).any() and int(val_x.max()) < len(vocabulary)

    small = TopicDataModule(vocab_size=50)
    ranked = sorted(train_counts.items(), key=lambda item: (-item[1], item[0]))
    assert small.vocabulary == (UNKNOWN_WORD,) + tuple(w for w, _ in ranked[:49])
    assert int(small.train_dataset.tensors[0].max()) == 49
    assert (small.train_dataset.tensors[0] == 0).any()  # rarer training words are unknown too


def test_loaders_give_fixed_length_long_batches(dm: TopicDataModule) -> None:
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (32, WINDOW) and x.dtype == torch.long
    assert y.shape == (32,) and y.dtype == torch.long
    assert int(x.min()) >= 0 and int(x.max()) < dm.vocab_size
    xv, yv = next(iter(dm.val_dataloader()))
    assert torch.equal(xv, dm.val_dataset.tensors[0][:32])  # no shuffling
    other = TopicDataModule(batch_size=8, num_topics=3, window=5, stride=5)
    xo, yo = next(iter(other.train_dataloader()))
    assert xo.shape == (8, 5) and int(yo.max()) < 3 and other.num_classes == 3


def test_too_short_topic_is_named_when_building() -> None:
    topics = load_topics()
    # The first (longest) topic too short for a validation block (block 4) holding a window.
    name, words = next((n, w) for n, w in topics if len(w) < (EVERY - 1) * BLOCK + WINDOW)
    shown = (
        rf"topic {re.escape(repr(name))} has {len(words)} words.*{WINDOW}.*blocks of {BLOCK}"
        r".*num_topics or block_words"
    )
    with pytest.raises(ValueError, match=shown):
        TopicDataModule(num_topics=len(topics)).setup()
    assert [n for n, _ in topics].index(name) == 11  # so the defaults allow at most 11 topics
    TopicDataModule(num_topics=11).setup()
    # Longer blocks need longer topics: 512-word blocks already fail within the default 8.
    with pytest.raises(ValueError, match=r"topic 'typesmapping' has 1682 words.*block_words"):
        TopicDataModule(block_words=512).setup()


# --------------------------------------------------------------------------- model


def test_logits_shape_and_plain_sgd() -> None:
    model = BagOfWordsClassifier(vocab_size=100, num_classes=5, embed_dim=8)
    assert model(torch.randint(0, 100, (3, 16))).shape == (3, 5)
    optimizer = model.configure_optimizers()
    assert type(optimizer) is torch.optim.SGD
    (group,) = optimizer.param_groups
    assert group["lr"] == 4.0 and group["momentum"] == 0 and group["weight_decay"] == 0
    assert model.hparams["sparse"] is True and model.embedding.sparse


def test_sparse_gradient_and_step_touch_only_the_batch_words() -> None:
    torch.manual_seed(0)
    model = BagOfWordsClassifier(vocab_size=500, num_classes=4, embed_dim=8, sparse=True)
    x = torch.randint(0, 500, (6, 16))
    y = torch.randint(0, 4, (6,))
    F.cross_entropy(model(x), y).backward()
    grad = model.embedding.weight.grad
    assert grad.is_sparse and grad.shape == (500, 8)
    touched = set(grad.coalesce().indices()[0].tolist())
    assert touched == set(x.unique().tolist()) and len(touched) < 500
    assert not model.head.weight.grad.is_sparse

    before = model.embedding.weight.detach().clone()
    optimizer = model.configure_optimizers()
    optimizer.step()
    changed = (model.embedding.weight.detach() != before).any(dim=1).nonzero().flatten()
    assert set(changed.tolist()) <= touched and changed.numel() > 0

    torch.manual_seed(0)
    dense = BagOfWordsClassifier(vocab_size=500, num_classes=4, embed_dim=8, sparse=False)
    F.cross_entropy(dense(x), y).backward()
    assert not dense.embedding.weight.grad.is_sparse
    torch.testing.assert_close(dense.embedding.weight.grad, grad.to_dense())


# --------------------------------------------------------------------------- argument checks


def test_num_topics_error_gives_the_allowed_range() -> None:
    available = len(load_topics())
    with pytest.raises(ValueError, match=rf"\[2, {available}\].*500"):
        TopicDataModule(num_topics=500)


def test_block_words_error_names_the_window() -> None:
    with pytest.raises(ValueError, match=r"block_words must be an int >= window \(32\), got 31"):
        TopicDataModule(block_words=31)
    TopicDataModule(window=8, block_words=8)  # a block may hold exactly one window


def test_bad_window_starts_args_raise_value_error() -> None:
    with pytest.raises(ValueError, match="val_fraction.*0"):
        window_starts(100, 16, 4, 0, 64)
    with pytest.raises(ValueError, match="num_words.*-1"):
        window_starts(-1, 16, 4, 0.2, 64)
    with pytest.raises(ValueError, match=r"block_words.*\(16\).*15"):
        window_starts(100, 16, 4, 0.2, 15)
    with pytest.raises(ValueError, match="block_words.*0"):
        block_splits(100, 0, 0.2)


# --------------------------------------------------------------------------- config


def test_bow_topics_config_wires_the_model_to_its_data() -> None:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from lightning_sync.cli import config_dir

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            cfg = compose("train", overrides=["model=bow_topics", "data.num_topics=5", "data.vocab_size=300"])
    finally:
        GlobalHydra.instance().clear()
    assert cfg.data._target_.endswith("TopicDataModule")
    assert cfg.model.num_classes == 5 and cfg.model.vocab_size == 300
    assert cfg.model.sparse is True


# --------------------------------------------------------------------------- training


def test_short_training_run_reaches_validation_accuracy(one_thread: None) -> None:
    torch.manual_seed(0)  # not pl.seed_everything: that leaves PL_GLOBAL_SEED in os.environ
    data = TopicDataModule()
    model = BagOfWordsClassifier(data.vocab_size, data.num_classes)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    # Measured on 1 thread (seeds 0-9): 0.736-0.763 after 3 epochs (0.744-0.760 after 5), about
    # 0.2 s an epoch; the majority class is 0.270 of the validation set, and sklearn's
    # bag-of-words logistic regression on the same windows gets 0.75.
    assert float(trainer.callback_metrics["val_acc"]) > 0.65
