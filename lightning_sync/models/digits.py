"""Handwritten digits (scikit-learn's bundled 8x8 set) and a small MLP for them.

The data ships with scikit-learn, so nothing is downloaded: 1797 grey-scale
8x8 images of the digits 0-9, flattened to 64 features scaled to [0, 1].
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sync.models._common import (
    ClassifierModule,
    TensorDataModule,
    check_fraction,
    check_int,
    make_mlp,
    seeded_split,
)

__all__ = ["DIGITS_NUM_CLASSES", "DIGITS_NUM_FEATURES", "DigitsDataModule", "DigitsMLP"]

#: Number of input features (8 x 8 pixels).
DIGITS_NUM_FEATURES = 64
#: Number of classes (digits 0-9).
DIGITS_NUM_CLASSES = 10
_PIXEL_MAX = 16.0


class DigitsDataModule(TensorDataModule):
    """LightningDataModule over scikit-learn's ``load_digits`` with a seeded train/val split.

    The split is a seeded permutation, so it is the same on every rank. The
    training loader shuffles (Lightning swaps in a ``DistributedSampler`` under
    DDP); the validation loader does not.
    """

    def __init__(
        self,
        batch_size: int = 32,
        val_fraction: float = 0.2,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        """
        Args:
            batch_size: per-process batch size (>= 1).
            val_fraction: share of the 1797 samples held out for validation, in (0, 1).
            seed: seed of the permutation that decides the split.
            num_workers: DataLoader worker processes (>= 0).
        """
        super().__init__(DIGITS_NUM_FEATURES, DIGITS_NUM_CLASSES, batch_size, num_workers)
        self._val_fraction = check_fraction("val_fraction", val_fraction)
        self._seed = check_int("seed", seed)
        self._train_idx: Tensor | None = None
        self._val_idx: Tensor | None = None
        self.save_hyperparameters()

    def _build(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.as_tensor(digits.data, dtype=torch.float32) / _PIXEL_MAX
        y = torch.as_tensor(digits.target, dtype=torch.long)
        self._train_idx, self._val_idx = seeded_split(len(y), self._val_fraction, self._seed)
        return x[self._train_idx], y[self._train_idx], x[self._val_idx], y[self._val_idx]

    @property
    def train_indices(self) -> Tensor:
        """Sorted indices (into ``load_digits()``) of the training samples."""
        self.setup()
        assert self._train_idx is not None
        return self._train_idx

    @property
    def val_indices(self) -> Tensor:
        """Sorted indices (into ``load_digits()``) of the validation samples."""
        self.setup()
        assert self._val_idx is not None
        return self._val_idx


class DigitsMLP(ClassifierModule):
    """ReLU MLP classifier for the 64-pixel digits (64 -> hidden -> ... -> 10).

    With the defaults (one hidden layer of 128 units, Adam at 3e-3) it has
    9,610 parameters and passes 90% validation accuracy within a few epochs.
    """

    def __init__(
        self,
        hidden: int = 128,
        depth: int = 2,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        optimizer: str = "adam",
    ) -> None:
        """
        Args:
            hidden: width of each hidden layer (>= 1).
            depth: number of Linear layers (>= 1); ``depth - 1`` hidden layers.
            lr: learning rate (> 0).
            weight_decay: L2 penalty passed to the optimizer (>= 0).
            optimizer: ``"adam"``, ``"sgd"`` (momentum 0.9), ``"lamb"`` or ``"lars"``
                (see :func:`~lightning_sync.models._common.build_optimizer`).
        """
        super().__init__(
            net=make_mlp(DIGITS_NUM_FEATURES, hidden, depth, DIGITS_NUM_CLASSES),
            num_classes=DIGITS_NUM_CLASSES,
            lr=lr,
            optimizer=optimizer,
            weight_decay=weight_decay,
        )
        self.save_hyperparameters()
