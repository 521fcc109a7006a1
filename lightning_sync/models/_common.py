"""Shared building blocks for the example models: argument checks, MLPs, loaders.

Everything the digits and synthetic classifiers have in common lives here so
that the model files only describe what is particular to them.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_sync._extras import require_optimizer

__all__ = [
    "OPTIMIZERS",
    "ClassifierModule",
    "SplitDataModule",
    "TensorDataModule",
    "build_optimizer",
    "check_choice",
    "check_fraction",
    "check_int",
    "check_non_negative_float",
    "check_non_negative_int",
    "check_num_classes",
    "check_positive_float",
    "check_positive_int",
    "he_init",
    "make_loader",
    "make_mlp",
    "require_optimizer",
    "seeded_split",
]

#: Optimizer names accepted by :func:`build_optimizer`. ``lamb`` and ``lars`` come from the
#: ``pytorch-optimizer`` package: ``pip install "lightning-sync[optim]"`` (:func:`require_optimizer`).
OPTIMIZERS: tuple[str, ...] = ("adam", "sgd", "lamb", "lars")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_int(name: str, value: object, minimum: int | None = None) -> int:
    """Return ``value`` if it is an int (not a bool) >= ``minimum``, else raise ``ValueError``."""
    if not _is_int(value) or (minimum is not None and value < minimum):  # type: ignore[operator]
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{name} must be an int{bound}, got {value!r}")
    return value  # type: ignore[return-value]


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 1, else raise ``ValueError``."""
    return check_int(name, value, 1)


def check_non_negative_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 0, else raise ``ValueError``."""
    return check_int(name, value, 0)


def check_num_classes(value: object) -> int:
    """Return ``value`` if it is a valid class count (an int >= 2), else raise ``ValueError``."""
    return check_int("num_classes", value, 2)


def check_positive_float(name: str, value: object) -> float:
    """Return ``value`` as float if it is a finite number > 0, else raise ``ValueError``."""
    if not _is_real(value) or value <= 0:  # type: ignore[operator]
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def check_non_negative_float(name: str, value: object) -> float:
    """Return ``value`` as float if it is a finite number >= 0, else raise ``ValueError``."""
    if not _is_real(value) or value < 0:  # type: ignore[operator]
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def check_fraction(name: str, value: object, *, allow_zero: bool = False) -> float:
    """Return ``value`` as float if it lies in (0, 1) (or [0, 1) with ``allow_zero``)."""
    too_low = _is_real(value) and (value < 0 or (value == 0 and not allow_zero))  # type: ignore[operator]
    if not _is_real(value) or too_low or value >= 1:  # type: ignore[operator]
        interval = "[0, 1)" if allow_zero else "(0, 1)"
        raise ValueError(f"{name} must be a number in {interval}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise ``ValueError``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value  # type: ignore[return-value]


def seeded_split(n: int, val_fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """Split ``range(n)`` into sorted (train, val) index tensors with a seeded permutation.

    The result depends only on the arguments, so every DDP rank computes the
    same split. The validation part holds ``round(n * val_fraction)`` indices
    (at least one, and at least one index is left for training).
    """
    check_positive_int("n", n)
    if n < 2:
        raise ValueError(f"n must be >= 2 to split into train and val, got {n!r}")
    check_fraction("val_fraction", val_fraction)
    n_val = min(max(1, round(n * val_fraction)), n - 1)
    generator = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=generator)
    return perm[n_val:].sort().values, perm[:n_val].sort().values


def make_mlp(in_features: int, hidden: int, depth: int, out_features: int) -> nn.Sequential:
    """Build a ReLU MLP of ``depth`` Linear layers (``depth - 1`` hidden ones of width ``hidden``).

    ``depth == 1`` gives a single linear map and ignores ``hidden``. Layers
    followed by a ReLU get He init (see :func:`he_init`) so deep stacks train.
    """
    check_positive_int("in_features", in_features)
    check_positive_int("hidden", hidden)
    check_positive_int("depth", depth)
    check_positive_int("out_features", out_features)
    widths = [in_features] + [hidden] * (depth - 1) + [out_features]
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        if i > 0:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(fan_in, fan_out))
    for layer in layers[:-1]:
        if isinstance(layer, nn.Linear):
            he_init(layer)
    return nn.Sequential(*layers)


def he_init(layer: nn.Linear) -> nn.Linear:
    """Give a ReLU-followed Linear layer He (Kaiming) normal weights and zero bias.

    PyTorch's default init shrinks activations layer after layer, which stalls
    SGD in deep ReLU stacks; He init keeps their scale.
    """
    nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
    nn.init.zeros_(layer.bias)
    return layer


def build_optimizer(
    params: Iterable[nn.Parameter], name: str, lr: float, weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    """Create the optimizer called ``name`` (one of :data:`OPTIMIZERS`); SGD uses momentum 0.9.

    ``params`` may also be param-group dicts (a group's own ``weight_decay`` wins). The large-batch,
    layer-wise adaptive optimizers come from ``pytorch-optimizer`` (the ``optim`` extra), with its
    defaults otherwise: ``"lamb"`` is LAMB (You et al., 2019; Adam moments, per-tensor trust ratio,
    decoupled weight decay), ``"lars"`` is LARS (You et al., 2017; momentum 0.9, trust coefficient
    1e-3 on tensors of 2 or more dims, plain momentum SGD on biases and other vectors).
    """
    check_choice("optimizer", name, OPTIMIZERS)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    pytorch_optimizer = require_optimizer(name)
    if name == "lamb":
        return pytorch_optimizer.Lamb(params, lr=lr, weight_decay=weight_decay)
    return pytorch_optimizer.LARS(params, lr=lr, momentum=0.9, weight_decay=weight_decay)


def make_loader(dataset: Dataset, batch_size: int, shuffle: bool, num_workers: int) -> DataLoader:
    """Wrap ``dataset`` in a DataLoader (persistent workers when ``num_workers > 0``)."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
    )


