"""``lightning-sync bench``: strategies side by side in one invocation, each of ``pairs`` rounds running every
strategy in the alternating order of :func:`schedule`, one spawned process group per world size.
"""

from __future__ import annotations

import importlib
import logging
import os
import platform
import sys
from datetime import date
from importlib.metadata import version
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig

from lightning_sync._checks import check_choice
from lightning_sync.bench.cost_report import params_markdown, plot_fit
from lightning_sync.bench.model import CostParams, SweepPoint, calibrate, load_params
from lightning_sync.bench.report import Report, save_raw
from lightning_sync.bench.rows import Measurement, node, require_plots, schedule
from lightning_sync.bench.runner import IN_STEP, SINGLE_ROW, Trial, run_trials
from lightning_sync.bench.sweep import sweep_all_reduce, sweep_sizes

__all__ = ["COMPUTE_ROW", "run_bench", "run_calibration", "select_strategies", "world_sizes"]

log = logging.getLogger("lightning_sync.bench")

#: The cost model's compute row at every K (:data:`~lightning_sync.bench.runner.IN_STEP`): the plain model
#: fitted alone on each rank, in step, scheduled among the strategy rows.
COMPUTE_ROW = "compute in step"
Rows = dict[str, tuple[dict[str, Any], dict[str, Any]]]


def _trials(cfg: DictConfig, model: str, rows: Rows, label: str | None = None) -> list[Trial]:
    m, names = cfg.models[model], schedule(list(rows), int(cfg.pairs))
    args = (node(m.model), node(m.data), int(cfg.steps), int(cfg.warmup_steps))
    return [Trial(n, label or model, rows[n][0], *args, rows[n][1]) for n in names]


def with_compute_row(rows: dict[str, Any]) -> dict[str, Any]:
    """``rows`` with :data:`COMPUTE_ROW` in the middle: at either end, where :func:`schedule` turns round, it would
    run twice back to back and two of its samples would see the same minute of the machine's load."""
    items, mid = list(rows.items()), len(rows) // 2
    return dict([*items[:mid], (COMPUTE_ROW, ({"_target_": None}, {IN_STEP: True})), *items[mid:]])


def _bucket_rows(cfg: DictConfig) -> Rows:
    base = node(cfg.strategies[cfg.bucket_sweep.strategy])
    rows = {str(cfg.baseline): (node(cfg.strategies[cfg.baseline]), {})}  # ratios stay same-pair
    for cap in cfg.bucket_sweep.caps_mb:
        label = "one bucket" if float(cap) >= float(cfg.bucket_sweep.one_bucket_mb) else f"cap={cap}"
        rows[label] = ({**base, "bucket_cap_mb": float(cap)}, {"cap_mb": float(cap)})
    return rows


def select_strategies(cfg: DictConfig) -> dict[str, dict[str, Any]]:
    """The ``strategies`` rows to run: all, or ``run_strategies`` plus the baseline, in config order; a row whose
    ``_target_`` does not import raises ``ImportError`` before any rank starts, suggesting a subset."""
    rows = {str(name): node(s) for name, s in cfg.strategies.items()}
    wanted = cfg.get("run_strategies")
    if str(cfg.baseline) not in rows:
        raise ValueError(f"baseline must be one of {list(rows)}, got {cfg.baseline!r}")
    if wanted is not None:
        if unknown := [str(w) for w in wanted if str(w) not in rows]:
            raise ValueError(f"run_strategies must name rows of strategies {list(rows)}, got {unknown!r}")
        keep = {str(w) for w in wanted} | {str(cfg.baseline)}  # ratios need the baseline
        rows = {n: s for n, s in rows.items() if n in keep}
    for name, target in ((n, s.get("_target_")) for n, s in rows.items() if s.get("_target_")):
        try:
            module, _, attr = str(target).rpartition(".")
            getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ImportError(
                f"strategy row {name!r}: cannot import {target!r} ({err}); run the others with "
                f"run_strategies=[{','.join(n for n in rows if n != name)}]"
            ) from err
    return rows


