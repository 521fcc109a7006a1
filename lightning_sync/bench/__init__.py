"""Benchmarks: strategies side by side in one run, A/B alternated, medians and ratios, report + plots."""

from lightning_sync.bench.app import run_bench
from lightning_sync.bench.model import CostParams, load_params
from lightning_sync.bench.report import Report
from lightning_sync.bench.rows import Measurement, Row, schedule
from lightning_sync.bench.runner import Trial, stats_of

__all__ = ["CostParams", "Measurement", "Report", "Row", "Trial", "load_params", "run_bench", "schedule", "stats_of"]
