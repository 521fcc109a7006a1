"""Benchmarks: strategies side by side in one run, A/B alternated, medians and ratios, report + plots."""

from lightning_sync.bench.app import run_bench, run_calibration
from lightning_sync.bench.model import CostParams, load_params
from lightning_sync.bench.report import Report
from lightning_sync.bench.rows import Measurement, Row, schedule
from lightning_sync.bench.runner import StepProbe, Trial, run_trials, stats_of

__all__ = [
    "CostParams",
    "Measurement",
    "Report",
    "Row",
    "StepProbe",
    "Trial",
    "load_params",
    "run_bench",
    "run_calibration",
    "run_trials",
    "schedule",
    "stats_of",
]
