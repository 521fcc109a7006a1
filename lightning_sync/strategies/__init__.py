"""Lightning adapters, one strategy class a file; importing this registers their names."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_sync.strategies.bucketed_ddp import BucketedDDPStrategy
from lightning_sync.strategies.sharded import ShardedStrategy

__all__ = ["BucketedDDPStrategy", "ShardedStrategy"]

BucketedDDPStrategy.register_strategies(StrategyRegistry)
ShardedStrategy.register_strategies(StrategyRegistry)