class ClassifierModule(pl.LightningModule):
    """LightningModule base for feed-forward classifiers over ``(x, y)`` batches.

    It logs ``train_loss`` (progress bar), and ``val_loss`` and ``val_acc`` as torchmetrics (``MeanMetric``
    weighted by batch size and ``MulticlassAccuracy``), which sync their sums and counts across ranks: the
    values over the whole validation set, however the ranks' shares differ in size.
    Subclasses only build the network and call :meth:`save_hyperparameters`.
    """

    def __init__(
        self,
        net: nn.Module,
        num_classes: int,
        lr: float,
        optimizer: str = "sgd",
        weight_decay: float = 0.0,
    ) -> None:
        """
        Args:
            net: module mapping a ``(batch, features)`` tensor to ``(batch, num_classes)`` logits.
            num_classes: number of target classes (>= 2).
            lr: learning rate (> 0).
            optimizer: one of :data:`OPTIMIZERS` (see :func:`build_optimizer`).
            weight_decay: L2 penalty passed to the optimizer (>= 0).
        """
        super().__init__()
        check_num_classes(num_classes)
        self._lr = check_positive_float("lr", lr)
        self._optimizer_name = check_choice("optimizer", optimizer, OPTIMIZERS)
        require_optimizer(self._optimizer_name)  # a missing extra fails here, before any rank starts
        self._weight_decay = check_non_negative_float("weight_decay", weight_decay)
        self.net = net
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_loss = MeanMetric()

    def forward(self, x: Tensor) -> Tensor:
        """Return class logits for a batch of flat feature vectors."""
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.val_acc.update(logits, y)
        self.val_loss.update(loss, weight=len(y))  # synced as (weighted sum, weight): the mean over every sample
        self.log("val_loss", self.val_loss, on_epoch=True)
        self.log("val_acc", self.val_acc, prog_bar=True, on_epoch=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return build_optimizer(self.parameters(), self._optimizer_name, self._lr, self._weight_decay)


class SplitDataModule(pl.LightningDataModule, metaclass=abc.ABCMeta):
    """LightningDataModule base for a fixed train/val pair of map-style datasets.

    Subclasses implement :meth:`_build_datasets`, which must be deterministic
    so that every rank sees the same data; it runs once, on the first
    :meth:`setup` (or the first access to a dataset). The training loader
    shuffles (Lightning swaps in a ``DistributedSampler`` under DDP); the
    validation loader does not.
    """

    def __init__(self, batch_size: int, num_workers: int) -> None:
        """
        Args:
            batch_size: per-process batch size (>= 1).
            num_workers: DataLoader worker processes (>= 0).
        """
        super().__init__()
        self._batch_size = check_positive_int("batch_size", batch_size)
        self._num_workers = check_non_negative_int("num_workers", num_workers)
        self._datasets: tuple[Dataset, Dataset] | None = None

    @property
    def batch_size(self) -> int:
        """Per-process batch size."""
        return self._batch_size

    @abc.abstractmethod
    def _build_datasets(self) -> tuple[Dataset, Dataset]:
        """Return the ``(train, val)`` datasets (each concrete data module defines it)."""

    def setup(self, stage: str | None = None) -> None:
        if self._datasets is None:
            self._datasets = self._build_datasets()

    def _built(self) -> tuple[Dataset, Dataset]:
        self.setup()
        assert self._datasets is not None
        return self._datasets

    @property
    def train_dataset(self) -> Dataset:
        """The training dataset (built on first access)."""
        return self._built()[0]

    @property
    def val_dataset(self) -> Dataset:
        """The validation dataset (built on first access)."""
        return self._built()[1]

    def train_dataloader(self) -> DataLoader:
        return make_loader(self.train_dataset, self._batch_size, True, self._num_workers)

    def val_dataloader(self) -> DataLoader:
        return make_loader(self.val_dataset, self._batch_size, False, self._num_workers)


class TensorDataModule(SplitDataModule):
    """:class:`SplitDataModule` over in-memory ``(x, y)`` classification tensors.

    Subclasses implement :meth:`_build`, returning ``(x_train, y_train, x_val, y_val)``.
    """

    def __init__(self, num_features: int, num_classes: int, batch_size: int, num_workers: int) -> None:
        """
        Args:
            num_features: length of each input feature vector (>= 1).
            num_classes: number of target classes (>= 2).
            batch_size: per-process batch size (>= 1).
            num_workers: DataLoader worker processes (>= 0).
        """
        super().__init__(batch_size, num_workers)
        self._num_features = check_positive_int("num_features", num_features)
        self._num_classes = check_num_classes(num_classes)

    @property
    def num_features(self) -> int:
        """Length of each input feature vector."""
        return self._num_features

    @property
    def num_classes(self) -> int:
        """Number of target classes."""
        return self._num_classes

    @abc.abstractmethod
    def _build(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Return ``(x_train, y_train, x_val, y_val)`` (each concrete data module defines it)."""

    def _build_datasets(self) -> tuple[Dataset, Dataset]:
        x_train, y_train, x_val, y_val = self._build()
        return TensorDataset(x_train, y_train), TensorDataset(x_val, y_val)
