"""The goodput table: how much training a job keeps when a rank process is SIGKILLed every ``goodput.fail_every_s``
seconds, live (the fault-tolerance agent: survivors replay the step, a replacement heals) against the restart path
(the job ends on a lost rank, and is launched again from its newest checkpoint), each against its own run without
failures, with the cost model's prediction beside each.

Every run is ``lightning-sync train`` on ``goodput.devices`` ranks for ``goodput.steps`` steps of one model, with a
checkpoint every ``goodput.checkpoint_every`` steps in both paths. The bench kills a rank process from outside, as
a crash would: under the agent any member (rank 0 included), on the restart path rank 1 (Lightning's launcher
starts ranks 1.. as children of rank 0). The restart path is launched again with ``ckpt_path=last`` until the run
ends. Goodput is the failure-free run's wall time over the failing run's, for the same steps.

**The prediction** is per failure, from the failure-free runs' own figures: live, the replacement's start (the
time from launch to the first step, during which the survivors train at ``(K-1)/K`` of the full rate) plus the
replay; restart, the relaunch (the same start time), the lost rank's detection (the hang watchdog's heartbeat,
about 2 s) and the half checkpoint interval trained again on average. With ``L`` seconds lost per failure and a
failure every ``T`` seconds the goodput is ``T / (T + L)``; the table gives it at the bench's ``T`` and at
``goodput.report_every_s`` (60 s).

:class:`ProgressLog` is the callback each run carries: rank 0 appends the time and the global step to a file, which
the plot draws (progress against wall time, failures marked).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_sync.bench.rows import fmt, pyplot

__all__ = ["GoodputRun", "ProgressLog", "goodput_markdown", "run_goodput"]

log = logging.getLogger("lightning_sync.bench")
_DETECT_S = 2.0  # the hang watchdog's heartbeat notices a lost rank within about this (docs/reliability.md)


class ProgressLog(pl.Callback):
    """Rank 0 appends ``<unix time> <global step>`` to ``path`` every ``every`` steps (a line per write, flushed)."""

    def __init__(self, path: str, every: int = 10) -> None:
        self.path, self.every = path, every

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.is_global_zero and trainer.global_step % self.every == 0:
            with open(self.path, "a") as file:
                file.write(f"{time.time():.3f} {trainer.global_step}\n")


@dataclass
class GoodputRun:
    """One run: its wall time, the failures injected (seconds from its start) and its progress."""

    name: str
    live: bool
    wall_s: float
    failures: list[float] = field(default_factory=list)
    launches: int = 1
    progress: list[tuple[float, int]] = field(default_factory=list)  # (seconds from the start, global step)

    @property
    def start_s(self) -> float:
        """Seconds from the launch to the first step logged."""
        return self.progress[0][0] if self.progress else float("nan")


def _command(cfg: Any, run_dir: Path, live: bool, resume: bool) -> list[str]:
    g = cfg.goodput
    callback = f"{{_target_: {ProgressLog.__module__}.ProgressLog, path: '{run_dir / 'progress.txt'}', every: 10}}"
    command = [sys.executable, "-m", "lightning_sync", "train", f"hydra.run.dir={run_dir}"]
    command += [f"model={g.model}", f"trainer.devices={g.devices}", f"trainer.max_steps={g.steps}"]
    command += ["trainer.max_epochs=-1", f"checkpoint.every_n_train_steps={g.checkpoint_every}"]
    command += ["trainer.enable_progress_bar=false", "final_validate=false", f"+trainer.callbacks=[{callback}]"]
    if live:
        command += ["launch.fault_tolerant=true", f"launch.max_restarts={g.max_restarts}"]
    return command + (["ckpt_path=last"] if resume else [])


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as file:
            return [int(c) for c in file.read().split()]
    except OSError:
        return []


def _victim(root: int, live: bool, k: int) -> int | None:
    """The rank process to kill: under the agent (the root) its ``k``-th child in turn, on the restart path rank
    1 (the first child of rank 0, the root)."""
    ranks = _children(root)
    if not ranks:
        return None
    return ranks[k % len(ranks)] if live else ranks[0]


def _run(cfg: Any, out: Path, name: str, live: bool, failing: bool) -> GoodputRun:
    """Launch the run (again from its newest checkpoint after a lost rank, on the restart path) until it ends,
    killing a rank process every ``fail_every_s`` seconds when ``failing``."""
    g, run_dir = cfg.goodput, out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PL_GLOBAL_SEED": "0"}
    started = time.monotonic()
    run, resume = GoodputRun(name, live, 0.0), False
    next_kill = started + float(g.fail_every_s)
    while True:
        with open(run_dir / f"launch{run.launches}.log", "w") as output:
            process = subprocess.Popen(_command(cfg, run_dir, live, resume), env=env, stdout=output, stderr=output)
            while process.poll() is None:
                if time.monotonic() - started > float(g.timeout_s):
                    process.kill()
                    raise RuntimeError(f"goodput: {name} did not finish within {g.timeout_s} s ({run_dir})")
                if failing and time.monotonic() >= next_kill:
                    victim = _victim(process.pid, live, len(run.failures))
                    if victim is not None:
                        os.kill(victim, signal.SIGKILL)
                        run.failures.append(time.monotonic() - started)
                        log.info("goodput: %s: killed pid %d at %.1f s", name, victim, run.failures[-1])
                    next_kill += float(g.fail_every_s)
                time.sleep(0.05)
        if process.returncode == 0:
            break
        if live or not failing:
            raise RuntimeError(f"goodput: {name} failed with status {process.returncode} ({run_dir})")
        run.launches, resume = run.launches + 1, True  # the restart path: again from last.ckpt
    run.wall_s = time.monotonic() - started
    run.progress = _progress(run_dir / "progress.txt", started - time.monotonic() + time.time())
    return run


def _progress(path: Path, start_unix: float) -> list[tuple[float, int]]:
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    return [(float(t) - start_unix, int(s)) for t, s in rows]


def predicted_lost_s(clean: GoodputRun, live: bool, cfg: Any) -> float:
    """Seconds a failure costs, from the failure-free run's figures (module docstring)."""
    g = cfg.goodput
    step_s = (clean.wall_s - clean.start_s) / int(g.steps)
    if live:
        return clean.start_s / int(g.devices) + 0.1  # at (K-1)/K while the replacement starts; the replay
    return clean.start_s + _DETECT_S + int(g.checkpoint_every) / 2 * step_s


