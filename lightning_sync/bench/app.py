"""``lightning-sync bench``: strategies side by side, in one invocation, A/B alternated.

The schedule (:func:`schedule`) interleaves every strategy in each of ``pairs`` rounds, reversing
the order every other round (A B C, C B A, ...), so every strategy sees the same machine drift;
``run_strategies=[a,b]`` runs a subset (:func:`select_strategies`; the baseline always runs). All
trials of one world size run inside one spawned process group, one ``Trainer.fit`` each, so start-up
cost is paid once. Scaling efficiency ``T1(b) / TK(b)`` compares one process with per-rank batch b
against K ranks each with batch b. Results go to ``report.md`` and PNG plots in the Hydra output
directory; the table is printed too.
"""

from __future__ import annotations

import importlib
import logging
import os
import platform
import sys
from datetime import date
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_sync.bench.report import Report, save_raw
from lightning_sync.bench.runner import IN_STEP, SINGLE_ROW, Trial, run_trials
from lightning_sync.bench.sweep import sweep_all_reduce, sweep_sizes

__all__ = [
    "COMPUTE_ROW",
    "host_rows",
    "run_bench",
    "run_sweep",
    "schedule",
    "select_strategies",
    "with_compute_row",
    "world_sizes",
]

log = logging.getLogger("lightning_sync.bench")

#: The cost model's compute row at every K (:data:`~lightning_sync.bench.runner.IN_STEP`): the plain model
#: fitted alone on each rank, in step, scheduled among the strategy rows.
COMPUTE_ROW = "compute in step"


def _node(cfg: Any) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


def schedule(names: list[str], pairs: int) -> list[str]:
    """Round-robin order over ``pairs`` rounds, reversed every other round (ABAB... generalized)."""
    if pairs < 1:
        raise ValueError(f"pairs must be >= 1, got {pairs!r}")
    order: list[str] = []
    for p in range(pairs):
        order += names if p % 2 == 0 else list(reversed(names))
    return order


def _trials(
    cfg: DictConfig, model: str, rows: dict[str, tuple[dict[str, Any], dict[str, Any]]], label: str | None = None
) -> list[Trial]:
    m = cfg.models[model]
    out = []
    for name in schedule(list(rows), int(cfg.pairs)):
        strategy, extra = rows[name]
        out.append(
            Trial(
                name=name,
                model=label or model,
                strategy=strategy,
                model_cfg=_node(m.model),
                data_cfg=_node(m.data),
                steps=int(cfg.steps),
                warmup=int(cfg.warmup_steps),
                extra=extra,
            )
        )
    return out


def with_compute_row(rows: dict[str, Any]) -> dict[str, Any]:
    """``rows`` with the cost model's compute row :data:`COMPUTE_ROW` in the middle: :func:`schedule` reverses
    every other round, so a row at either end would run twice back to back (the end of one round, the start
    of the next) and two of its samples would see the same minute of this shared machine's load; in the
    middle its samples lie a round apart, like every strategy's."""
    items = list(rows.items())
    mid = len(items) // 2
    return dict([*items[:mid], (COMPUTE_ROW, ({"_target_": None}, {IN_STEP: True})), *items[mid:]])


def _bucket_rows(cfg: DictConfig) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    base = _node(cfg.strategies[cfg.bucket_sweep.strategy])
    rows = {str(cfg.baseline): (_node(cfg.strategies[cfg.baseline]), {})}  # ratios stay same-pair
    for cap in cfg.bucket_sweep.caps_mb:
        label = "one bucket" if float(cap) >= float(cfg.bucket_sweep.one_bucket_mb) else f"cap={cap}"
        rows[label] = ({**base, "bucket_cap_mb": float(cap)}, {"cap_mb": float(cap)})
    return rows


def select_strategies(cfg: DictConfig) -> dict[str, dict[str, Any]]:
    """The ``strategies`` rows to run: all of them, or ``run_strategies`` plus the baseline, in config order.

    Raises ``ValueError`` for a name that is not a row, and ``ImportError`` (before any rank starts)
    for a row whose ``_target_`` cannot be imported, naming the row and suggesting a subset.
    """
    rows = {str(name): _node(s) for name, s in cfg.strategies.items()}
    wanted = cfg.get("run_strategies")
    if str(cfg.baseline) not in rows:
        raise ValueError(f"baseline must be one of {list(rows)}, got {cfg.baseline!r}")
    if wanted is not None:
        wanted = [str(w) for w in wanted]
        unknown = [w for w in wanted if w not in rows]
        if unknown:
            raise ValueError(f"run_strategies must name rows of strategies {list(rows)}, got {unknown!r}")
        rows = {n: s for n, s in rows.items() if n in wanted or n == str(cfg.baseline)}  # ratios need the baseline
    for name, node in rows.items():
        target = node.get("_target_")
        if target:
            module, _, attr = str(target).rpartition(".")
            try:
                getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as err:
                raise ImportError(
                    f"strategy row {name!r}: cannot import {target!r} ({err}); run the others with "
                    f"run_strategies=[{','.join(n for n in rows if n != name)}]"
                ) from err
    return rows


