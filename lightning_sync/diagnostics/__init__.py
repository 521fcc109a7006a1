"""Diagnostics callbacks (issue 7 grows this package): straggler injection for now."""

from lightning_sync.diagnostics.slow_rank import SlowRank

__all__ = ["SlowRank"]
