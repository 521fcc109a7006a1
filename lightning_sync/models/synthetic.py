"""Synthetic teacher-labelled data and two MLPs of contrasting shape for strategy benchmarks.

:class:`WideMLP` has many parameters in few layers (large gradients to
communicate per unit of sequential work); :class:`DeepMLP` has a quarter of
the parameters spread over many narrow layers (more, smaller layers to run and
synchronise one after another).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_sync.models._common import (
    ClassifierModule,
    TensorDataModule,
    check_int,
    check_num_classes,
    check_positive_int,
    make_mlp,
)

__all__ = ["DeepMLP", "SyntheticDataModule", "WideMLP"]


class SyntheticDataModule(TensorDataModule):
    """LightningDataModule of Gaussian inputs labelled by a fixed random linear teacher.

    Inputs are i.i.d. standard normal; the label of ``x`` is
    ``argmax(x @ W)`` for a random ``(in_features, num_classes)`` matrix ``W``,
    so the task is learnable. Everything is drawn from a generator seeded with
    ``seed``, so every rank builds identical data.
    """

    def __init__(
        self,
        num_samples: int = 4096,
        in_features: int = 1024,
        num_classes: int = 10,
        batch_size: int = 32,
        seed: int = 0,
        val_samples: int = 512,
    ) -> None:
        """
        Args:
            num_samples: number of training samples (>= 1).
            in_features: length of each input vector (>= 1).
            num_classes: number of classes (>= 2).
            batch_size: per-process batch size (>= 1).
            seed: seed of the generator that draws teacher, inputs and labels.
            val_samples: number of validation samples (>= 1).
        """
        super().__init__(in_features, num_classes, batch_size, num_workers=0)
        self._num_samples = check_positive_int("num_samples", num_samples)
        self._val_samples = check_positive_int("val_samples", val_samples)
        self._seed = check_int("seed", seed)
        self.save_hyperparameters()

    def _build(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        generator = torch.Generator().manual_seed(self._seed)
        teacher = torch.randn(self.num_features, self.num_classes, generator=generator)
        total = self._num_samples + self._val_samples
        x = torch.randn(total, self.num_features, generator=generator)
        y = (x @ teacher).argmax(dim=1)
        n = self._num_samples
        return x[:n], y[:n], x[n:], y[n:]


class WideMLP(ClassifierModule):
    """Wide expand-contract MLP: ``in -> hidden -> in -> num_classes`` with ReLUs, trained with SGD by default.

    With the defaults (1024 -> 4096 -> 1024 -> 10) it has exactly 8,403,978
    parameters in three Linear layers: lots of gradient to synchronise for
    little sequential compute per sample.
    """

    def __init__(
        self,
        in_features: int = 1024,
        hidden: int = 4096,
        num_classes: int = 10,
        lr: float = 0.01,
        optimizer: str = "sgd",
    ) -> None:
        """
        Args:
            in_features: input width, also the width of the contracting layer (>= 1).
            hidden: width of the expanded hidden layer (>= 1).
            num_classes: number of classes (>= 2).
            lr: learning rate (> 0).
            optimizer: ``"sgd"`` (momentum 0.9, the default), ``"adam"``, ``"lamb"`` or ``"lars"``
                (see :func:`~lightning_sync.models._common.build_optimizer`).
        """
        check_positive_int("in_features", in_features)
        check_positive_int("hidden", hidden)
        net = nn.Sequential(
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, in_features),
            nn.ReLU(),
            nn.Linear(in_features, check_num_classes(num_classes)),
        )
        super().__init__(net=net, num_classes=num_classes, lr=lr, optimizer=optimizer)
        self.save_hyperparameters()


class DeepMLP(ClassifierModule):
    """Deep narrow ReLU MLP with ``depth`` Linear layers of width ``hidden``, trained with SGD by default.

    With the defaults (1024 -> 512 x 7 -> 10, i.e. 8 Linear layers) it has
    exactly 2,105,866 parameters: many small layers run one after another.
    """

    def __init__(
        self,
        in_features: int = 1024,
        hidden: int = 512,
        depth: int = 8,
        num_classes: int = 10,
        lr: float = 0.01,
        optimizer: str = "sgd",
    ) -> None:
        """
        Args:
            in_features: input width (>= 1).
            hidden: width of every hidden layer (>= 1).
            depth: number of Linear layers (>= 1); ``depth - 1`` hidden layers.
            num_classes: number of classes (>= 2).
            lr: learning rate (> 0).
            optimizer: ``"sgd"`` (momentum 0.9, the default), ``"adam"``, ``"lamb"`` or ``"lars"``
                (see :func:`~lightning_sync.models._common.build_optimizer`).
        """
        net = make_mlp(in_features, hidden, depth, check_num_classes(num_classes))
        super().__init__(net=net, num_classes=num_classes, lr=lr, optimizer=optimizer)
        self.save_hyperparameters()
