"""Diagnostics callbacks (issue 7 grows this package): straggler injection and the startup consistency check."""

from lightning_sync.diagnostics.consistency import ConsistencyCheck
from lightning_sync.diagnostics.slow_rank import SlowRank

__all__ = ["ConsistencyCheck", "SlowRank"]