def host_rows(cfg: DictConfig, selected: dict[str, Any]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """The strategy rows that the cost model also measures at one rank (``cost_model.host_rows``), among
    the ``selected`` ones, for the single-process rounds: their step there less T1 is their host work
    (:class:`~lightning_sync.bench.cost_report.CostModel`).

    Raises ``ValueError`` for a name that is not a row of ``strategies``.
    """
    names = [str(n) for n in ((cfg.get("cost_model") or {}).get("host_rows") or [])]
    unknown = [n for n in names if n not in cfg.strategies]
    if unknown:
        raise ValueError(f"cost_model.host_rows must name rows of strategies {list(cfg.strategies)}, got {unknown!r}")
    return {n: (selected[n], {}) for n in names if n in selected}


def world_sizes(cfg: DictConfig) -> list[int]:
    """The measured world sizes: ``world_sizes`` (a list of ints >= 2), in ascending order without repeats."""
    raw = cfg.get("world_sizes")
    if not isinstance(raw, (list, ListConfig)) or not raw:
        raise ValueError(f"world_sizes must be a non-empty list of ints >= 2, got {raw!r}")
    for k in raw:
        if isinstance(k, bool) or not isinstance(k, int) or k < 2:
            raise ValueError(f"world_sizes must be a non-empty list of ints >= 2, got {list(raw)!r}")
    return sorted(set(int(k) for k in raw))


def run_bench(cfg: DictConfig, out_dir: Path) -> Report | None:
    """Run the configured suite and write the reports into ``out_dir`` (the strategy rows' ``report.md``,
    ``report.json`` and plots, every rank's raw measurements in ``raw.json``, from which
    :func:`~lightning_sync.bench.report.load_raw` rebuilds the same report, and ``tradeoff.md`` when the
    trade-off is enabled); returns the strategy rows' report, if any ran.

    Order: the strategy rows at every world size (one spawned group per size, with the cost model's
    compute row :data:`COMPUTE_ROW` among them; the bucket sweep at the smallest), the single-process
    rows (T1, and the cost model's :func:`host_rows` at one rank, alternated with it), the all-reduce sweep
    of the cost model, then the trade-off.
    """
    from lightning_sync.testing import run_distributed

    worlds, threads = world_sizes(cfg), int(cfg.threads_per_rank)
    env = {"OMP_NUM_THREADS": str(threads), "PL_GLOBAL_SEED": "0"}
    meta = {
        "date": date.today().isoformat(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count() or 1,
        "python": platform.python_version(),
        "torch": _version("torch"),
        "lightning": _version("lightning"),
        "world_sizes": worlds,
        "threads_per_rank": threads,
        "command": " ".join(["lightning-sync", "bench", *sys.argv[1:]]),
    }
    selected = select_strategies(cfg)
    strategies = {name: (node, {}) for name, node in selected.items()}
    cost = cfg.get("cost_model") or {}
    hosts = host_rows(cfg, selected) if cost.get("enabled") else {}
    if cost.get("enabled"):  # compute alone under the same time-sharing, in the same rounds (runner.IN_STEP)
        strategies = with_compute_row(strategies)
    timeout = float(cfg.timeout_s)
    results: dict[int, list[list[dict[str, Any]]]] = {}
    for world in worlds:
        trials = [t for model in cfg.run_models for t in _trials(cfg, model, strategies)]
        if cfg.bucket_sweep.enabled and world == worlds[0]:
            trials += _trials(
                cfg, cfg.bucket_sweep.model, _bucket_rows(cfg), f"{cfg.bucket_sweep.model} (bucket sweep)"
            )
        if trials:
            log.info(
                "bench: %d trials on %d ranks (%d pairs, %d timed steps each)", len(trials), world, cfg.pairs, cfg.steps
            )
            results[world] = run_distributed(run_trials, world, trials, threads, f"K={world}", timeout=timeout, env=env)
    report = None
    if results:
        single: list[dict[str, Any]] = []
        solo_models = list(
            dict.fromkeys(
                [*(cfg.scaling.models if cfg.scaling.enabled else []), *(cfg.run_models if cost.get("enabled") else [])]
            )
        )
        one = {SINGLE_ROW: ({"_target_": None}, {}), **hosts}  # and the cost model's host rows at one rank
        solo = [t for model in solo_models for t in _trials(cfg, model, one)]
        if solo:
            log.info("bench: %d single-process trials (T1%s)", len(solo), "".join(f", {n}" for n in hosts))
            single = run_distributed(run_trials, 1, solo, threads, "K=1", timeout=timeout, env=env)[0]
        sweep = run_sweep(cost, threads, timeout) if cost.get("enabled") else []
        report = Report(results, single, cfg, meta, sweep=sweep)
        report.write(out_dir)
        save_raw(out_dir / "raw.json", results, single, sweep, meta)
    if cfg.tradeoff.enabled:
        from lightning_sync.bench.tradeoff import run_tradeoff

        run_tradeoff(cfg, out_dir, meta)
        if report is not None:  # one report: the trade-off rows go below the strategy rows
            with open(out_dir / "report.md", "a") as f:
                f.write("\n\n" + (out_dir / "tradeoff.md").read_text())
    return report


def run_sweep(cost: Any, threads: int, timeout: float) -> list[dict[str, Any]]:
    """The cost model's all-reduce sweep (``cost_model.sweep``) at every world size it names."""
    from lightning_sync.testing import run_distributed

    node = cost.sweep
    sizes = sweep_sizes(int(node.smallest), int(node.largest), int(node.factor))
    points: list[dict[str, Any]] = []
    for world in node.worlds:
        log.info("bench: all-reduce sweep on %d ranks (%d sizes x %s)", world, len(sizes), list(node.algorithms))
        points += run_distributed(
            sweep_all_reduce,
            int(world),
            sizes,
            [str(a) for a in node.algorithms],
            int(node.repeats),
            threads,
            timeout=timeout,
            env={"OMP_NUM_THREADS": str(threads)},
        )[0]
    return points


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or "unknown"
