"""Lightning adapters, one strategy class a file; importing this registers their names."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_sync.strategies.bucketed_ddp import BucketedDDPStrategy

__all__ = ["BucketedDDPStrategy"]

BucketedDDPStrategy.register_strategies(StrategyRegistry)