def host_rows(cfg: DictConfig, selected: dict[str, Any]) -> Rows:
    """``cost_model.host_rows`` of the ``selected``, also run at one rank: their step there less T1 is host work."""
    names = [str(n) for n in ((cfg.get("cost_model") or {}).get("host_rows") or [])]
    if unknown := [n for n in names if n not in cfg.strategies]:
        raise ValueError(f"cost_model.host_rows must name rows of strategies {list(cfg.strategies)}, got {unknown!r}")
    return {n: (selected[n], {}) for n in names if n in selected}


def world_sizes(cfg: DictConfig) -> list[int]:
    """The measured world sizes: ``world_sizes`` (a list of ints >= 2), in ascending order without repeats."""
    raw = cfg.get("world_sizes")
    bad = not isinstance(raw, (list, ListConfig)) or not raw
    if bad or any(isinstance(k, bool) or not isinstance(k, int) or k < 2 for k in raw):
        raise ValueError(f"world_sizes must be a non-empty list of ints >= 2, got {raw if bad else list(raw)!r}")
    return sorted(set(int(k) for k in raw))


def _meta(cfg: DictConfig, worlds: list[int]) -> dict[str, Any]:
    """The machine, versions, date and command a report names."""
    meta = dict(date=date.today().isoformat(), cpu=_cpu_model(), cores=os.cpu_count() or 1)
    meta.update(python=platform.python_version(), torch=version("torch"), lightning=version("lightning"))
    meta.update(world_sizes=worlds, threads_per_rank=int(cfg.threads_per_rank))
    return {**meta, "command": " ".join(["lightning-sync", "bench", *sys.argv[1:]])}


def run_bench(cfg: DictConfig, out_dir: Path) -> Report | None:
    """Run the suite (``mode=calibrate``: :func:`run_calibration`) and write its report, plots and ``raw.json`` into
    ``out_dir``: the strategy rows at every world size (with :data:`COMPUTE_ROW` for the cost model and the bucket
    sweep at the smallest), the single-process rows (T1 and :func:`host_rows`), the trade-off, the streaming
    table, the memory table."""
    from lightning_sync.testing import run_distributed

    worlds, threads = world_sizes(cfg), int(cfg.threads_per_rank)
    meta = _meta(cfg, worlds)
    mode = check_choice("mode", str(cfg.get("mode", "run")), ("run", "calibrate"))
    require_plots(cfg)  # matplotlib is an extra: a missing one must fail now, not after minutes of trials
    if mode == "calibrate":
        run_calibration(cfg, out_dir, meta)
        return None
    env, timeout = {"OMP_NUM_THREADS": str(threads), "PL_GLOBAL_SEED": "0"}, float(cfg.timeout_s)
    selected, cost = select_strategies(cfg), cfg.get("cost_model") or {}
    strategies: Rows = {name: (s, {}) for name, s in selected.items()}
    hosts = host_rows(cfg, selected) if cost.get("enabled") else {}
    strategies = with_compute_row(strategies) if cost.get("enabled") else strategies  # compute alone, same rounds
    results: dict[int, list[list[Measurement]]] = {}
    for world in worlds:
        trials = [t for model in cfg.run_models for t in _trials(cfg, model, strategies)]
        if cfg.bucket_sweep.enabled and world == worlds[0]:
            trials += _trials(cfg, (m := cfg.bucket_sweep.model), _bucket_rows(cfg), f"{m} (bucket sweep)")
        if n := len(trials):
            log.info("bench: %d trials on %d ranks (%d pairs, %d timed steps each)", n, world, cfg.pairs, cfg.steps)
            results[world] = run_distributed(run_trials, world, trials, threads, f"K={world}", timeout=timeout, env=env)
    report = None
    if results:
        single: list[Measurement] = []
        scaled = cfg.scaling.models if cfg.scaling.enabled else []
        solo_models = list(dict.fromkeys([*scaled, *(cfg.run_models if cost.get("enabled") else [])]))
        one = {SINGLE_ROW: ({"_target_": None}, {}), **hosts}  # and the cost model's host rows at one rank
        if solo := [t for model in solo_models for t in _trials(cfg, model, one)]:
            log.info("bench: %d single-process trials (T1%s)", len(solo), "".join(f", {n}" for n in hosts))
            single = run_distributed(run_trials, 1, solo, threads, "K=1", timeout=timeout, env=env)[0]
        params = load_params(cost.get("params_file")) if cost.get("enabled") else None
        if params is not None:
            log.info("bench: cost model parameters: %s", params.source)
        report = Report(results, single, cfg, meta, params)
        report.write(out_dir)
        save_raw(out_dir / "raw.json", results, single, params, meta)
    if cfg.tradeoff.enabled:
        from lightning_sync.bench.tradeoff import run_tradeoff

        run_tradeoff(cfg, out_dir, meta)
        if report is not None:  # one report: the trade-off rows go below the strategy rows
            with open(out_dir / "report.md", "a") as f:
                f.write("\n\n" + (out_dir / "tradeoff.md").read_text())
    if (cfg.get("goodput") or {}).get("enabled"):
        from lightning_sync.bench.goodput import run_goodput

        run_goodput(cfg, out_dir, meta)
        if report is not None:
            with open(out_dir / "report.md", "a") as f:
                f.write("\n\n" + (out_dir / "goodput.md").read_text())
    if (cfg.get("stragglers") or {}).get("enabled"):
        from lightning_sync.bench.stragglers import run_stragglers

        run_stragglers(cfg, out_dir, meta)
        if report is not None:
            with open(out_dir / "report.md", "a") as f:
                f.write("\n\n" + (out_dir / "stragglers.md").read_text())
    if (cfg.get("streaming") or {}).get("enabled"):
        from lightning_sync.bench.streaming import run_streaming

        run_streaming(cfg, out_dir, meta)
        if report is not None:
            with open(out_dir / "report.md", "a") as f:
                f.write("\n\n" + (out_dir / "streaming.md").read_text())
    if cfg.memory.enabled:
        from lightning_sync.bench.memory import run_memory

        run_memory(cfg, out_dir, meta)
        if report is not None:
            with open(out_dir / "report.md", "a") as f:
                f.write("\n\n" + (out_dir / "memory.md").read_text())
    return report


