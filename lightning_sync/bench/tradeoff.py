"""The synchronization trade-off, measured: final validation loss against bytes sent and wall time.

Every row trains one model for the same global step budget (``steps`` steps of the global batch
``K x batch_size``: the same samples for every strategy), from the same seed and data, with and
without one straggler (``SlowRank(rank=1, factor=slow_factor)``). Each trial is one ``Trainer.fit`` in
freshly started processes with no process group set up beforehand: the asynchronous parameter
server runs without one, the other strategies create theirs as they would under a launcher, and
Hogwild starts its own processes from one driver. Rows alternate A B C ... C B A over ``pairs`` rounds.

Per trial:

* **val loss:** the trained model, evaluated the same way for every strategy after ``fit``: on rank 0
  (Hogwild: the driver, which shares the trained memory), over the whole validation set, in one
  process. The budget is a multiple of every ``sync_every``, so LocalSGD and DiLoCo end on a sync;
  the parameter server's workers end holding the final global model.
* **bytes:** payload bytes through ``lightning_sync.comms`` (collectives and RPC) during training,
  summed over ranks.
* **wall:** from the first rank's ``on_train_start`` to the last rank's ``on_train_end``.
* **throughput:** samples whose gradients entered the model (``steps x K x batch_size``) per second.

The report gives medians over rounds, and each ratio to the reference row (``bucketed_ddp``, same
model and straggler setting) is the median of same-round ratios.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_sync import comms

__all__ = ["TradeoffTrial", "run_tradeoff", "tradeoff_markdown", "tradeoff_rows", "tradeoff_trials"]

log = logging.getLogger("lightning_sync.bench")
_QUIET = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}


@dataclass
class TradeoffTrial:
    """One fit of one strategy."""

    name: str
    """Row name (a key of the model's ``tradeoff.rows``)."""
    model: str
    """Model name (a key of ``tradeoff.models``)."""
    strategy: dict[str, Any]
    """Hydra node building the strategy."""
    model_cfg: dict[str, Any]
    """Hydra node building the LightningModule."""
    data_cfg: dict[str, Any]
    """Hydra node building the LightningDataModule."""
    steps: int
    """Global step budget (``Trainer(max_steps=...)``)."""
    world: int
    """Ranks (processes)."""
    slow_factor: float | None = None
    """Rank 1 made this many times slower (None: no straggler)."""
    round: int = 0
    """Which pass of the alternating schedule."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Labels carried into the results."""

    @property
    def self_launching(self) -> bool:
        """Hogwild: one driver process, the strategy starts the ranks itself."""
        return str(self.strategy.get("_target_", "")).endswith("HogwildStrategy")


class _Probe(pl.Callback):
    """Per rank: the training interval (wall clock), optimizer steps and comms bytes, written as JSON."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self._start = 0.0
        self._bytes0 = 0

    @staticmethod
    def _bytes() -> int:
        return sum(s.bytes for s in comms.get_stats().snapshot().values())

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._bytes0, self._start = self._bytes(), time.time()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = {
            "rank": trainer.global_rank,
            "start": self._start,
            "end": time.time(),
            "steps": trainer.global_step,
            "bytes": self._bytes() - self._bytes0,
        }
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(record, f)


def _evaluate(model: pl.LightningModule, data: pl.LightningDataModule) -> dict[str, float]:
    """The trained model on the whole validation set, in this one process."""
    if torch.distributed.is_initialized():  # left by the strategy; this evaluation is local
        torch.distributed.destroy_process_group()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="auto", **_QUIET)
    metrics = trainer.validate(model, datamodule=data, verbose=False)[0]
    return {k: float(v) for k, v in metrics.items()}


def _fit(rank: int, world: int, trial: TradeoffTrial, out_dir: str) -> dict[str, float] | None:
    """One trial on this rank (or, for Hogwild, in the driver); rank 0 returns the validation metrics."""
    import warnings

    from hydra.utils import instantiate

    import lightning_sync  # noqa: F401 - registers the strategy names
    from lightning_sync.diagnostics import SlowRank

    torch.set_num_threads(1)
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    pl.seed_everything(int(trial.extra.get("seed", 0)), verbose=False)
    model, data = instantiate(trial.model_cfg), instantiate(trial.data_cfg)
    callbacks: list[pl.Callback] = [_Probe(out_dir)]
    if trial.slow_factor is not None:
        callbacks.append(SlowRank(rank=1, factor=float(trial.slow_factor)))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=trial.world,
        strategy=instantiate(trial.strategy),
        max_steps=trial.steps,
        max_epochs=-1,
        limit_val_batches=0,
        callbacks=callbacks,
        **_QUIET,
    )
    trainer.fit(model, datamodule=data)
    return _evaluate(model, data) if rank == 0 else None


def tradeoff_trials(cfg: Any) -> list[TradeoffTrial]:
    """The alternating schedule of ``cfg.tradeoff`` (a plain dict or DictConfig)."""
    from lightning_sync.bench.app import _node, schedule

    t = cfg.tradeoff
    slow = [None] if t.slow_factor is None else [None, float(t.slow_factor)]
    out = []
    for model, rows in t.rows.items():
        m = t.models[model]
        names = schedule(list(rows), int(t.pairs))
        per_round = len(rows)
        for i, name in enumerate(names):
            for factor in slow:
                out.append(
                    TradeoffTrial(
                        name=str(name),
                        model=str(model),
                        strategy=_node(rows[name]),
                        model_cfg=_node(m.model),
                        data_cfg=_node(m.data),
                        steps=int(t.steps),
                        world=int(t.world_size),
                        slow_factor=factor,
                        round=i // per_round,
                        extra={"seed": int(t.seed)},
                    )
                )
    return out


def run_tradeoff(cfg: Any, out_dir: Path, meta: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Run every trial (each in fresh processes), write ``tradeoff.md`` and ``tradeoff.png``; return the results."""
    from lightning_sync.testing import run_distributed

    trials = tradeoff_trials(cfg)
    env = {"OMP_NUM_THREADS": "1", "PL_GLOBAL_SEED": str(int(cfg.tradeoff.seed))}
    results = []
    for i, trial in enumerate(trials, 1):
        probe_dir = tempfile.mkdtemp(prefix="ls_tradeoff_")
        ranks = 1 if trial.self_launching else trial.world
        label = f"{trial.model}/{trial.name}" + (f" (rank 1 x{trial.slow_factor:g})" if trial.slow_factor else "")
        log.info("tradeoff %d/%d: %s", i, len(trials), label)
        metrics = run_distributed(
            _fit, ranks, trial, probe_dir, timeout=float(cfg.tradeoff.timeout_s), env=env, process_group=False
        )[0]
        probes = [json.loads((Path(probe_dir) / f).read_text()) for f in sorted(os.listdir(probe_dir))]
        for f in os.listdir(probe_dir):
            os.remove(os.path.join(probe_dir, f))
        os.rmdir(probe_dir)
        if len(probes) != trial.world:
            raise RuntimeError(f"tradeoff trial {label}: {len(probes)} of {trial.world} ranks reported")
        wall = max(p["end"] for p in probes) - min(p["start"] for p in probes)
        samples = trial.steps * trial.world * int(trial.data_cfg.get("batch_size", 1))
        results.append(
            {
                "name": trial.name,
                "model": trial.model,
                "slow": trial.slow_factor,
                "round": trial.round,
                "val_loss": metrics["val_loss"],
                "metrics": metrics,
                "bytes": sum(p["bytes"] for p in probes),
                "wall_s": wall,
                "samples": samples,
                "samples_per_s": samples / wall,
                "steps_by_rank": [p["steps"] for p in sorted(probes, key=lambda p: p["rank"])],
            }
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tradeoff.md").write_text(tradeoff_markdown(results, cfg, meta) + "\n")
    (out_dir / "tradeoff.json").write_text(json.dumps(results, indent=1))
    _plot(results, out_dir / "tradeoff.png")
    return results


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def tradeoff_rows(results: list[dict[str, Any]], reference: str = "bucketed_ddp") -> list[dict[str, Any]]:
    """One row per (model, strategy, straggler): medians, and same-round ratios to the reference row."""
    ref = {(r["model"], r["slow"], r["round"]): r for r in results if r["name"] == reference}
    keys: list[tuple[str, str, Any]] = []
    for r in results:
        if (r["model"], r["name"], r["slow"]) not in keys:
            keys.append((r["model"], r["name"], r["slow"]))
    rows = []
    for model, name, slow in keys:
        trials = [r for r in results if (r["model"], r["name"], r["slow"]) == (model, name, slow)]

        def ratio(key: str, trials: list[dict[str, Any]] = trials) -> float:
            pairs = [
                (t[key], ref[(t["model"], t["slow"], t["round"])][key])
                for t in trials
                if (t["model"], t["slow"], t["round"]) in ref
            ]
            return _median([a / b for a, b in pairs if b])

        rows.append(
            {
                "model": model,
                "name": name,
                "slow": slow,
                "val_loss": _median([t["val_loss"] for t in trials]),
                "bytes": _median([t["bytes"] for t in trials]),
                "wall_s": _median([t["wall_s"] for t in trials]),
                "samples_per_s": _median([t["samples_per_s"] for t in trials]),
                "x_loss": ratio("val_loss"),
                "x_bytes": ratio("bytes"),
                "x_throughput": ratio("samples_per_s"),
                "steps_by_rank": trials[0]["steps_by_rank"],
                "trials": len(trials),
            }
        )
    return rows


#: The targets the report checks: (row name, with a straggler, bytes at most, loss ratio at most,
#: throughput ratio at least), all relative to the reference row of the same model and setting.
TARGETS = [
    ("local_sgd", False, 1 / 8, 1.03, None),
    ("diloco", False, 1 / 50, 1.05, None),
    ("async_ps", True, None, 1.05, 1.4),
]


def _fmt(x: float, spec: str) -> str:
    return "n/a" if x != x else format(x, spec)


def tradeoff_markdown(results: list[dict[str, Any]], cfg: Any, meta: dict[str, Any] | None = None) -> str:
    """The trade-off table and the target checks, as Markdown (``meta``: machine, versions, date, command)."""
    t = cfg.tradeoff
    rows = tradeoff_rows(results, str(t.reference))
    lines = [f"## Trade-off: {int(t.steps)} global steps of {int(t.world_size)} ranks, {int(t.pairs)} rounds", ""]
    if meta:
        lines += [
            f"Measured {meta['date']} on {meta['cpu']}; Python {meta['python']}, torch {meta['torch']}, "
            f"lightning {meta['lightning']}. Command: `{meta['command']}`",
            "",
        ]
    lines += [
        f"Ratios are to `{t.reference}` on the same model and straggler setting (median of same-round "
        "ratios); `steps/rank` are each rank's own optimizer steps in the first round.",
        "",
        "| model | strategy | straggler | val loss | x loss | MiB sent | x bytes | wall s | samples/s | "
        "x throughput | steps/rank |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        slow = f"rank 1 x{r['slow']:g}" if r["slow"] else "none"
        lines.append(
            f"| {r['model']} | {r['name']} | {slow} | {r['val_loss']:.4f} | {_fmt(r['x_loss'], '.3f')} | "
            f"{r['bytes'] / 2**20:.2f} | {_fmt(r['x_bytes'], '.4f')} | {r['wall_s']:.1f} | "
            f"{r['samples_per_s']:.0f} | {_fmt(r['x_throughput'], '.2f')} | {r['steps_by_rank']} |"
        )
    lines += ["", "Targets:", ""]
    for name, slowed, max_bytes, max_loss, min_tp in TARGETS:
        for r in rows:
            if r["name"] != name or bool(r["slow"]) != slowed:
                continue
            checks = []
            if max_bytes is not None:
                checks.append(
                    f"bytes x{r['x_bytes']:.4f} <= {max_bytes:.4f}: {'met' if r['x_bytes'] <= max_bytes else 'MISSED'}"
                )
            if min_tp is not None:
                checks.append(
                    f"throughput x{r['x_throughput']:.2f} >= {min_tp}: "
                    f"{'met' if r['x_throughput'] >= min_tp else 'MISSED'}"
                )
            checks.append(f"loss x{r['x_loss']:.3f} <= {max_loss}: {'met' if r['x_loss'] <= max_loss else 'MISSED'}")
            lines.append(
                f"- {r['model']} {name}" + (" with the straggler" if slowed else "") + ": " + "; ".join(checks)
            )
    return "\n".join(lines)


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    """Validation loss against MiB sent (log) and against wall time, one row of panels per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in results))
    names = list(dict.fromkeys(r["name"] for r in results))
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 4 * len(models)), squeeze=False)
    colors = {n: plt.get_cmap("tab10")(i) for i, n in enumerate(names)}
    for row, model in enumerate(models):
        for r in (r for r in results if r["model"] == model):
            style = {
                "color": colors[r["name"]],
                "s": 45,
                "marker": "o" if not r["slow"] else "s",
                "facecolors": colors[r["name"]] if not r["slow"] else "none",
            }
            axes[row][0].scatter(max(r["bytes"] / 2**20, 1e-3), r["val_loss"], **style)
            axes[row][1].scatter(r["wall_s"], r["val_loss"], **style)
        axes[row][0].set_xscale("log")
        axes[row][0].set(xlabel="MiB sent (all ranks, log; 0 plotted at 1e-3)", ylabel=f"{model} val loss")
        axes[row][1].set(xlabel="wall time of training (s)", ylabel=f"{model} val loss")
        for ax in axes[row]:
            ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=c, marker="o", linestyle="", label=n) for n, c in colors.items()]
    handles += [
        plt.Line2D([], [], color="gray", marker="o", linestyle="", label="no straggler"),
        plt.Line2D([], [], color="gray", marker="s", markerfacecolor="none", linestyle="", label="rank 1 slowed"),
    ]
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 7))
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)
