"""Lightning's ``StrategyRegistry`` learns lightning_sync's strategy names when ``lightning_sync`` is imported,
without that import importing Lightning or the strategies.

``import lightning_sync`` (and so ``import lightning_sync.comms``) must stay free of Lightning, yet
``import lightning_sync`` followed by ``Trainer(strategy="zero3")`` must work, whichever of Lightning and
lightning_sync is imported first. So each name is registered as a placeholder that imports
:mod:`lightning_sync.strategies` the first time a Trainer asks for it; that import registers the real classes
over the placeholders. The placeholders go in as soon as Lightning is loaded: at once if it already is, else
right after the ``lightning`` package finishes importing (a one-shot import hook, removed once it fired).

Nothing here imports Lightning or the strategies at module level: the strategies would import Lightning, and
importing them while some other lightning_sync module is half-imported (the one whose import pulled Lightning
in) could meet that module half-initialized.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["STRATEGY_NAMES", "register_when_lightning_loads"]

#: Every name the strategies register (``register_strategies``), with its registry description.
#: tests/unit/test_import_boundaries.py checks this against what the classes register.
STRATEGY_NAMES: dict[str, str] = {
    "bucketed_ddp": "BucketedDDPStrategy: bucketed gradient all-reduce overlapped with backward (lightning_sync)",
    "bucketed_ddp_spawn": "BucketedDDPStrategy with multiprocessing spawn (lightning_sync)",
    "zero1": "ShardedStrategy stage 1: optimizer state sharded (lightning_sync)",
    "zero2": "ShardedStrategy stage 2: + gradients sharded (lightning_sync)",
    "zero3": "ShardedStrategy stage 3: + parameters sharded (lightning_sync)",
    "local_sgd": "LocalSGDStrategy: periodic parameter averaging (lightning_sync)",
    "diloco": "DiLoCoStrategy: periodic outer Nesterov step on averaged pseudo-gradients (lightning_sync)",
    "async_ps": "AsyncParameterServerStrategy: bounded-staleness parameter server (lightning_sync)",
    "hogwild": "HogwildStrategy: lock-free shared-memory updates on one node (lightning_sync)",
}

_LIGHTNING = "lightning"  # its __init__ imports lightning.pytorch (and the StrategyRegistry) completely
_lock = threading.Lock()


def _placeholder(name: str) -> Callable[..., Any]:
    def build(**init_params: Any) -> Any:
        from lightning.pytorch.strategies import StrategyRegistry

        import lightning_sync.strategies  # noqa: F401 - registers the real classes over the placeholders

        if StrategyRegistry[name]["strategy"] is build:
            raise RuntimeError(f"importing lightning_sync.strategies did not register strategy {name!r}")
        return StrategyRegistry.get(name)

    build.__qualname__ = build.__name__ = f"lightning_sync_{name}"
    return build


def _register_placeholders() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    for name, description in STRATEGY_NAMES.items():
        if name not in StrategyRegistry:  # the real class may be registered already
            StrategyRegistry.register(name, _placeholder(name), description=description)


class _ThenRegister(importlib.abc.Loader):
    """The ``lightning`` package's own loader, then the placeholders."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # the package looks as if imported plainly
        self.loader.exec_module(module)
        _register_placeholders()

    def __getattr__(self, attribute: str) -> Any:  # resource readers and the like: the real loader's
        return getattr(self.loader, attribute)


class _Hook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader that the other finders give for ``lightning``, once."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != _LIGHTNING:
            return None
        _remove_hook()
        spec = None
        for finder in sys.meta_path:  # the finders that would have found it without this hook
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # not installed (the import fails as it would have), or an unusual loader: no hook
        spec.loader = _ThenRegister(spec.loader)
        return spec


def _remove_hook() -> None:
    with _lock:
        sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _Hook)]


def register_when_lightning_loads() -> None:
    """Register the placeholders now if Lightning is loaded, else as soon as it is."""
    strategies = sys.modules.get("lightning.pytorch.strategies")
    if strategies is not None and hasattr(strategies, "StrategyRegistry"):
        _register_placeholders()
    elif _LIGHTNING not in sys.modules:
        with _lock:
            if not any(isinstance(finder, _Hook) for finder in sys.meta_path):
                sys.meta_path.insert(0, _Hook())
    # else lightning is importing right now (it imported lightning_sync): importing lightning_sync.strategies,
    # as anything that uses them does, registers them