def run_calibration(cfg: DictConfig, out_dir: Path, meta: dict[str, Any]) -> CostParams:
    """Sweep, fit and store the cost model's links in ``cost_model.params_file``, a copy and a figure in ``out_dir``."""
    cost = cfg.cost_model
    points = run_sweep(cost, int(cfg.threads_per_rank), float(cfg.timeout_s))
    params = calibrate(points, f"calibrated {meta['date']} on {meta['cpu']} with `{meta['command']}`")
    path = Path(str(cost.params_file))
    params.save(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    params.save(out_dir / "cost_params.json")
    text = "\n".join(params_markdown(params))
    (out_dir / "calibration.md").write_text(text + "\n")
    print(f"{text}\n\nCost-model parameters written to {path.resolve()}")
    plot_fit(params, out_dir / "fit.png")
    return params


def run_sweep(cost: Any, threads: int, timeout: float) -> list[SweepPoint]:
    """The calibration sweep (``cost_model.sweep``) at every world size it names."""
    from lightning_sync.testing import run_distributed

    sweep, env = cost.sweep, {"OMP_NUM_THREADS": str(threads)}
    sizes = sweep_sizes(int(sweep.smallest), int(sweep.largest), int(sweep.factor))
    args = (sizes, [str(a) for a in sweep.algorithms], int(sweep.repeats), threads)
    points: list[SweepPoint] = []
    for world in sweep.worlds:
        log.info("bench: calibration sweep on %d ranks (%d sizes x %s)", world, len(sizes), args[1])
        points += run_distributed(sweep_all_reduce, int(world), *args, timeout=timeout, env=env)[0]
    return points


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
        return f"{name} ({os.cpu_count()} cores)"
    except (OSError, StopIteration):
        return platform.processor() or "unknown"
