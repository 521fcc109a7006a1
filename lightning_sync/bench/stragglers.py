"""The straggler table: one rank made slow, and what plain synchronous training, rebalancing and the parameter server
each make of it, measured side by side.

Every trial is one ``Trainer.fit`` of ``stragglers.steps`` global steps in fresh processes, rank 1 slowed
``stragglers.slow_factor`` times by :class:`~lightning_sync.diagnostics.SlowRank` (its compute stretched, waits in
collectives not), from the start or, in the *throttle* setting, from step ``stragglers.throttle_at`` on (a GPU that
heats up). Rows: ``bucketed_ddp`` (plain), ``rebalanced`` (``bucketed_ddp`` with ``rebalance=True``) and
``async_ps``, at each world size of ``stragglers.worlds``, in the alternating order of
:func:`~lightning_sync.bench.rows.schedule` over ``stragglers.pairs`` rounds. Throughput is the samples of the
steps after ``stragglers.warmup_steps`` over their wall time.

**The ideal.** Each rank measures its own compute per step (its batches' wall time less its time blocked in
collectives). From the plain row: ``c``, the fast ranks' compute per step, and ``m``, the rest of a step (its wall
time less the slow rank's compute: communication not hidden, the optimizer step, the loop). A plain step takes
``f c + m``; the best split of the same global batch gives each rank compute in proportion to its speed, ``K c / (K
- 1 + 1/f)``, so the ideal speed-up is ``(f c + m) / (K c / (K - 1 + 1/f) + m)``: 1.5 with one of 2 ranks at
``f = 2`` and 1.67 with one of 3 when ``m = 0``. Both are reported, with the goal of at least 0.9 of the measured
ideal and at least ``async_ps``'s throughput.

**The same result.** Rank 0 keeps the final weights of every trial; the table gives the largest difference of the
rebalanced row's from the plain row's of the same round (float reordering: the same samples in shares of other
sizes), where ``async_ps`` trains another model altogether (stale gradients).

``stragglers.png`` draws throughput over wall time, plain, rebalanced and async, in the throttle setting, the
slow-down marked.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_sync.bench.rows import FIT, fmt, median, node, pyplot, schedule
from lightning_sync.bench.runner import quiet
from lightning_sync.bench.tradeoff import validate_alone
from lightning_sync.diagnostics._comm import blocked_seconds
from lightning_sync.diagnostics._steps import optimizer_step_ended

__all__ = ["StragglerResult", "ideal_speedup", "run_stragglers", "stragglers_markdown"]

log = logging.getLogger("lightning_sync.bench")


@dataclass
class StragglerTrial:
    """One fit: row ``name`` at ``world`` ranks, rank 1 slowed ``factor`` times from step ``after``, round ``round``."""

    name: str
    world: int
    strategy: dict[str, Any]
    model_cfg: dict[str, Any]
    data_cfg: dict[str, Any]
    steps: int
    factor: float
    after: int
    round: int
    seed: int


class _Timeline(pl.Callback):
    """Per rank: the wall time at the end of every global step (the server's clock under ``async_ps``) and this rank's
    own compute seconds per optimizer step; rank 0 also keeps its final weights. Written as files in ``out``."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.times: list[float] = []
        self.busy: list[float] = []
        self.clock: list[int] = []
        self.share: list[float] = []  # rank 1's share of each micro-batch after every step, where rebalancing
        self._start: tuple[float, float] | None = None
        self._busy = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._start = (time.perf_counter(), blocked_seconds(trainer))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._start is not None:
            started, blocked = self._start
            self._busy += (time.perf_counter() - started) - (blocked_seconds(trainer) - blocked)
        if optimizer_step_ended(trainer):
            clock = getattr(trainer.strategy, "global_step", None)  # async_ps: pushes applied // K
            self.clock.append(int(clock) if isinstance(clock, int) else trainer.global_step)
            self.times.append(time.time())
            self.busy.append(self._busy)
            self._busy = 0.0
            rebalancer = getattr(getattr(trainer.strategy, "rebalance", None), "rebalancer", None)
            if rebalancer is not None:
                self.share.append(rebalancer.shares()[1])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank = trainer.global_rank
        record = {"rank": rank, "times": self.times, "busy": self.busy, "clock": self.clock, "share": self.share}
        Path(self.out, f"rank{rank}.json").write_text(json.dumps(record))
        if rank == 0:
            torch.save({k: v.detach().cpu() for k, v in pl_module.state_dict().items()}, Path(self.out, "weights.pt"))


def _fit(rank: int, world: int, trial: StragglerTrial, out: str) -> None:
    from hydra.utils import instantiate

    import lightning_sync  # noqa: F401 - registers the strategy names
    from lightning_sync.diagnostics import SlowRank

    quiet(1)
    pl.seed_everything(trial.seed, verbose=False)
    model, data = instantiate(trial.model_cfg), instantiate(trial.data_cfg)
    callbacks = [_Timeline(out), SlowRank(rank=1, factor=trial.factor, after_step=trial.after)]
    kw = {"devices": world, "strategy": instantiate(trial.strategy), "max_steps": trial.steps}
    pl.Trainer(accelerator="cpu", callbacks=callbacks, **kw, **FIT).fit(model, datamodule=data)
    if rank == 0:
        Path(out, "val_loss.json").write_text(json.dumps(validate_alone(model, data)["val_loss"]))


@dataclass
class StragglerResult:
    """One trial's figures: samples per second after the warm-up, the plain-step parts ``c`` and ``m`` (seconds), the
    progress ``(seconds from start, global step)`` and the largest weight difference from the same round's plain row."""

    name: str
    world: int
    setting: str
    round: int
    samples_per_s: float
    compute_s: float
    rest_s: float
    progress: list[tuple[float, int]] = field(default_factory=list)
    slow_at_s: float | None = None
    max_diff: float | None = None
    val_loss: float = float("nan")
    followed: int | None = None  # steps from the slow-down until rank 1's share first fell (throttle, rebalanced)


def ideal_speedup(world: int, factor: float, compute_s: float, rest_s: float) -> float:
    """The best split's speed-up over plain synchronous steps (module docstring)."""
    plain = factor * compute_s + rest_s
    return plain / (world * compute_s / (world - 1 + 1 / factor) + rest_s)


def _measure(trial: StragglerTrial, probes: list[dict[str, Any]], warmup: int, batch: int) -> StragglerResult:
    """A trial's figures from its ranks' timelines: counted from ``warmup`` (slow from the start) or from the
    slow-down (throttle: the adaptation included)."""
    zero = min(probes, key=lambda p: p["rank"])
    times, clock = zero["times"], zero["clock"]
    first = trial.after or warmup
    start = next(i for i, c in enumerate(clock) if c >= first)
    samples = (clock[-1] - clock[start]) * trial.world * batch
    per_step = [median(p["busy"][start:]) for p in probes]
    fast = [b for p, b in zip(probes, per_step) if p["rank"] != 1]
    slow = next(b for p, b in zip(probes, per_step) if p["rank"] == 1)
    wall = (times[-1] - times[start]) / max(1, clock[-1] - clock[start])
    progress = [(t - times[0], c) for t, c in zip(times, clock)]
    result = StragglerResult(
        trial.name,
        trial.world,
        "throttle" if trial.after else "slow",
        trial.round,
        samples / (times[-1] - times[start]),
        median(fast),
        wall - slow,
        progress,
        times[start] - times[0] if trial.after else None,
    )
    share = zero.get("share") or []
    if trial.after and len(share) > trial.after:
        before = share[trial.after - 1]
        result.followed = next((i - trial.after + 1 for i in range(trial.after, len(share)) if share[i] < before), None)
    return result


def _trials(cfg: Any) -> list[StragglerTrial]:
    s = cfg.stragglers
    m = s.model
    out = []
    for world in s.worlds:
        for after in (0, int(s.throttle_at)):
            for i, name in enumerate(schedule(list(s.rows), int(s.pairs))):
                args = (node(s.rows[name]), node(m.model), node(m.data), int(s.steps), float(s.slow_factor))
                out.append(StragglerTrial(str(name), int(world), *args, after, i // len(s.rows), int(s.seed)))
    return out


def run_stragglers(cfg: Any, out_dir: Path, meta: dict[str, Any] | None = None) -> list[StragglerResult]:
    """Every trial; ``stragglers.md``, ``.json`` and ``.png`` in ``out_dir``."""
    from lightning_sync.testing import run_distributed

    s = cfg.stragglers
    env = {"OMP_NUM_THREADS": "1", "PL_GLOBAL_SEED": str(int(s.seed))}
    results: list[StragglerResult] = []
    weights: dict[tuple[str, int, str, int], dict[str, torch.Tensor]] = {}
    trials = _trials(cfg)
    for n, trial in enumerate(trials, 1):
        log.info("stragglers %d/%d: %s at %d ranks (%s)", n, len(trials), trial.name, trial.world, trial.after)
        with tempfile.TemporaryDirectory(prefix="ls_stragglers_") as out:
            run_distributed(_fit, trial.world, trial, out, timeout=float(s.timeout_s), env=env, process_group=False)
            probes = [json.loads(f.read_text()) for f in sorted(Path(out).glob("rank*.json"))]
            final = torch.load(Path(out, "weights.pt"), weights_only=True)
            val_loss = json.loads(Path(out, "val_loss.json").read_text())
        result = _measure(trial, probes, int(s.warmup_steps), int(trial.data_cfg["batch_size"]))
        result.val_loss = val_loss
        weights[(trial.name, trial.world, result.setting, trial.round)] = final
        results.append(result)
    for r in results:
        plain = weights.get(("bucketed_ddp", r.world, r.setting, r.round))
        mine = weights[(r.name, r.world, r.setting, r.round)]
        if plain is not None and r.name != "bucketed_ddp":
            r.max_diff = max((mine[k].float() - plain[k].float()).abs().max().item() for k in plain)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "stragglers.md").write_text(stragglers_markdown(results, cfg, meta) + "\n")
    (out_dir / "stragglers.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    plot_stragglers(results, out_dir / "stragglers.png", cfg)
    return results


def _same_round(results: list[StragglerResult], r: StragglerResult, name: str) -> StragglerResult | None:
    return next(
        (o for o in results if (o.name, o.world, o.setting, o.round) == (name, r.world, r.setting, r.round)), None
    )


def _every(cfg: Any) -> str:
    return str((cfg.stragglers.rows.get("rebalanced") or {}).get("rebalance_every", "-"))


def _followed(rows: list[StragglerResult]) -> str:
    steps = [r.followed for r in rows if r.followed is not None]
    if not steps:
        return "-" if all(r.setting == "slow" or r.name != "rebalanced" for r in rows) else "never"
    return f"{min(steps)}-{max(steps)} steps" if min(steps) != max(steps) else f"{steps[0]} steps"


def stragglers_markdown(results: list[StragglerResult], cfg: Any, meta: dict[str, Any] | None = None) -> str:
    """The table (medians over rounds; ratios are same-round) and the goals, as Markdown."""
    s = cfg.stragglers
    f = float(s.slow_factor)
    lines = [f"## Stragglers: rank 1 at {f:g}x, {int(s.steps)} global steps, {int(s.pairs)} rounds", ""]
    if m := meta:
        lines += [f"Measured {m['date']} on {m['cpu']}. Command: `{m['command']}`", ""]
    lines += [
        "`c`: a fast rank's compute per step; `m`: the rest of a plain step (its wall time less the slow rank's "
        "compute). Ideal: the best split's speed-up from them; free: the same with `m = 0`. `x plain`: same-round "
        "throughput ratio (median, min-max). Slow: from the start, timed after the warm-up; throttle: rank 1 slows "
        "down mid-run, timed from then (the adaptation included). Val loss: the final model on the whole validation "
        "set; `max abs w - plain`: the final weights' largest difference from the same round's plain run; split "
        "followed: the steps from the slow-down to rank 1's share first falling.",
        "",
        "| ranks | setting | row | samples/s | x plain | ideal | free | x ideal | c ms | m ms | val loss | "
        "max abs w - plain | split followed |",
        "|---:|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    goals = []
    for world, setting, name in dict.fromkeys((r.world, r.setting, r.name) for r in results):
        rows = [r for r in results if (r.world, r.setting, r.name) == (world, setting, name)]
        plain = [p for r in rows if (p := _same_round(results, r, "bucketed_ddp")) is not None]
        ratios = [r.samples_per_s / p.samples_per_s for r, p in zip(rows, plain)]
        c, m = median([p.compute_s for p in plain]), median([p.rest_s for p in plain])
        ideal, free = ideal_speedup(world, f, c, m), ideal_speedup(world, f, c, 0.0)
        x = median(ratios)
        spread = f"{x:.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-"
        diffs = [r.max_diff for r in rows if r.max_diff is not None]
        lines.append(
            f"| {world} | {setting} | {name} | {median([r.samples_per_s for r in rows]):.0f} | {spread} | "
            f"{ideal:.2f} | {free:.2f} | {fmt(x / ideal, '.2f')} | {1e3 * c:.1f} | {1e3 * m:.1f} | "
            f"{median([r.val_loss for r in rows]):.5f} | {fmt(max(diffs) if diffs else float('nan'), '.1e')} | "
            f"{_followed(rows)} |"
        )
        if name == "rebalanced":
            asyncs = [a for r in rows if (a := _same_round(results, r, "async_ps")) is not None]
            vs_async = median([r.samples_per_s / a.samples_per_s for r, a in zip(rows, asyncs)])
            if setting == "slow":
                goals.append(
                    f"- {world} ranks, slow from the start: x{x:.2f} of plain against the ideal x{ideal:.2f}: "
                    f"{x / ideal:.3f} of it (goal 0.9: {'met' if x >= 0.9 * ideal else 'MISSED'}); "
                    f"x{fmt(vs_async, '.2f')} of async_ps (goal 1: {'met' if vs_async >= 1 else 'MISSED'})"
                )
            else:
                goals.append(
                    f"- {world} ranks, slowed mid-run: the split followed {_followed(rows)} after the slow-down "
                    f"(rebalance_every: {_every(cfg)}); over the steps since, the adaptation included, x{x:.2f} of "
                    f"plain, {x / ideal:.3f} of the ideal, x{fmt(vs_async, '.2f')} of async_ps"
                )
    return "\n".join([*lines, "", "Goals:", "", *goals])


def plot_stragglers(results: list[StragglerResult], path: Path, cfg: Any) -> None:
    """Throughput over wall time in the throttle setting, one panel per world size, round 0; the slow-down marked."""
    plt = pyplot()
    worlds = sorted({r.world for r in results if r.setting == "throttle"})
    fig, axes = plt.subplots(1, max(1, len(worlds)), figsize=(6 * max(1, len(worlds)), 3.8), squeeze=False)
    batch, every = int(cfg.stragglers.model.data.batch_size), 5
    for ax, world in zip(axes[0], worlds):
        for r in (r for r in results if (r.world, r.setting, r.round) == (world, "throttle", 0)):
            pts = r.progress[::every]
            xs = [(a[0] + b[0]) / 2 for a, b in zip(pts, pts[1:])]
            ys = [(b[1] - a[1]) * world * batch / (b[0] - a[0]) for a, b in zip(pts, pts[1:]) if b[0] > a[0]]
            ax.plot(xs[: len(ys)], ys, label=r.name)
            if r.slow_at_s is not None and r.name == "bucketed_ddp":
                ax.axvline(r.slow_at_s, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel("wall time (s); dashed: rank 1 slows down (plain run)")
        ax.set_ylabel("samples/s")
        ax.set_title(f"{world} ranks, rank 1 slows {float(cfg.stragglers.slow_factor):g}x mid-run")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
