"""Diagnostics callbacks (issue 7 grows this package): straggler injection and detection, the startup
consistency check, and skipping non-finite steps."""

from lightning_sync.diagnostics.consistency import ConsistencyCheck
from lightning_sync.diagnostics.nonfinite import NonFiniteGuard
from lightning_sync.diagnostics.slow_rank import SlowRank
from lightning_sync.diagnostics.straggler import StragglerDetector

__all__ = ["ConsistencyCheck", "NonFiniteGuard", "SlowRank", "StragglerDetector"]
