"""Diagnostics callbacks: straggler injection and detection, the startup consistency check, skipping non-finite
steps, the replica drift check, the hang watchdog, and the fault injector of the reliability tests."""

from lightning_sync.diagnostics.consistency import ConsistencyCheck
from lightning_sync.diagnostics.drift import ReplicaDriftCheck
from lightning_sync.diagnostics.faults import KillAtStep
from lightning_sync.diagnostics.nonfinite import NonFiniteGuard
from lightning_sync.diagnostics.slow_rank import SlowRank
from lightning_sync.diagnostics.straggler import StragglerDetector
from lightning_sync.diagnostics.watchdog import HangWatchdog

__all__ = [
    "ConsistencyCheck",
    "HangWatchdog",
    "KillAtStep",
    "NonFiniteGuard",
    "ReplicaDriftCheck",
    "SlowRank",
    "StragglerDetector",
]