def goodput(clean: GoodputRun, failing: GoodputRun) -> float:
    return clean.wall_s / failing.wall_s


def goodput_markdown(runs: dict[str, GoodputRun], cfg: Any, meta: dict[str, Any] | None = None) -> str:
    g = cfg.goodput
    head = (
        f"## Goodput: a rank process SIGKILLed every {g.fail_every_s:g} s\n\n"
        f"`lightning-sync train model={g.model}` on {g.devices} ranks, {g.steps} steps, a checkpoint every "
        f"{g.checkpoint_every} steps; {meta.get('date', '') if meta else ''} {meta.get('cpu', '') if meta else ''}\n\n"
        "| path | failure-free s | with failures s | failures | launches | goodput | lost per failure s | "
        f"predicted lost s | predicted goodput | goodput at a failure every {g.report_every_s:g} s |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for live, label in ((True, "live (agent)"), (False, "restart from checkpoint")):
        clean, failing = runs[f"{'live' if live else 'restart'}_clean"], runs[f"{'live' if live else 'restart'}"]
        n = max(len(failing.failures), 1)
        lost = (failing.wall_s - clean.wall_s) / n
        predicted = predicted_lost_s(clean, live, cfg)
        every = float(g.fail_every_s)
        cells = [
            fmt(clean.wall_s, ".1f"),
            fmt(failing.wall_s, ".1f"),
            str(len(failing.failures)),
            str(failing.launches),
        ]
        cells += [fmt(goodput(clean, failing), ".3f"), fmt(lost, ".2f"), fmt(predicted, ".2f")]
        cells += [fmt(every / (every + predicted), ".3f"), fmt(g.report_every_s / (g.report_every_s + lost), ".3f")]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return head + "\n".join(lines)


def _plot(runs: dict[str, GoodputRun], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs.values():
        t, s = [p[0] for p in run.progress], [p[1] for p in run.progress]
        (line,) = ax.plot(t, s, label=run.name.replace("_", " "), linestyle="-" if run.failures else ":")
        for x in run.failures:
            ax.axvline(x, color=line.get_color(), alpha=0.3, linewidth=1)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("global step")
    ax.set_title("Progress with a rank SIGKILLed periodically (vertical lines)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_goodput(cfg: Any, out_dir: Path, meta: dict[str, Any] | None = None) -> dict[str, GoodputRun]:
    """The four runs, failure-free and failing alternating per path; ``goodput.md``, ``goodput.json`` and
    ``goodput.png`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, GoodputRun] = {}
    for name, live, failing in (
        ("live_clean", True, False),
        ("live", True, True),
        ("restart_clean", False, False),
        ("restart", False, True),
    ):
        log.info("goodput: %s", name)
        runs[name] = _run(cfg, out_dir / "runs", name, live, failing)
    (out_dir / "goodput.md").write_text(goodput_markdown(runs, cfg, meta) + "\n")
    (out_dir / "goodput.json").write_text(json.dumps({n: asdict(r) for n, r in runs.items()}, indent=1))
    _plot(runs, out_dir / "goodput.png")
    return runs
