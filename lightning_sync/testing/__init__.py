"""Multi-process test support: spawn N gloo ranks with a hard timeout and per-rank tracebacks
(:mod:`~lightning_sync.testing.harness`), and non-raising checks to run inside the ranks
(:mod:`~lightning_sync.testing.checks`)."""

from lightning_sync.testing.checks import (
    REDUCE_OPS,
    Checks,
    assert_all_ranks_passed,
    exact_input,
    mismatch,
    reduce_reference,
)
from lightning_sync.testing.harness import DistributedRankError, DistributedTimeoutError, run_distributed

__all__ = [
    "REDUCE_OPS",
    "Checks",
    "DistributedRankError",
    "DistributedTimeoutError",
    "assert_all_ranks_passed",
    "exact_input",
    "mismatch",
    "reduce_reference",
    "run_distributed",
]
