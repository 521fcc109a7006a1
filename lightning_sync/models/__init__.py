"""Example models and data modules used to exercise the synchronisation strategies.

All data is local (scikit-learn's digits, the stdlib's pydoc topics, or
seeded synthetic tensors), so nothing is ever downloaded.
"""

from __future__ import annotations

from lightning_sync.models.char_gpt import (
    VOCAB_SIZE,
    CharDataModule,
    CharGPT,
    DeferredCharGPT,
    decode,
    encode,
    load_corpus,
)
from lightning_sync.models.digits import (
    DIGITS_NUM_CLASSES,
    DIGITS_NUM_FEATURES,
    DigitsDataModule,
    DigitsMLP,
)
from lightning_sync.models.synthetic import DeepMLP, SyntheticDataModule, WideMLP
from lightning_sync.models.topics import (
    UNKNOWN_WORD,
    BagOfWordsClassifier,
    TopicDataModule,
    load_topics,
    tokenize,
    window_starts,
)

__all__ = [
    "DIGITS_NUM_CLASSES",
    "DIGITS_NUM_FEATURES",
    "UNKNOWN_WORD",
    "VOCAB_SIZE",
    "BagOfWordsClassifier",
    "CharDataModule",
    "CharGPT",
    "DeepMLP",
    "DeferredCharGPT",
    "DigitsDataModule",
    "DigitsMLP",
    "SyntheticDataModule",
    "TopicDataModule",
    "WideMLP",
    "decode",
    "encode",
    "load_corpus",
    "load_topics",
    "tokenize",
    "window_starts",
]
