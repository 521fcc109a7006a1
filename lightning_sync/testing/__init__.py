"""Multi-process test harness: spawn N gloo ranks with a hard timeout and per-rank tracebacks."""

from lightning_sync.testing.harness import DistributedRankError, DistributedTimeoutError, run_distributed

__all__ = ["DistributedRankError", "DistributedTimeoutError", "run_distributed"]
