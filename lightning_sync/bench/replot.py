"""Redraw a finished bench run's figures from the files it wrote, running nothing (seconds, not the run's minutes).

The report's figures come from ``raw.json`` with the config its recorded command composes; the cost model's
validation and projection from ``report.json`` as the run computed them, so the figures show the published
numbers even where the model's code has changed since; the trade-off's from ``tradeoff.json``; a calibration's
``fit.png`` from ``cost_params.json``::

    python -m lightning_sync.bench.replot outputs/bench/2026-11-24/04-44-00 [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from lightning_sync.bench.cost_report import Validation, plot_fit
from lightning_sync.bench.model import CostParams, Link, Projection, SweepPoint
from lightning_sync.bench.plots import write_plots
from lightning_sync.bench.report import Report, measurements
from lightning_sync.bench.tradeoff import BYTES_LOSS, TradeoffResult, plot_bytes_loss, plot_tradeoff

__all__ = ["main", "recorded_params", "replot", "run_config"]


def run_config(command: str, overrides: list[str] | None = None) -> Any:
    """The bench config a recorded command line (``lightning-sync bench k=v ...``) ran with, plus ``overrides``;
    Hydra's own settings (``hydra.*``, flags) are left out: they do not change a figure."""
    from hydra import compose, initialize_config_dir

    from lightning_sync._config import config_dir

    words = shlex.split(command)
    args = words[words.index("bench") + 1 :] if "bench" in words else []
    keep = [a for a in args if "=" in a and not a.lstrip("+~").startswith("hydra.")]
    with initialize_config_dir(config_dir(), version_base="1.3"):
        return compose("bench", [*keep, *(overrides or [])])


def recorded_params(raw: dict[str, Any], report: dict[str, Any]) -> CostParams | None:
    """The cost model's parameters a run recorded: ``raw.json``'s, else ``report.json``'s, else an older
    ``report.json``'s pooled links with their points under ``fits``; None for a run without the cost model."""
    if body := raw.get("params") or report.get("params"):
        return CostParams.from_json(body, "recorded")
    fits = report.get("fits") or {}
    if not any("points" in f for f in fits.values()):
        return None
    source = f"recorded by the run of {report.get('meta', {}).get('date', 'an unknown date')}"
    links = {op: Link(f["alpha_s"], f["beta_s_per_byte"], source) for op, f in fits.items()}
    fields = ("algorithm", "world", "bytes", "seconds", "median_seconds", "rank_seconds")
    points = [SweepPoint(**{k: p[k] for k in fields if k in p}) for f in fits.values() for p in f.get("points", [])]
    return CostParams(links, {}, points, source)


def _read(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def replot(run_dir: Path, out_dir: Path | None = None, overrides: list[str] | None = None) -> list[Path]:
    """Every figure the files in ``run_dir`` allow, written into ``out_dir`` (default ``run_dir``); the paths."""
    out_dir = out_dir or run_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    raw, recorded = _read(run_dir / "raw.json") or {}, _read(run_dir / "report.json") or {}
    params = recorded_params(raw, recorded)
    if raw:
        (results, single), meta = measurements(raw), raw.get("meta", {})
        report = Report(results, single, run_config(str(meta.get("command", "")), overrides), meta, params)
        validation = [Validation(**v) for v in recorded.get("validation", [])] or None
        projected = [Projection(**p) for p in recorded.get("projection", [])] or None
        written += [name for name, figs in write_plots(report, out_dir, validation, projected).items() if figs]
    elif (stored := _read(run_dir / "cost_params.json")) is not None:
        plot_fit(CostParams.from_json(stored, "cost_params.json"), out_dir / "fit.png")
        written.append("fit.png")
    if (trade := _read(run_dir / "tradeoff.json")) is not None:
        results = [TradeoffResult(**r) for r in trade]
        plot_tradeoff(results, out_dir / "tradeoff.png")
        plot_bytes_loss(results, out_dir / BYTES_LOSS)
        written += ["tradeoff.png", BYTES_LOSS]
    return [out_dir / name for name in written]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="a bench run's output directory (raw.json, tradeoff.json, ...)")
    parser.add_argument("--out", type=Path, default=None, help="where to write the figures (default: run_dir)")
    parser.add_argument("overrides", nargs="*", help="config overrides on top of the recorded command's")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        parser.error(f"run_dir must be a directory, got {str(args.run_dir)!r}")
    if not (paths := replot(args.run_dir, args.out, args.overrides)):
        parser.error(f"{args.run_dir} has none of raw.json, tradeoff.json, cost_params.json")
    print("\n".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
