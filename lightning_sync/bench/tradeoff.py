"""The synchronization trade-off, measured: final validation loss against bytes sent and wall time.

A trial is one ``Trainer.fit`` in fresh processes with no process group set up beforehand (the parameter server
needs none, Hogwild starts its own processes). Per trial: validation loss on rank 0 after the fit, ``comms`` bytes
summed over ranks, wall time from the first ``on_train_start`` to the last ``on_train_end``, and throughput.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_sync.bench import style
from lightning_sync.bench.rows import FIT, QUIET, fmt, median, node, pyplot, schedule
from lightning_sync.bench.runner import quiet, stats_of
from lightning_sync.bench.style import WHISKER, colour, label, legend_below, log_axis, look, paged, save_fig, whisker

__all__ = ["BYTES_LOSS", "TradeoffResult", "TradeoffRow", "plot_bytes_loss", "plot_tradeoff", "run_tradeoff"]
__all__ += ["fit_trial", "tradeoff_markdown", "tradeoff_rows", "validate_alone"]

log = logging.getLogger("lightning_sync.bench")


@dataclass
class TradeoffTrial:
    """One fit: row ``name`` of ``tradeoff.rows`` on ``model``, its Hydra nodes, the global step budget, the
    ranks, rank 1 made ``slow_factor`` times slower (None: no straggler) and the round of the schedule."""

    name: str
    model: str
    strategy: dict[str, Any]
    model_cfg: dict[str, Any]
    data_cfg: dict[str, Any]
    steps: int
    world: int
    slow_factor: float | None = None
    round: int = 0
    seed: int = 0


class _Probe(pl.Callback):
    """Per rank: the training interval (wall clock), optimizer steps and comms bytes, written as JSON."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self._start, self._bytes0 = out_dir, 0.0, 0

    @staticmethod
    def _bytes(trainer: pl.Trainer) -> int:
        return sum(s.bytes for s in stats_of(trainer.strategy).snapshot().values())

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._bytes0, self._start = self._bytes(trainer), time.time()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = dict(rank=trainer.global_rank, start=self._start, end=time.time(), steps=trainer.global_step)
        record["bytes"] = self._bytes(trainer) - self._bytes0
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(record, f)


def _fit(rank: int, world: int, trial: TradeoffTrial, out_dir: str) -> dict[str, float] | None:
    """One trial on this rank (or, for Hogwild, in the driver); rank 0 returns the validation metrics."""
    from lightning_sync.diagnostics import SlowRank

    callbacks: list[pl.Callback] = [_Probe(out_dir)]
    if trial.slow_factor is not None:
        callbacks.append(SlowRank(rank=1, factor=float(trial.slow_factor)))
    model, data, _ = fit_trial(trial, callbacks)
    return validate_alone(model, data) if rank == 0 else None


def fit_trial(trial: TradeoffTrial, callbacks: list[pl.Callback]) -> tuple[Any, Any, pl.Trainer]:
    """``trial``'s fit on this rank, seeded and quiet, with ``callbacks``: its model, data module and trainer."""
    from hydra.utils import instantiate

    import lightning_sync  # noqa: F401 - registers the strategy names

    quiet(1)
    pl.seed_everything(trial.seed, verbose=False)
    model, data = instantiate(trial.model_cfg), instantiate(trial.data_cfg)
    kw = {"devices": trial.world, "strategy": instantiate(trial.strategy), "max_steps": trial.steps}
    trainer = pl.Trainer(accelerator="cpu", callbacks=callbacks, **kw, **FIT)
    trainer.fit(model, datamodule=data)
    return model, data, trainer


def validate_alone(model: pl.LightningModule, data: pl.LightningDataModule) -> dict[str, float]:
    """After a fit, on rank 0: the trained ``model`` evaluated on the whole validation set in this process alone, the
    same way for every row whatever its strategy did with the data (the fit's process group is left first)."""
    if torch.distributed.is_initialized():  # left by the strategy
        torch.distributed.destroy_process_group()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="auto", num_sanity_val_steps=0, **QUIET)
    return {k: float(v) for k, v in trainer.validate(model, datamodule=data, verbose=False)[0].items()}


