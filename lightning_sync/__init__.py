"""lightning_sync: PyTorch Lightning strategies with every collective written out.

Importing the package registers its strategy names with Lightning's ``StrategyRegistry``
(``Trainer(strategy="bucketed_ddp")``, ``"zero1"``, ``"zero2"``, ``"zero3"``, ``"local_sgd"``, ``"diloco"``, ``"async_ps"``, ``"hogwild"``).
"""

from lightning_sync import comms
from lightning_sync.strategies import (
    AsyncParameterServerStrategy,
    BucketedDDPStrategy,
    DiLoCoStrategy,
    HogwildStrategy,
    LocalSGDStrategy,
    ShardedStrategy,
)

__all__ = [
    "AsyncParameterServerStrategy",
    "BucketedDDPStrategy",
    "DiLoCoStrategy",
    "HogwildStrategy",
    "LocalSGDStrategy",
    "ShardedStrategy",
    "comms",
]
__version__ = "0.1.0"
