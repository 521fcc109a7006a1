"""The optional dependencies, each installed by an extra of the package.

A missing one fails at once, naming the ``pip install`` that brings it: the commands check before they import
their heavy parts (Lightning takes seconds to import), and the library checks again where the module is used.
Lightning-free on purpose.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["require", "require_optimizer"]

#: optimizers that come from pytorch-optimizer (the ``optim`` extra); the others are torch's own
EXTRA_OPTIMIZERS = ("lamb", "lars")


def require(module: str, extra: str, why: str) -> ModuleType:
    """``module`` imported, or an ``ImportError`` saying ``why`` it is needed and which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f'{why}, which is not installed: pip install "lightning-sync[{extra}]"') from err


def require_optimizer(name: Any) -> ModuleType | None:
    """The ``pytorch_optimizer`` module for ``"lamb"`` / ``"lars"`` (None for torch's own optimizers), or an
    ``ImportError`` naming the package and the extra to install."""
    if name not in EXTRA_OPTIMIZERS:
        return None
    return require("pytorch_optimizer", "optim", f"optimizer={name!r} needs the pytorch-optimizer package")
