"""Lightning adapters, one strategy class a file; importing this registers their names."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_sync.strategies.async_ps import AsyncParameterServerStrategy
from lightning_sync.strategies.bucketed_ddp import BucketedDDPStrategy
from lightning_sync.strategies.diloco import DiLoCoStrategy
from lightning_sync.strategies.hogwild import HogwildStrategy
from lightning_sync.strategies.local_sgd import LocalSGDStrategy
from lightning_sync.strategies.sharded import ShardedStrategy

__all__ = [
    "AsyncParameterServerStrategy",
    "BucketedDDPStrategy",
    "DiLoCoStrategy",
    "HogwildStrategy",
    "LocalSGDStrategy",
    "ShardedStrategy",
]

BucketedDDPStrategy.register_strategies(StrategyRegistry)
ShardedStrategy.register_strategies(StrategyRegistry)
LocalSGDStrategy.register_strategies(StrategyRegistry)
DiLoCoStrategy.register_strategies(StrategyRegistry)
AsyncParameterServerStrategy.register_strategies(StrategyRegistry)
HogwildStrategy.register_strategies(StrategyRegistry)
