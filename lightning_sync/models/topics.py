"""Sparse bag-of-words topic classifier on the Python help texts bundled with the standard library.

The data is ``pydoc_data.topics.topics`` (topic name -> documentation text; no
download), less the topics that are sections of longer ones. A sample is a
window of consecutive lowercase words from one topic's text, labelled by that
topic. Each topic is cut into blocks, and every fifth block (by default) is
held out for validation, so validation text is unseen but of the same kind as
training text. The model averages the embeddings of the window's words
(``nn.EmbeddingBag``) and maps the mean to class logits.

It exists to exercise Hogwild! (Recht et al., 2011, "HOGWILD!: A Lock-Free
Approach to Parallelizing Stochastic Gradient Descent"), which suits sparse
updates: each step's embedding gradient has rows only for the words in the
batch, so lock-free workers that share one set of weights mostly write
different rows (the most frequent words and the small dense head are the
exceptions).
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter, OrderedDict
from fractions import Fraction

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

from lightning_sync.models._common import (
    ClassifierModule,
    SplitDataModule,
    build_optimizer,
    check_fraction,
    check_int,
    check_num_classes,
    check_positive_float,
    check_positive_int,
)

__all__ = [
    "UNKNOWN_WORD",
    "BagOfWordsClassifier",
    "TopicDataModule",
    "block_splits",
    "load_topics",
    "tokenize",
    "window_starts",
]

#: Vocabulary entry of id 0, which every word outside the vocabulary maps to.
UNKNOWN_WORD = "<unk>"
_WORD = re.compile(r"[a-z_][a-z0-9_]*")
# Std of the initial word embeddings (see BagOfWordsClassifier).
_EMBED_INIT_STD = 0.1


def tokenize(text: str) -> list[str]:
    """Split ``text`` into lowercase identifier-like words (``[a-z_][a-z0-9_]*``)."""
    return _WORD.findall(text.lower())


@functools.lru_cache(maxsize=1)
def _all_topics() -> tuple[tuple[str, tuple[str, ...]], ...]:
    from pydoc_data.topics import topics

    ranked = sorted(topics.items(), key=lambda item: (-len(item[1]), item[0]))
    words = [tuple(tokenize(text)) for _, text in ranked]
    # Each topic's words as one string, padded so that ``in`` matches whole words only.
    joined = [f" {' '.join(w)} " for w in words]

    def is_part_of_another(i: int) -> bool:
        return any(
            j != i and joined[i] in joined[j] and (len(words[j]) > len(words[i]) or j < i) for j in range(len(ranked))
        )

    return tuple((name, words[i]) for i, (name, _) in enumerate(ranked) if not is_part_of_another(i))


def load_topics(num_topics: int | None = None) -> list[tuple[str, tuple[str, ...]]]:
    """Return ``(name, words)`` for the ``num_topics`` topics with the most text (all if ``None``).

    Only distinct topics count: a topic whose words appear, in order and
    contiguous, in a longer topic is left out (or in an identical topic that
    ranks first). Many pydoc topics are sections of another one, such as
    ``attribute-access`` and ``customization`` of ``specialnames`` or ``try``
    of ``compound``, and their windows would otherwise carry two labels.
    Topics are ordered by text length (longest first), ties by name, so the
    result is the same on every rank and every run.
    """
    ranked = _all_topics()
    if num_topics is not None:
        check_int("num_topics", num_topics, 1)
        if num_topics > len(ranked):
            raise ValueError(f"num_topics must be in [1, {len(ranked)}] (topics available), got {num_topics!r}")
        ranked = ranked[:num_topics]
    return list(ranked)


def block_splits(num_words: int, block_words: int, val_fraction: float) -> tuple[list[range], list[range]]:
    """Return the word ranges of the ``(train, val)`` blocks of a ``num_words``-word sequence.

    The words are cut into consecutive blocks of ``block_words`` words (the
    last may be shorter). Blocks are interleaved: block ``i`` (from 0) is for
    validation exactly when ``floor((i + 1) * f) > floor(i * f)``, where ``f``
    is ``val_fraction`` read as the nearest fraction with a denominator of at
    most 1000 (so 0.3 means exactly 3/10). Hence the first ``n`` blocks hold
    exactly ``floor(n * f)`` validation blocks, spread evenly; when ``1 / f``
    is an integer ``k`` that is every ``k``-th block, the last of each group
    of ``k`` (``f = 0.2``: blocks 4, 9, 14, ...).
    """
    check_int("num_words", num_words, 0)
    check_positive_int("block_words", block_words)
    f = Fraction(check_fraction("val_fraction", val_fraction)).limit_denominator(1000)
    parts: tuple[list[range], list[range]] = ([], [])
    for i, first in enumerate(range(0, num_words, block_words)):
        is_val = math.floor((i + 1) * f) > math.floor(i * f)
        parts[is_val].append(range(first, min(first + block_words, num_words)))
    return parts


def window_starts(
    num_words: int, window: int, stride: int, val_fraction: float, block_words: int
) -> tuple[list[int], list[int]]:
    """Return the first word positions of the ``(train, val)`` windows over ``num_words`` words.

    The blocks come from :func:`block_splits`. In each block, windows start
    every ``stride`` words from the block's first word and end inside it, so
    no window crosses a block boundary and no word position is in both a
    training and a validation window. ``block_words`` must be >= ``window``;
    a block shorter than ``window`` (only the last can be) gets no window.
    """
    check_positive_int("window", window)
    check_positive_int("stride", stride)
    _check_block_words(block_words, window)
    splits = block_splits(num_words, block_words, val_fraction)
    train, val = (
        [start for block in blocks for start in range(block.start, block.stop - window + 1, stride)]
        for blocks in splits
    )
    return train, val


def _check_block_words(block_words: object, window: int) -> int:
    """Return ``block_words`` if it is an int >= ``window``, else raise ``ValueError``."""
    if not (isinstance(block_words, int) and not isinstance(block_words, bool)) or (block_words < window):
        raise ValueError(f"block_words must be an int >= window ({window!r}), got {block_words!r}")
    return block_words


class TopicDataModule(SplitDataModule):
    """LightningDataModule of word windows from the ``num_topics`` longest pydoc topics.

    Each topic's word sequence is cut into blocks of ``block_words`` words,
    and about ``val_fraction`` of them, interleaved (every fifth by default),
    are for validation (see :func:`block_splits`). Windows never cross a
    block boundary (see :func:`window_starts`), so no word position is in
    both splits, while validation text comes from all through each topic and
    so resembles the training text (a held-out tail, the former split, is
    different material: accuracy peaked near 0.5 on it). Every topic needs
    at least one training and one validation window, so with the defaults
    (a first validation block at index 4) a topic needs about
    ``4 * block_words + window`` words: ``num_topics`` can be at most 11.
    The vocabulary is the ``vocab_size - 1`` most frequent words of the
    *training* blocks (ties by word), with id 0 for every other word. An
    item is ``(x, y)``: ``x`` a LongTensor of ``window`` word ids, ``y`` the
    topic's index in :attr:`topic_names`.
    """

    def __init__(
        self,
        batch_size: int = 64,
        num_topics: int = 8,
        window: int = 32,
        stride: int = 4,
        val_fraction: float = 0.2,
        block_words: int = 256,
        vocab_size: int = 4096,
        num_workers: int = 0,
    ) -> None:
        """
        Args:
            batch_size: per-process batch size (>= 1).
            num_topics: number of topics (classes), the longest distinct ones (>= 2, at most
                ``len(load_topics())``, 57 on Python 3.11; at most 11 with the default sizes).
            window: words per sample (>= 1).
            stride: words between the starts of consecutive windows (>= 1).
            val_fraction: share of each topic's blocks used for validation (interleaved), in (0, 1).
            block_words: words per block, the unit of the split (>= ``window``).
            vocab_size: embedding rows: id 0 for unknown words plus up to ``vocab_size - 1``
                training words (>= 2).
            num_workers: DataLoader worker processes (>= 0).
        """
        super().__init__(batch_size, num_workers)
        available = len(_all_topics())
        if check_int("num_topics", num_topics, 2) > available:
            raise ValueError(f"num_topics must be in [2, {available}] (topics available), got {num_topics!r}")
        self._num_topics = num_topics
        self._window = check_positive_int("window", window)
        self._stride = check_positive_int("stride", stride)
        self._val_fraction = check_fraction("val_fraction", val_fraction)
        self._block_words = _check_block_words(block_words, self._window)
        self._vocab_size = check_int("vocab_size", vocab_size, 2)
        self._topic_names = tuple(name for name, _ in load_topics(num_topics))
        self._vocabulary: tuple[str, ...] | None = None
        self._positions: tuple[Tensor, Tensor] | None = None
        self.save_hyperparameters()

    @property
    def vocab_size(self) -> int:
        """Embedding rows the model needs (the configured size; the vocabulary may use fewer)."""
        return self._vocab_size

    @property
    def num_classes(self) -> int:
        """Number of classes (one per topic)."""
        return self._num_topics

    @property
    def topic_names(self) -> tuple[str, ...]:
        """Topic of each class index, longest text first."""
        return self._topic_names

    @property
    def vocabulary(self) -> tuple[str, ...]:
        """Word of each id: :data:`UNKNOWN_WORD` at 0, then by training frequency."""
        self.setup()
        assert self._vocabulary is not None
        return self._vocabulary

    @property
    def train_positions(self) -> Tensor:
        """``(num_train, 2)`` LongTensor: each training window's topic and first word position."""
        self.setup()
        assert self._positions is not None
        return self._positions[0]

    @property
    def val_positions(self) -> Tensor:
        """``(num_val, 2)`` LongTensor: each validation window's topic and first word position."""
        self.setup()
        assert self._positions is not None
        return self._positions[1]

    def _build_datasets(self) -> tuple[Dataset, Dataset]:
        topics = load_topics(self._num_topics)
        starts = []
        for name, words in topics:
            train, val = window_starts(len(words), self._window, self._stride, self._val_fraction, self._block_words)
            if not train or not val:
                raise ValueError(
                    f"topic {name!r} has {len(words)} words: too few for a training and a "
                    f"validation window of {self._window!r} words in blocks of "
                    f"{self._block_words!r} words with val_fraction {self._val_fraction!r}; "
                    f"lower num_topics or block_words"
                )
            starts.append((train, val))

        counts = Counter(
            word
            for _, words in topics
            for block in block_splits(len(words), self._block_words, self._val_fraction)[0]
            for word in words[block.start : block.stop]
        )
        ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        vocabulary = (UNKNOWN_WORD,) + tuple(word for word, _ in ranked[: self._vocab_size - 1])
        ids = {word: i for i, word in enumerate(vocabulary)}

        offsets = torch.arange(self._window)
        parts: list[list[tuple[Tensor, Tensor, Tensor]]] = [[], []]
        for label, ((_, words), split) in enumerate(zip(topics, starts)):
            encoded = torch.tensor([ids.get(word, 0) for word in words], dtype=torch.long)
            for part, part_starts in zip(parts, split):
                first = torch.tensor(part_starts, dtype=torch.long)
                windows = encoded[first[:, None] + offsets]
                part.append((windows, first, torch.full_like(first, label)))

        datasets = []
        positions = []
        for part in parts:
            x, first, y = (torch.cat(column) for column in zip(*part))
            datasets.append(TensorDataset(x, y))
            positions.append(torch.stack([y, first], dim=1))
        self._vocabulary = vocabulary
        self._positions = (positions[0], positions[1])
        return datasets[0], datasets[1]


