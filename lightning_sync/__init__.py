"""lightning_sync: PyTorch Lightning strategies with every collective written out.

Importing the package is cheap and imports no Lightning: the strategies load on first use
(``from lightning_sync import ShardedStrategy``), so :mod:`lightning_sync.comms` and :mod:`lightning_sync.sync`
stay usable without Lightning. The strategy names still reach Lightning's ``StrategyRegistry``
(``Trainer(strategy="bucketed_ddp")``, ``"zero1"``, ``"zero2"``, ``"zero3"``, ``"local_sgd"``, ``"diloco"``,
``"async_ps"``, ``"hogwild"``) once both this package and Lightning are imported, in either order
(:mod:`lightning_sync._registration`).

``consolidate_checkpoint(directory)`` turns a ZeRO sharded checkpoint directory into a plain full ``state_dict``
in one process (``lightning-sync consolidate`` writes it as a Lightning checkpoint file); it needs no Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_sync._registration import register_when_lightning_loads

if TYPE_CHECKING:
    from lightning_sync import comms
    from lightning_sync.strategies import (
        AsyncParameterServerStrategy,
        BucketedDDPStrategy,
        DiLoCoStrategy,
        HogwildStrategy,
        LocalSGDStrategy,
        ShardedStrategy,
    )
    from lightning_sync.sync.zero.consolidate import consolidate_checkpoint

__all__ = [
    "AsyncParameterServerStrategy",
    "BucketedDDPStrategy",
    "DiLoCoStrategy",
    "HogwildStrategy",
    "LocalSGDStrategy",
    "ShardedStrategy",
    "comms",
    "consolidate_checkpoint",
]
__version__ = "0.1.0"

# each public name, and the module it is imported from on first access (PEP 562)
_LAZY = {name: "lightning_sync.strategies" for name in __all__ if name.endswith("Strategy")}
_LAZY["consolidate_checkpoint"] = "lightning_sync.sync.zero.consolidate"
_SUBMODULES = {"comms"}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value: Any = importlib.import_module(f"{__name__}.{name}")
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


register_when_lightning_loads()
