"""Streaming DiLoCo against the rows it claims to improve on: final validation loss, total bytes, the bytes of
the busiest optimizer step, and the time ranks sat blocked on communication.

DiLoCo at a sync interval H already sends 1/H of DDP's bytes in total, so the total alone cannot show what
streaming buys. Its claims are about *when* the bytes go: F fragments each move 1/F of the model at a step
of their own, so the busiest step (the link a deployment must provision) carries 1/F of DiLoCo's; an
overlap of tau inner steps leaves the outer all-reduce in flight behind compute, so ranks should hardly wait for
it; int4 sends half a byte per value (and a scale per 128 values) where fp32 sends four. Hence, besides loss and
total bytes, per row:

* **peak bytes per step**: every rank records its byte counter after each optimizer step; the bytes of step i
  summed over ranks, the largest over steps;
* **exposed communication**: :meth:`~lightning_sync.comms.CommStats.blocked_seconds` over the fit (a call in
  flight while the rank computes is not counted), the mean over ranks.

A trial is a trade-off trial (:mod:`lightning_sync.bench.tradeoff`): one ``Trainer.fit`` in fresh processes, the
same step budget and seed for every row, so every row sees the same samples. The loss is that of the model a user
would keep: after the fit every rank takes part in the strategy's ``full_state_dict()`` (LocalSGD and DiLoCo: the
synchronized model; DDP's replicas are that model already) and rank 0 validates it alone. A fragment whose last
sync was issued fewer than tau steps before the end is still in flight then: its bytes are counted, its outer step
never lands, and the synchronized model holds that fragment as of its previous sync (what a checkpoint at that
step would hold). Rank 0's own replica is validated too, so the table shows what that lag costs.

``streaming.md`` states the goals (module constants below) per model, and whether each holds; ``streaming.png``
draws loss against bytes (:func:`~lightning_sync.bench.tradeoff.plot_bytes_loss`).
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_sync.bench.rows import fmt, median, node, schedule, strategy_class
from lightning_sync.bench.runner import stats_of
from lightning_sync.bench.tradeoff import (
    TradeoffResult,
    TradeoffTrial,
    _met,
    _Probe,
    fit_trial,
    plot_bytes_loss,
    validate_alone,
)

__all__ = ["StreamingResult", "run_streaming", "streaming_markdown", "streaming_trials"]

log = logging.getLogger("lightning_sync.bench")

#: The goals, each relative to a row of the same model: total bytes at most this share of the reference's
#: (``streaming.reference``), validation loss at most this ratio to the reference's, and an int4 row's loss at
#: most this ratio to the fp32 row with as many fragments. The peak goal is 1/F of ``streaming.baseline``'s.
MAX_BYTES, MAX_LOSS, MAX_INT4_LOSS = 1 / 100, 1.03, 1.01
#: The fragments are N / F values each only to one value (N / F rounded): the peak may exceed 1/F by that
PEAK_SLACK = 1e-4


class _Steps(pl.Callback):
    """Per rank: the bytes sent during each optimizer step and the seconds blocked in communication over the fit
    (from ``on_train_start`` to ``on_train_end``, as the trade-off's probe counts), written as JSON."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.per_step = out_dir, []
        self._bytes, self._blocked, self._step = 0, 0.0, 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stats = stats_of(trainer.strategy)
        self._bytes, self._blocked, self._step = stats.total_bytes, stats.blocked_seconds(), trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != self._step:  # an optimizer step ended: the sync it ran has been issued
            total = stats_of(trainer.strategy).total_bytes
            self.per_step.append(total - self._bytes)
            self._bytes, self._step = total, trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        blocked = stats_of(trainer.strategy).blocked_seconds() - self._blocked
        record = {"rank": trainer.global_rank, "per_step": self.per_step, "blocked_s": blocked}
        Path(self.out_dir, f"steps{trainer.global_rank}.json").write_text(json.dumps(record))


def _fit(rank: int, world: int, trial: TradeoffTrial, out_dir: str) -> dict[str, float] | None:
    """One trial on this rank; rank 0 returns the synchronized model's validation metrics and its replica's loss."""
    model, data, trainer = fit_trial(trial, [_Probe(out_dir), _Steps(out_dir)])
    synchronized = getattr(trainer.strategy, "full_state_dict", None)
    state = synchronized() if synchronized is not None else {}  # a collective where the replicas differ
    if rank != 0:
        return None
    replica = validate_alone(model, data)["val_loss"] if state else None
    if state:
        model.load_state_dict(state)
    metrics = validate_alone(model, data)
    return {**metrics, "replica_loss": metrics["val_loss"] if replica is None else replica}


@dataclass
class StreamingResult(TradeoffResult):
    """A trade-off trial's figures, and the bytes of its busiest step (all ranks), the mean seconds a rank was
    blocked on communication, and rank 0's replica's validation loss."""

    peak_bytes: float = 0.0
    exposed_s: float = 0.0
    replica_loss: float = float("nan")


def streaming_trials(cfg: Any) -> list[TradeoffTrial]:
    """Every row of ``streaming.rows`` on every model of ``streaming.models``, in the alternating schedule; a row
    whose ``sync_every`` does not divide the step budget raises (it would end mid-period, its bytes not those of
    whole periods), as do a reference or baseline that is not a row."""
    s = cfg.streaming
    steps, world, seeds = int(s.steps), int(s.world_size), [int(seed) for seed in s.seeds]
    if not seeds:
        raise ValueError("streaming.seeds must name at least one seed, got []")
    for key in ("reference", "baseline"):  # every goal is a ratio to one of them: fail before any trial
        if str(s[key]) not in s.rows:
            raise ValueError(f"streaming.{key} must be a row of streaming.rows {list(s.rows)}, got {s[key]!r}")
    for name, row in s.rows.items():
        if steps % int(row.get("sync_every", 1)):
            raise ValueError(f"streaming.steps={steps} must be a multiple of row {name}'s sync_every={row.sync_every}")
    out = []
    for model, m in s.models.items():
        for i, name in enumerate(schedule(list(s.rows), len(seeds))):  # a round per seed, the order alternating
            args = (str(name), str(model), node(s.rows[name]), node(m.model), node(m.data), steps, world)
            out.append(TradeoffTrial(*args, None, i // len(s.rows), seeds[i // len(s.rows)]))
    return out


def _result(trial: TradeoffTrial, metrics: dict[str, float], probes: list[dict], steps: list[dict]) -> StreamingResult:
    if len(probes) != trial.world or len(steps) != trial.world:
        raise RuntimeError(f"streaming trial {trial.model}/{trial.name}: {len(probes)} of {trial.world} ranks reported")
    wall = max(p["end"] for p in probes) - min(p["start"] for p in probes)
    n = trial.steps * trial.world * int(trial.data_cfg.get("batch_size", 1))
    by_step = [sum(column) for column in zip(*(s["per_step"] for s in steps), strict=True)]
    ranks = [p["steps"] for p in sorted(probes, key=lambda p: p["rank"])]
    figures = (metrics["val_loss"], sum(p["bytes"] for p in probes), wall, n, n / wall, ranks, metrics)
    result = StreamingResult(trial.name, trial.model, None, trial.round, *figures)
    result.peak_bytes, result.replica_loss = float(max(by_step, default=0)), metrics["replica_loss"]
    result.exposed_s = sum(s["blocked_s"] for s in steps) / len(steps)
    return result


def run_streaming(cfg: Any, out_dir: Path, meta: dict[str, Any] | None = None) -> list[StreamingResult]:
    """Run every trial; write ``streaming.md``, ``.json`` and ``.png`` into ``out_dir``; return the results."""
    from lightning_sync.testing import run_distributed

    s = cfg.streaming
    trials, timeout = streaming_trials(cfg), float(s.timeout_s)
    results = []
    for i, trial in enumerate(trials, 1):
        env = {"OMP_NUM_THREADS": "1", "PL_GLOBAL_SEED": str(trial.seed)}
        log.info("streaming %d/%d: %s/%s", i, len(trials), trial.model, trial.name)
        with tempfile.TemporaryDirectory(prefix="ls_streaming_") as probe_dir:
            args = (trial, probe_dir)
            metrics = run_distributed(_fit, trial.world, *args, timeout=timeout, env=env, process_group=False)[0]
            probes = [json.loads(f.read_text()) for f in sorted(Path(probe_dir).glob("rank*.json"))]
            steps = [json.loads(f.read_text()) for f in sorted(Path(probe_dir).glob("steps*.json"))]
        results.append(_result(trial, metrics, probes, steps))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "streaming.md").write_text(streaming_markdown(results, cfg, meta) + "\n")
    (out_dir / "streaming.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    plot_bytes_loss(results, out_dir / "streaming.png")
    return results


def _ratios(results: list[StreamingResult], model: str, name: str, other: str, key: str) -> list[float]:
    """Row ``name``'s ``key`` over row ``other``'s in the same round (the same seed), one per round."""
    ref = {r.round: getattr(r, key) for r in results if (r.model, r.name) == (model, other)}
    mine = [r for r in results if (r.model, r.name) == (model, name)]
    return [getattr(r, key) / ref[r.round] for r in mine if ref.get(r.round)]


def _ratio(results: list[StreamingResult], model: str, name: str, other: str, key: str) -> float:
    """The median over rounds of :func:`_ratios` (NaN: none)."""
    return median(_ratios(results, model, name, other, key))


def _spread(results: list[StreamingResult], model: str, name: str, other: str, key: str) -> str:
    """The median ratio and, over several rounds, its range: ``1.0123 (0.9810-1.0400)``."""
    ratios = _ratios(results, model, name, other, key)
    if len(ratios) < 2:
        return fmt(median(ratios), ".4f")
    return f"{median(ratios):.4f} ({min(ratios):.4f}-{max(ratios):.4f})"


def _settings(row: Any) -> tuple[int, int, str] | None:
    """A DiLoCo row's (fragments, overlap steps, outer dtype), the class defaults where it names none; None for
    any other strategy."""
    if strategy_class(node(row)) != "DiLoCoStrategy":
        return None
    return int(row.get("fragments", 1)), int(row.get("overlap_steps", 0)), str(row.get("outer_dtype", "fp32"))


def _streamed(cfg: Any) -> dict[str, tuple[int, int, str]]:
    """The streaming rows (DiLoCo rows other than the baseline): name -> :func:`_settings`."""
    s = cfg.streaming
    rows = {str(name): _settings(row) for name, row in s.rows.items() if str(name) != str(s.baseline)}
    return {name: settings for name, settings in rows.items() if settings is not None}


def _goals(results: list[StreamingResult], cfg: Any, model: str) -> list[str]:
    """One line per goal and streaming row of ``model``."""
    s = cfg.streaming
    ref, base, streamed = str(s.reference), str(s.baseline), _streamed(cfg)
    lines = []
    for name, (frags, _, dtype) in streamed.items():
        x_bytes = _ratio(results, model, name, ref, "bytes")
        x_peak = _ratio(results, model, name, base, "peak_bytes")
        x_loss = _ratio(results, model, name, ref, "val_loss")
        checks = [f"bytes x{x_bytes:.4f} of {ref} <= {MAX_BYTES:.4f}: {_met(x_bytes <= MAX_BYTES * (1 + 1e-9))}"]
        if dtype == (base_dtype := (_settings(s.rows[base]) or (1, 0, "fp32"))[2]):
            checks.append(f"peak/step x{x_peak:.3f} of {base} <= 1/{frags}: {_met(x_peak <= 1 / frags + PEAK_SLACK)}")
        else:
            checks.append(f"peak/step x{x_peak:.3f} of {base} (reported: {dtype} against {base_dtype})")
        spread = _spread(results, model, name, ref, "val_loss")
        checks.append(f"loss x{spread} of {ref} <= {MAX_LOSS} (median): {_met(x_loss <= MAX_LOSS)}")
        twin = next((n for n, (f, _, d) in streamed.items() if f == frags and d == "fp32"), None)
        if dtype == "int4" and twin is not None:
            x_twin = _ratio(results, model, name, twin, "val_loss")
            spread = _spread(results, model, name, twin, "val_loss")
            checks.append(f"loss x{spread} of {twin} <= {MAX_INT4_LOSS} (median): {_met(x_twin <= MAX_INT4_LOSS)}")
        lines.append(f"- {model} {name}: " + "; ".join(checks))
    return lines


def streaming_markdown(results: list[StreamingResult], cfg: Any, meta: dict[str, Any] | None = None) -> str:
    """The table (medians over rounds; ratios are same-round) and the goals per model, as Markdown."""
    s = cfg.streaming
    ref, base = str(s.reference), str(s.baseline)
    lines = [f"## Streaming DiLoCo: {int(s.steps)} global steps of {int(s.world_size)} ranks, seeds {list(s.seeds)}"]
    lines.append("")
    if m := meta:
        versions = f"Python {m['python']}, torch {m['torch']}, lightning {m['lightning']}"
        lines += [f"Measured {m['date']} on {m['cpu']}; {versions}. Command: `{m['command']}`", ""]
    lines += [
        f"A round is a seed: in it every row trains the same samples from the same initial model. Val loss: rank 0 "
        f"after the fit, on the synchronized "
        f"model (a fragment's sync still in flight at the end has not landed); replica loss: rank 0's own replica. "
        f"`x loss`, `x bytes`: same-round ratios to `{ref}`; peak/step: the most bytes sent in one optimizer step, "
        f"all ranks; `x peak`: to `{base}`'s; exposed: seconds a rank was blocked on communication (mean over "
        f"ranks); wall: the fit, first rank's start to last rank's end. Medians over rounds; `x loss` with its range.",
        "",
        "| model | row | F | tau | outer dtype | val loss | x loss | replica loss | MiB sent | x bytes | "
        "peak KiB/step | x peak | exposed s | wall s |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model, name in dict.fromkeys((r.model, r.name) for r in results):
        trials = [r for r in results if (r.model, r.name) == (model, name)]
        f, tau, dtype = _settings(s.rows[name]) or ("-", "-", "-")
        keys = ("val_loss", "replica_loss", "bytes", "wall_s", "peak_bytes", "exposed_s")
        mid = {k: median([getattr(t, k) for t in trials]) for k in keys}
        lines.append(
            f"| {model} | {name} | {f} | {tau} | {dtype} | {mid['val_loss']:.4f} | "
            f"{_spread(results, model, name, ref, 'val_loss')} | {mid['replica_loss']:.4f} | "
            f"{mid['bytes'] / 2**20:.2f} | {fmt(_ratio(results, model, name, ref, 'bytes'), '.4f')} | "
            f"{mid['peak_bytes'] / 2**10:.1f} | {fmt(_ratio(results, model, name, base, 'peak_bytes'), '.3f')} | "
            f"{mid['exposed_s']:.2f} | {mid['wall_s']:.1f} |"
        )
    goals = [g for model in dict.fromkeys(r.model for r in results) for g in _goals(results, cfg, model)]
    lines += ["", f"Goals (per model; peak against `{base}` at the same dtype, int4's only reported):", "", *goals]
    return "\n".join(lines)
