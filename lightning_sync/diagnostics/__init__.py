"""Diagnostics callbacks (issue 7 grows this package): straggler injection and detection, and the startup
consistency check."""

from lightning_sync.diagnostics.consistency import ConsistencyCheck
from lightning_sync.diagnostics.slow_rank import SlowRank
from lightning_sync.diagnostics.straggler import StragglerDetector

__all__ = ["ConsistencyCheck", "SlowRank", "StragglerDetector"]
