"""Sparse bag-of-words topic classifier on the Python help texts bundled with the standard library.

The data is ``pydoc_data.topics.topics`` (topic name -> documentation text; no
download). A sample is a window of consecutive lowercase words from one
topic's text, labelled by that topic. The model averages the embeddings of
the window's words (``nn.EmbeddingBag``) and maps the mean to class logits.

It exists to exercise Hogwild! (Recht et al., 2011, "HOGWILD!: A Lock-Free
Approach to Parallelizing Stochastic Gradient Descent"), which suits sparse
updates: each step's embedding gradient has rows only for the words in the
batch, so lock-free workers that share one set of weights seldom write the
same rows.
"""

from __future__ import annotations

import functools
import re
from collections import Counter, OrderedDict

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

from lightning_sync.models._common import (
    ClassifierModule,
    SplitDataModule,
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
    "load_topics",
    "tokenize",
    "window_starts",
]

#: Vocabulary entry of id 0, which every word outside the vocabulary maps to.
UNKNOWN_WORD = "<unk>"
_WORD = re.compile(r"[a-z_][a-z0-9_]*")


def tokenize(text: str) -> list[str]:
    """Split ``text`` into lowercase identifier-like words (``[a-z_][a-z0-9_]*``)."""
    return _WORD.findall(text.lower())


@functools.lru_cache(maxsize=1)
def _all_topics() -> tuple[tuple[str, tuple[str, ...]], ...]:
    from pydoc_data.topics import topics

    ranked = sorted(topics.items(), key=lambda item: (-len(item[1]), item[0]))
    return tuple((name, tuple(tokenize(text))) for name, text in ranked)


def load_topics(num_topics: int | None = None) -> list[tuple[str, tuple[str, ...]]]:
    """Return ``(name, words)`` for the ``num_topics`` topics with the most text (all if ``None``).

    Topics are ordered by text length (longest first), ties by name, so the
    result is the same on every rank and every run.
    """
    ranked = _all_topics()
    if num_topics is not None:
        check_int("num_topics", num_topics, 1)
        if num_topics > len(ranked):
            raise ValueError(
                f"num_topics must be in [1, {len(ranked)}] (topics available), got {num_topics!r}"
            )
        ranked = ranked[:num_topics]
    return list(ranked)


def _train_words(num_words: int, val_fraction: float) -> int:
    """Number of leading words that belong to the training part."""
    return num_words - round(num_words * val_fraction)


def window_starts(
    num_words: int, window: int, stride: int, val_fraction: float
) -> tuple[list[int], list[int]]:
    """Return the first word positions of the ``(train, val)`` windows over ``num_words`` words.

    The tail ``round(num_words * val_fraction)`` words are for validation, the
    rest for training. Windows start every ``stride`` words from the start of
    their part and never cross the split, so no word position is in both.
    """
    check_int("num_words", num_words, 0)
    check_positive_int("window", window)
    check_positive_int("stride", stride)
    n_train = _train_words(num_words, check_fraction("val_fraction", val_fraction))
    train = list(range(0, n_train - window + 1, stride))
    val = list(range(n_train, num_words - window + 1, stride))
    return train, val


class TopicDataModule(SplitDataModule):
    """LightningDataModule of word windows from the ``num_topics`` longest pydoc topics.

    Each topic's word sequence is split in two: the first ``1 - val_fraction``
    for training, the tail for validation (see :func:`window_starts`; no
    window crosses the split). The vocabulary is the ``vocab_size - 1`` most
    frequent *training* words (ties by word), with id 0 for every other word.
    An item is ``(x, y)``: ``x`` a LongTensor of ``window`` word ids, ``y`` the
    topic's index in :attr:`topic_names`.
    """

    def __init__(
        self,
        batch_size: int = 64,
        num_topics: int = 8,
        window: int = 16,
        stride: int = 4,
        val_fraction: float = 0.2,
        vocab_size: int = 4096,
        num_workers: int = 0,
    ) -> None:
        """
        Args:
            batch_size: per-process batch size (>= 1).
            num_topics: number of topics (classes), the longest ones (>= 2, at most all 79).
            window: words per sample (>= 1).
            stride: words between the starts of consecutive windows (>= 1).
            val_fraction: share of each topic's words (its tail) used for validation, in (0, 1).
            vocab_size: embedding rows: id 0 for unknown words plus up to ``vocab_size - 1``
                training words (>= 2).
            num_workers: DataLoader worker processes (>= 0).
        """
        super().__init__(batch_size, num_workers)
        available = len(_all_topics())
        if check_num_classes(num_topics) > available:
            raise ValueError(
                f"num_topics must be in [2, {available}] (topics available), got {num_topics!r}"
            )
        self._num_topics = num_topics
        self._window = check_positive_int("window", window)
        self._stride = check_positive_int("stride", stride)
        self._val_fraction = check_fraction("val_fraction", val_fraction)
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
            train, val = window_starts(len(words), self._window, self._stride, self._val_fraction)
            if not train or not val:
                raise ValueError(
                    f"topic {name!r} has {len(words)} words: too few for a training and a "
                    f"validation window of {self._window!r} words with val_fraction "
                    f"{self._val_fraction!r}; lower num_topics or window"
                )
            starts.append((train, val))

        counts = Counter(
            word
            for _, words in topics
            for word in words[: _train_words(len(words), self._val_fraction)]
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
    rows are only the word ids in the batch (a few hundred of
    ``vocab_size``), and plain SGD (no momentum, no weight decay) then updates
    just those rows: the access pattern Hogwild! relies on. ``sparse=False``
    gives an ordinary dense gradient (mostly zeros) for strategies that bucket
    dense gradients. Logs ``train_loss``, ``val_loss`` and ``val_acc``.
    """

    def __init__(
        self,
        vocab_size: int = 4096,
        num_classes: int = 8,
        embed_dim: int = 64,
        sparse: bool = True,
        lr: float = 2.0,
    ) -> None:
        """
        Args:
            vocab_size: embedding rows (>= 2; keep equal to the data module's ``vocab_size``).
            num_classes: number of topics (>= 2).
            embed_dim: embedding width (>= 1).
            sparse: give the embedding sparse gradients (True) or dense ones (False).
            lr: plain SGD learning rate (> 0).
        """
        check_int("vocab_size", vocab_size, 2)
        check_num_classes(num_classes)
        check_positive_int("embed_dim", embed_dim)
        if not isinstance(sparse, bool):
            raise ValueError(f"sparse must be True or False, got {sparse!r}")
        net = nn.Sequential(
            OrderedDict(
                embedding=nn.EmbeddingBag(vocab_size, embed_dim, mode="mean", sparse=sparse),
                head=nn.Linear(embed_dim, num_classes),
            )
        )
        super().__init__(net=net, num_classes=num_classes, lr=check_positive_float("lr", lr))
        self.save_hyperparameters()

    @property
    def embedding(self) -> nn.EmbeddingBag:
        """The word-embedding bag (the sparse part)."""
        return self.net.embedding

    @property
    def head(self) -> nn.Linear:
        """The dense output layer."""
        return self.net.head

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Plain SGD: with no momentum or weight decay a sparse gradient updates only its rows."""
        return torch.optim.SGD(self.parameters(), lr=self._lr)
