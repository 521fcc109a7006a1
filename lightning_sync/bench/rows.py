"""The bench's typed rows, the schedule and the helpers every runner and report shares; it imports nothing else
of the bench, so they all use it without importing each other."""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_sync._extras import require

__all__ = ["FIT", "QUIET", "Measurement", "Row", "counts_cli", "fmt", "median", "node", "pyplot", "schedule"]
__all__ += ["spread", "strategy_class"]

_NAN = math.nan
#: Trainer arguments of a bench fit: nothing logged, saved or shown; ``FIT``: a step budget, no validation.
QUIET = dict.fromkeys(("logger", "enable_checkpointing", "enable_progress_bar", "enable_model_summary"), False)
FIT = {**QUIET, "max_epochs": -1, "limit_val_batches": 0, "num_sanity_val_steps": 0}


def median(xs: list[float]) -> float:
    """The median, NaN for no values (a figure that was not measured)."""
    return statistics.median(xs) if xs else _NAN


def spread(values: list[float]) -> tuple[float, float, float]:
    """``(median, min, max)`` of a figure measured in alternating rounds."""
    return statistics.median(values), min(values), max(values)


def fmt(x: float, spec: str) -> str:
    """``x`` formatted by ``spec``, ``n/a`` for NaN."""
    return "n/a" if math.isnan(x) else format(x, spec)


def node(cfg: Any) -> dict[str, Any]:
    """A config node as a plain dict (a Hydra node for ``instantiate``, picklable into the ranks)."""
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


def schedule(names: list[str], pairs: int) -> list[str]:
    """Round-robin over ``pairs`` rounds, reversed every other (A B C, C B A): slow drifts hit every row alike."""
    if pairs < 1:
        raise ValueError(f"pairs must be >= 1, got {pairs!r}")
    return [n for p in range(pairs) for n in (names if p % 2 == 0 else names[::-1])]


@dataclass
class Measurement:
    """One trial on one rank (:mod:`lightning_sync.bench.runner` defines the figures): lists per timed step, and
    per step averaged over the timed steps ``bytes_per_step`` and the ``op_*_per_step`` maps."""

    name: str
    model: str
    world: int = 1
    step_s: list[float] = field(default_factory=list)
    bytes_per_step: float = 0.0
    op_bytes_per_step: dict[str, float] = field(default_factory=dict)
    op_calls_per_step: dict[str, float] = field(default_factory=dict)
    op_seconds_per_step: dict[str, float] = field(default_factory=dict)
    comm_calls: int = 0  # collectives through ``comms`` in the timed steps (0: the strategy bypasses it)
    step_calls: list[int] = field(default_factory=list)
    exposed_s: list[float] = field(default_factory=list)
    codec_s: list[float] = field(default_factory=list)
    covered_s: list[float] = field(default_factory=list)
    blocked_s: list[float] = field(default_factory=list)
    comm_s: float | None = None  # the strategy's buckets all-reduced alone, without compute (bucketed only)
    param_bytes: int = 0
    n_linear: int = 0
    strategy: dict[str, Any] = field(default_factory=dict)
    peak_mib: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    rank: int = 0
    trial: int = 0
    wire_bytes: float = _NAN  # ring-model wire bytes per step, the largest over ranks (set by the report)


@dataclass
class Row:
    """One strategy on one model at one world size, aggregated over its trials (medians; ratios are same-pair,
    :class:`lightning_sync.bench.report.Report`); times in ms, bytes in MiB per step and rank."""

    model: str
    strategy: str
    world: int
    step_ms: float = _NAN
    ratio: float = _NAN  # same-pair step-time ratio to the baseline
    ratio_ref: float = _NAN  # and to ``sharding_table.reference``
    bytes_mib: float = 0.0
    x_grad: float = _NAN
    measured: bool = True  # the traffic went through ``comms`` (else wire bytes are n/a, the cost model's analytic)
    wire_measured_mib: float = _NAN
    wire_analytic_mib: float = _NAN
    wire_x_analytic: float = _NAN
    exposed_ms: float = _NAN
    exposed_share: float = _NAN
    comm_ms: float = _NAN
    covered_ms: float = _NAN
    covered_na: bool = False
    codec_ms: float = 0.0
    peak_mib: float = _NAN
    scaling: float = _NAN
    pairs: int = 0
    sync_every: int = 1
    param_bytes: float = 0.0
    n_linear: int = 0
    op_bytes_per_step: dict[str, float] = field(default_factory=dict)
    op_calls_per_step: dict[str, float] = field(default_factory=dict)
    strategy_node: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def strategy_class(strategy: dict[str, Any]) -> str:
    """The class name a strategy node's ``_target_`` builds (``""`` for the single-device row)."""
    return str(strategy.get("_target_") or "").rpartition(".")[2]


def require_plots(cfg: DictConfig) -> None:
    """Fail now, naming the extra, if the run will plot (a calibration, strategy rows, a bucket sweep, the
    trade-off, the goodput runs, the streaming table) and matplotlib is missing: before the runners' Lightning
    import (seconds) and any trial."""
    mode = str(cfg.get("mode", "run"))
    plotted = (
        cfg.run_models,
        cfg.bucket_sweep.enabled,
        cfg.tradeoff.enabled,
        (cfg.get("goodput") or {}).get("enabled"),
        (cfg.get("streaming") or {}).get("enabled"),
    )
    if mode == "calibrate" or any(bool(p) for p in plotted):
        pyplot()


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only); matplotlib is the bench extra."""
    matplotlib = require("matplotlib", "bench", "lightning-sync bench draws its plots with matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def counts_cli(
    doc: str, argv: list[str] | None, check: Callable[[Any], str | None] = lambda _: None, **options: tuple[int, str]
) -> argparse.Namespace:
    """A micro-benchmark's command line, described by ``doc``'s first line: per ``name=(default, help)`` a whole
    number ``--name`` >= 1; ``check`` says what is wrong with the parsed whole, if anything."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    for name, (value, text) in options.items():
        parser.add_argument(f"--{name}".replace("_", "-"), type=int, default=value, help=f"{text} (default {value})")
    args = parser.parse_args(argv)
    small = [f"--{n} must be >= 1, got {getattr(args, n)}".replace("_", "-") for n in options if getattr(args, n) < 1]
    if wrong := next(iter(small), None) or check(args):
        parser.error(wrong)
    return args