def tradeoff_trials(cfg: Any) -> list[TradeoffTrial]:
    """The alternating schedule of ``cfg.tradeoff`` (a plain dict or DictConfig)."""
    t = cfg.tradeoff
    slow = [None] if t.slow_factor is None else [None, float(t.slow_factor)]
    steps, world, seed = int(t.steps), int(t.world_size), int(t.seed)
    out = []
    for model, rows in t.rows.items():
        m = t.models[model]
        for i, name in enumerate(schedule(list(rows), int(t.pairs))):
            args = (str(name), str(model), node(rows[name]), node(m.model), node(m.data), steps, world)
            out += [TradeoffTrial(*args, f, i // len(rows), seed) for f in slow]
    return out


@dataclass
class TradeoffResult:
    """One trial's figures (module docstring); ``steps_by_rank``: each rank's own optimizer steps."""

    name: str
    model: str
    slow: float | None
    round: int
    val_loss: float
    bytes: float
    wall_s: float
    samples: int
    samples_per_s: float
    steps_by_rank: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class TradeoffRow:
    """One (model, strategy, straggler) over its rounds: medians, and ``x_*`` same-round ratios to the reference."""

    model: str
    name: str
    slow: float | None
    val_loss: float
    bytes: float
    wall_s: float
    samples_per_s: float
    x_loss: float
    x_bytes: float
    x_throughput: float
    steps_by_rank: list[int]
    trials: int


def run_tradeoff(cfg: Any, out_dir: Path, meta: dict[str, Any] | None = None) -> list[TradeoffResult]:
    """Run every trial, write ``tradeoff.md``, ``.json``, ``.png`` and :data:`BYTES_LOSS`; return the results."""
    from lightning_sync.testing import run_distributed

    trials, timeout = tradeoff_trials(cfg), float(cfg.tradeoff.timeout_s)
    env, results = {"OMP_NUM_THREADS": "1", "PL_GLOBAL_SEED": str(int(cfg.tradeoff.seed))}, []
    for i, trial in enumerate(trials, 1):
        hogwild = str(trial.strategy.get("_target_", "")).endswith("HogwildStrategy")
        ranks = 1 if hogwild else trial.world  # Hogwild's driver process starts the ranks itself
        label = f"{trial.model}/{trial.name}" + (f" (rank 1 x{trial.slow_factor:g})" if trial.slow_factor else "")
        log.info("tradeoff %d/%d: %s", i, len(trials), label)
        with tempfile.TemporaryDirectory(prefix="ls_tradeoff_") as probe_dir:
            metrics = run_distributed(_fit, ranks, trial, probe_dir, timeout=timeout, env=env, process_group=False)[0]
            probes = [json.loads(f.read_text()) for f in sorted(Path(probe_dir).iterdir())]
        if len(probes) != trial.world:
            raise RuntimeError(f"tradeoff trial {label}: {len(probes)} of {trial.world} ranks reported")
        wall = max(p["end"] for p in probes) - min(p["start"] for p in probes)
        n = trial.steps * trial.world * int(trial.data_cfg.get("batch_size", 1))
        steps = [p["steps"] for p in sorted(probes, key=lambda p: p["rank"])]
        figures = (metrics["val_loss"], sum(p["bytes"] for p in probes), wall, n, n / wall, steps, metrics)
        results.append(TradeoffResult(trial.name, trial.model, trial.slow_factor, trial.round, *figures))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tradeoff.md").write_text(tradeoff_markdown(results, cfg, meta) + "\n")
    (out_dir / "tradeoff.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    plot_tradeoff(results, out_dir / "tradeoff.png")
    plot_bytes_loss(results, out_dir / BYTES_LOSS)
    return results


def tradeoff_rows(results: list[TradeoffResult], reference: str = "bucketed_ddp") -> list[TradeoffRow]:
    """One row per (model, strategy, straggler): medians, and same-round ratios to the reference row."""
    ref = {(r.model, r.slow, r.round): r for r in results if r.name == reference}
    rows = []
    for model, name, slow in dict.fromkeys((r.model, r.name, r.slow) for r in results):
        trials = [r for r in results if (r.model, r.name, r.slow) == (model, name, slow)]
        pairs = [(t, ref[(t.model, t.slow, t.round)]) for t in trials if (t.model, t.slow, t.round) in ref]
        medians = [median([getattr(t, k) for t in trials]) for k in ("val_loss", "bytes", "wall_s", "samples_per_s")]
        keys = ("val_loss", "bytes", "samples_per_s")  # the same-round ratios'
        ratios = [median([getattr(a, k) / getattr(b, k) for a, b in pairs if getattr(b, k)]) for k in keys]
        rows.append(TradeoffRow(model, name, slow, *medians, *ratios, trials[0].steps_by_rank, len(trials)))
    return rows


#: The targets the report checks: (row name, with a straggler, bytes at most, loss ratio at most,
#: throughput ratio at least), all relative to the reference row of the same model and setting.
TARGETS = [
    ("local_sgd", False, 1 / 8, 1.03, None),
    ("diloco", False, 1 / 50, 1.05, None),
    ("async_ps", True, None, 1.05, 1.4),
]


def tradeoff_markdown(results: list[TradeoffResult], cfg: Any, meta: dict[str, Any] | None = None) -> str:
    """The trade-off table and the target checks, as Markdown (``meta``: machine, versions, date, command)."""
    t = cfg.tradeoff
    rows = tradeoff_rows(results, str(t.reference))
    lines = [f"## Trade-off: {int(t.steps)} global steps of {int(t.world_size)} ranks, {int(t.pairs)} rounds", ""]
    if m := meta:
        versions = f"Python {m['python']}, torch {m['torch']}, lightning {m['lightning']}"
        lines += [f"Measured {m['date']} on {m['cpu']}; {versions}. Command: `{m['command']}`", ""]
    lines += [
        f"Ratios: median of same-round ratios to `{t.reference}` (same model and straggler); `steps/rank`: round 0.",
        "",
        "| model | strategy | straggler | val loss | x loss | MiB sent | x bytes | wall s | samples/s | "
        "x throughput | steps/rank |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        slow = f"rank 1 x{r.slow:g}" if r.slow else "none"
        lines.append(
            f"| {r.model} | {r.name} | {slow} | {r.val_loss:.4f} | {fmt(r.x_loss, '.3f')} | "
            f"{r.bytes / 2**20:.2f} | {fmt(r.x_bytes, '.4f')} | {r.wall_s:.1f} | "
            f"{r.samples_per_s:.0f} | {fmt(r.x_throughput, '.2f')} | {r.steps_by_rank} |"
        )
    lines += ["", "Targets:", ""]
    for name, slowed, max_bytes, max_loss, min_tp in TARGETS:
        for r in (r for r in rows if r.name == name and bool(r.slow) == slowed):
            checks = [f"bytes x{r.x_bytes:.4f} <= {max_bytes:.4f}: {_met(r.x_bytes <= max_bytes)}"] if max_bytes else []
            if min_tp is not None:
                checks.append(f"throughput x{r.x_throughput:.2f} >= {min_tp}: {_met(r.x_throughput >= min_tp)}")
            checks.append(f"loss x{r.x_loss:.3f} <= {max_loss}: {_met(r.x_loss <= max_loss)}")
            lines.append(f"- {r.model} {name}" + (" with the straggler" if slowed else "") + ": " + "; ".join(checks))
    return "\n".join(lines)


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


#: Per model, loss against bytes (the trade-off in one picture); ``tradeoff.png`` adds wall time.
BYTES_LOSS = "bytes_loss.png"
_FLOOR_MIB = 1e-3  # where a row that sent nothing sits on the log axis


def _spread(trials: list[TradeoffResult], key: str, scale: float = 1.0) -> tuple[float, list[list[float]] | None]:
    mid = median(values := [getattr(t, key) * scale for t in trials])
    return mid, whisker(mid, values)


def _points(ax: Any, results: list[TradeoffResult], model: str, x_key: str, annotate: bool = False) -> None:
    """Each (strategy, straggler) of ``model``: median validation loss against the median of ``x_key`` (MiB sent or
    wall seconds), whiskers from the smallest to the largest round on both axes; hollow squares: rank 1 slowed."""
    for name, slow in dict.fromkeys((r.name, r.slow) for r in results if r.model == model):
        trials = [r for r in results if (r.model, r.name, r.slow) == (model, name, slow)]
        scale = 1 / 2**20 if x_key == "bytes" else 1.0
        x, xerr = _spread(trials, x_key, scale)
        if x_key == "bytes" and x < _FLOOR_MIB:
            x, xerr = _FLOOR_MIB, None
        y, yerr = _spread(trials, "val_loss")
        face = "none" if slow else colour(name)
        ax.errorbar([x], [y], xerr=xerr, yerr=yerr, fmt="s" if slow else "o", ms=6, mfc=face, **WHISKER, **look(name))
        if annotate and not slow:
            ax.annotate(name, (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points", color=colour(name))
    ax.grid(alpha=0.3)


def _handles(results: list[TradeoffResult]) -> list[Any]:
    line = pyplot().Line2D
    handles = [line([], [], marker="o", ls="", label=n, **look(n)) for n in dict.fromkeys(r.name for r in results)]
    note = style.repeats_note([len({r.round for r in results})])
    if not any(r.slow for r in results):  # no straggler rows: no markers to tell apart
        return [*handles, line([], [], color="gray", marker="o", ls="", label=note)]
    handles.append(line([], [], color="gray", marker="o", ls="", label=f"no straggler ({note})"))
    return [*handles, line([], [], color="gray", marker="s", mfc="none", ls="", label="rank 1 slowed")]


_BYTES = "MiB sent, all ranks (log; accounted, 0 at 1e-3)"


def plot_tradeoff(results: list[TradeoffResult], path: Path) -> list[Any]:
    """``tradeoff.png``: validation loss against MiB sent and against wall time, a row of two panels per model,
    three models to a page; returns the figures, closed."""
    out = []
    for file, models in paged(path, dict.fromkeys(r.model for r in results), style.MAX_PANELS // 2):
        fig, axes = style.figure(len(models), 2, 5.5, 3.6)
        for row, model in enumerate(models):
            _points(axes[row][0], results, model, "bytes")
            _points(axes[row][1], results, model, "wall_s")
            log_axis(axes[row][0])
            label(axes[row][0], _BYTES, f"{model} val loss", model, legend=None)
            label(axes[row][1], "wall time of training (s)", f"{model} val loss", model, legend=None)
        out.append(save_fig(fig, file, rect=legend_below(fig, _handles(results), 4)))
    return out


def plot_bytes_loss(results: list[TradeoffResult], path: Path) -> list[Any]:
    """:data:`BYTES_LOSS`: a panel per model, validation loss against MiB sent, each strategy named at its point."""
    out = []
    for file, models in paged(path, dict.fromkeys(r.model for r in results), style.MAX_PANELS):
        fig, axes = style.grid(len(models), 5, 3.8)
        for ax, model in zip(axes, models):
            _points(ax, results, model, "bytes", annotate=True)
            log_axis(ax)
            label(ax, _BYTES, "validation loss after the step budget", f"{model}: loss against bytes", legend=None)
        out.append(save_fig(fig, file, rect=legend_below(fig, _handles(results), 4)))
    return out
