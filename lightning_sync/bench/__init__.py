"""Benchmarks: strategies side by side in one run, A/B alternated, medians and ratios, report + plots."""

from lightning_sync.bench.app import run_bench, schedule
from lightning_sync.bench.report import Report
from lightning_sync.bench.runner import StepProbe, Trial, run_trials

__all__ = ["Report", "StepProbe", "Trial", "run_bench", "run_trials", "schedule"]