class BagOfWordsClassifier(ClassifierModule):
    """Mean-of-word-embeddings topic classifier: ``EmbeddingBag(mode="mean")`` then ``Linear``.

    With ``sparse=True`` the embedding's gradient is a sparse tensor whose
    rows are only the word ids in the batch (with the defaults, 64 windows
    of 32 words, about 660 of the 4096 rows), and plain SGD (no momentum, no
    weight decay) then updates just those rows: the access pattern Hogwild!
    relies on. ``sparse=False``
    gives an ordinary dense gradient (mostly zeros) for strategies that bucket
    dense gradients; the values, and so training, are the same either way.
    Logs ``train_loss``, ``val_loss`` and ``val_acc``.

    Embeddings start small (N(0, 0.1^2)) rather than PyTorch's N(0, 1), which
    makes every window's mean a random feature that SGD must first unlearn.
    With the defaults and :class:`TopicDataModule`'s (8 topics, 32-word
    windows), one process on one thread reaches 0.69-0.75 validation accuracy
    after 2 epochs and 0.74-0.76 after 3 (seeds 0-9; majority class 0.27),
    about 0.2 s an epoch, and then stays there. That is about what linear
    bag-of-words baselines get on the same windows (logistic regression 0.75,
    naive Bayes 0.79): the rest is text shared between related topics such as
    ``types``, ``typesseq`` and ``specialnames``.
    """

    def __init__(
        self,
        vocab_size: int = 4096,
        num_classes: int = 8,
        embed_dim: int = 64,
        sparse: bool = True,
        lr: float = 4.0,
        optimizer: str = "sgd",
    ) -> None:
        """
        Args:
            vocab_size: embedding rows (>= 2; keep equal to the data module's ``vocab_size``).
            num_classes: number of topics (>= 2).
            embed_dim: embedding width (>= 1).
            sparse: give the embedding sparse gradients (True) or dense ones (False).
            lr: learning rate (> 0).
            optimizer: ``"sgd"`` (the default): plain SGD, no momentum, no weight decay. With
                ``sparse=False`` also ``"adam"``, ``"lamb"`` or ``"lars"``
                (:func:`~lightning_sync.models._common.build_optimizer`); those keep state for every
                row, so they need dense gradients.
        """
        check_int("vocab_size", vocab_size, 2)
        check_num_classes(num_classes)
        check_positive_int("embed_dim", embed_dim)
        if not isinstance(sparse, bool):
            raise ValueError(f"sparse must be True or False, got {sparse!r}")
        if sparse and optimizer != "sgd":  # ClassifierModule checks the name against OPTIMIZERS otherwise
            raise ValueError(
                f"optimizer must be one of ['sgd'] (with sparse=True only plain SGD; set sparse=False "
                f"for the others), got {optimizer!r}"
            )
        embedding = nn.EmbeddingBag(vocab_size, embed_dim, mode="mean", sparse=sparse)
        nn.init.normal_(embedding.weight, std=_EMBED_INIT_STD)
        net = nn.Sequential(OrderedDict(embedding=embedding, head=nn.Linear(embed_dim, num_classes)))
        super().__init__(net=net, num_classes=num_classes, lr=check_positive_float("lr", lr), optimizer=optimizer)
        self.save_hyperparameters()

    def forward(self, x: Tensor) -> Tensor:
        """Return ``(batch, num_classes)`` logits for ``(batch, window)`` word ids."""
        return self.net(x)

    @property
    def embedding(self) -> nn.EmbeddingBag:
        """The word-embedding bag (the sparse part)."""
        return self.net.embedding

    @property
    def head(self) -> nn.Linear:
        """The dense output layer."""
        return self.net.head

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Plain SGD (with no momentum or weight decay a sparse gradient updates only its rows), or the
        ``optimizer`` chosen for dense gradients."""
        if self._optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self._lr)
        return build_optimizer(self.parameters(), self._optimizer_name, self._lr)
