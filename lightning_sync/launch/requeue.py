"""Requeue on preemption: save a checkpoint atomically, requeue the SLURM job, exit; the requeued job resumes
exactly where the signal stopped it.

Slurm warns a job before it ends it: ``#SBATCH --signal=USR1@90`` sends SIGUSR1 90 s before the time
limit, and an administrator (or a test) sends it with ``scancel --signal=USR1``. :class:`RequeueOnSignal`
turns that signal into a clean stop:

1. **The handler only sets a flag.** Saving from inside a signal handler would run a collective at an
   arbitrary point of one rank's step while the others are elsewhere (Lightning issue #21406); here the
   ranks act at the next optimizer-step boundary instead.
2. **The ranks agree.** After every optimizer step (never between the micro-batches of an accumulated
   step, whose gradients a checkpoint does not hold, and never on the last batch of an epoch) every rank
   calls ``strategy.reduce_boolean_decision(flag, all=False)``: one signalled rank stops them all at the
   same step. One scalar all-reduce per step.
3. **Atomic save.** ``trainer.save_checkpoint`` (every rank takes part; sharded strategies write their
   shards) writes ``.requeue-stepN.ckpt.tmp``; rank 0 fsyncs it, renames it to ``requeue-stepN.ckpt``
   and only then moves ``latest.json`` (itself written to a temporary name, fsynced and renamed) to point
   at it. A job killed at any moment leaves the previous complete checkpoint named by ``latest.json``.
4. **Requeue.** Rank 0 runs ``scontrol requeue <job id>``. Without ``scontrol`` (or outside Slurm) it
   says so in one log line and the checkpoint is still there; a failing ``scontrol`` is logged with its
   message. Slurm ends the running step as soon as it accepts the requeue, so SIGTERM can land while
   ``scontrol`` still waits for its answer. Two things would then go wrong, and both are guarded
   against:

   - ``scontrol`` itself is in the step and would die of the SIGTERM, which reads as a failed requeue.
     It runs with SIGTERM ignored (:func:`requeue_job`).
   - Lightning's SIGTERM handler (2.6) runs a ``broadcast`` from inside the handler. On rank 0 that
     broadcast would meet the other ranks' ``requeue_published`` barrier, a different collective, and
     both would hang until Slurm's SIGKILL, before the outcome is logged. So every rank defers SIGTERM
     (:func:`deferred_signal`) from the requeue to the end of that barrier. Then it is re-raised on every
     rank at the same point, and the handlers' broadcasts meet each other.
5. **Exit cleanly.** ``trainer.should_stop`` ends fit; :attr:`RequeueOnSignal.preempted` tells the app
   not to report final metrics for a run that did not finish.

**Exact resume.** The requeued job (same job id, so the same run directory) finds ``latest.json``
(:func:`latest_checkpoint`) and fits with ``ckpt_path`` on it. The preemption checkpoint is an ordinary
checkpoint: Lightning restores the weights, the optimizer, the LR schedulers and the loop counters, and a
lightning_sync strategy restores the rest, the training loader's position in the epoch and every rank's
RNG streams (:mod:`lightning_sync.resume`), as for any other checkpoint. Final weights then equal an
uninterrupted run's. Under another strategy the checkpoint holds Lightning's state only (the epoch restarts
from its first batch, the RNG streams keep their seeding), which :class:`RequeueOnSignal` says at setup.

Lightning's own SLURM auto-requeue (``SLURMEnvironment(auto_requeue=True)``: it saves from inside the
handler and restarts the epoch) must be off; the train app passes ``SLURMEnvironment(auto_requeue=False)``.
Pitfalls from Lightning's tracker handled here: #21406 (work inside the signal handler), #21404 (a
hard-coded SIGUSR1; a missing ``scontrol`` ending the job without a checkpoint), #15022 (an array job must
be requeued as ``<array job id>_<task id>``, not its whole array) and #2397 (mid-epoch resume).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_sync._lightning import should_accumulate
from lightning_sync.checkpoint.reading import contained_path
from lightning_sync.launch.atomic import publish_path, recover_dir, remove_path, write_atomically
from lightning_sync.launch.signals import resolve_signal
from lightning_sync.strategies._exact_data import ExactData
from lightning_sync.sync.zero.format import COMPLETE_MARKER, LIGHTNING_STATE

__all__ = [
    "POINTER",
    "Preempted",
    "RequeueOnSignal",
    "deferred_signal",
    "latest_checkpoint",
    "newest_checkpoint",
    "publish_checkpoint",
    "recorded_step",
    "requeue_job",
    "resolve_signal",
]

log = logging.getLogger("lightning_sync.launch")
POINTER = "latest.json"
_PREFIX = "requeue-step"


class Preempted(Exception):
    """Raised by the train app after a preemption stop: the run did not finish, so it reports no final metrics."""


# --------------------------------------------------------------------------- atomic files
def publish_checkpoint(
    directory: str | os.PathLike[str], tmp: str | os.PathLike[str], name: str, info: Mapping[str, Any] | None = None
) -> Path:
    """Make the complete checkpoint ``tmp`` (file or directory) the one :func:`latest_checkpoint` returns.

    fsync ``tmp``, rename it to ``directory/name``, then atomically rewrite ``latest.json`` to name it, then
    remove older ``requeue-step*`` checkpoints. A crash before the pointer moves leaves the previous one."""
    directory, tmp = Path(directory), Path(tmp)
    final = directory / name
    publish_path(tmp, final)
    pointer = json.dumps({"checkpoint": name, **(info or {})}, sort_keys=True).encode()
    write_atomically(directory / POINTER, lambda f: f.write(pointer))
    for old in directory.glob(f"{_PREFIX}*"):
        if old.name != name:
            remove_path(old)
    return final


def recorded_step(path: str | os.PathLike[str]) -> int:
    """The global step the complete checkpoint ``path`` recorded, read weights-only without loading its tensors
    (a file through ``mmap``; a sharded directory's Lightning state). ``ValueError`` naming the path when it
    is not a complete checkpoint that loads weights-only (truncated, killed mid-save, not a checkpoint)."""
    path = Path(path)
    state_file = path
    if path.is_dir():
        if not (path / COMPLETE_MARKER).is_file():
            raise ValueError(
                f"{path} is not a complete checkpoint: a sharded directory without its "
                f"{COMPLETE_MARKER} marker (its save was interrupted)"
            )
        state_file = contained_path(path, LIGHTNING_STATE, "Lightning state file")
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001 - truncated, foreign or unsafe: not a checkpoint to resume
        raise ValueError(
            f"{path} is not a complete checkpoint that loads weights-only ({type(err).__name__}: "
            f"{str(err).strip().splitlines()[0][:200] if str(err).strip() else ''})"
        ) from err
    step = state.get("global_step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError(f"{path} is not a complete checkpoint: it records no global_step")
    return step


def newest_checkpoint(candidates: Sequence[str | os.PathLike[str]]) -> tuple[Path, int] | None:
    """The complete checkpoint among ``candidates`` with the highest recorded step, and that step (the first
    of equals); None when none is complete. Incomplete ones are passed over, each said in a log line."""
    best: tuple[Path, int] | None = None
    for candidate in map(Path, candidates):
        try:
            step = recorded_step(candidate)
        except ValueError as err:
            log.warning("resume: passing over %s", err)
            continue
        if best is None or step > best[1]:
            best = (candidate, step)
    return best


def latest_checkpoint(directory: str | os.PathLike[str] | None) -> Path | None:
    """The newest complete preemption checkpoint in ``directory`` by its recorded step, or None (a first run).

    ``latest.json`` is only a hint: a save killed between publishing its checkpoint and moving the pointer
    leaves a newer complete checkpoint than the one named, and that one wins. A pointer naming a checkpoint
    that is gone, with nothing as new left, raises ``FileNotFoundError`` naming both: resuming from scratch
    silently would throw the preempted work away."""
    if directory is None:
        return None
    directory = Path(directory)
    if directory.is_dir():
        recover_dir(directory)  # a replacement killed midway: its old copy is the checkpoint
    newest = newest_checkpoint(sorted(directory.glob(f"{_PREFIX}*.ckpt"))) if directory.is_dir() else None
    pointer = directory / POINTER
    if pointer.is_file():
        named = json.loads(pointer.read_text())
        path = directory / named["checkpoint"]
        if not path.exists() and (newest is None or newest[1] < int(named.get("global_step", 0))):
            raise FileNotFoundError(
                f"{pointer} names the checkpoint {path}, which does not exist"
                + (f"; the newest left is {newest[0]} (step {newest[1]})" if newest else "")
            )
    return None if newest is None else newest[0]


# --------------------------------------------------------------------------- requeue
def _job_id(env: Mapping[str, str]) -> str | None:
    array_job, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return env.get("SLURM_JOB_ID")


@contextmanager
def deferred_signal(signum: int = signal.SIGTERM) -> Iterator[list[int]]:
    """Hold ``signum`` back for the body, then hand it to the handler that was there before, once.

    Python runs a handler in the main thread between bytecodes, so a handler that itself runs a collective
    (Lightning's SIGTERM handler) can start in the middle of another one. Inside this block ``signum`` is
    only counted; on leaving it, the previous handler is back and, if the signal came, it is raised again.
    Yields the list of signals held back. Off the main thread (no Python handlers there) it holds nothing.
    """
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    previous = signal.signal(signum, lambda number, frame: held.append(number))
    try:
        yield held
    finally:
        # None: a handler set outside Python, which Python cannot put back; the default action stands in
        signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        if held:
            signal.raise_signal(signum)


# ``trap '' TERM`` sets SIGTERM to ignored, which survives exec: Slurm's SIGTERM to the step then cannot cut
# scontrol off between its request and the answer (Python cannot set that in the child: a handler is reset
# by exec, and preexec_fn is unsafe with the process group's threads)
_IGNORING_SIGTERM = ("/bin/sh", "-c", 'trap "" TERM; exec "$0" "$@"')


def requeue_job(env: Mapping[str, str] | None = None, timeout: float = 60.0) -> bool:
    """``scontrol requeue`` this SLURM job; True on success. Every outcome is one log line, none raises.

    ``scontrol`` runs with SIGTERM ignored: Slurm ends the step, and with it this child, as soon as it
    accepts the requeue, possibly before ``scontrol`` has read the answer.
    """
    env = os.environ if env is None else env
    job = _job_id(env)
    if job is None:
        log.warning("requeue: not a SLURM job (no SLURM_JOB_ID): the checkpoint is saved, nothing is requeued")
        return False
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol is None:
        log.error(
            "requeue: scontrol is not on PATH, so job %s is NOT requeued; the checkpoint is saved: "
            "resubmit the same job and it resumes from it",
            job,
        )
        return False
    try:
        proc = subprocess.run(
            [*_IGNORING_SIGTERM, scontrol, "requeue", job],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(env),
            check=False,
        )
    except subprocess.TimeoutExpired:
        log.error("requeue: `scontrol requeue %s` did not answer in %.0f s; the checkpoint is saved", job, timeout)
        return False
    if proc.returncode != 0:
        log.error(
            "requeue: `scontrol requeue %s` failed (exit %d): %s; the checkpoint is saved",
            job,
            proc.returncode,
            (proc.stderr or proc.stdout).strip(),
        )
        return False
    log.info("requeue: job %s requeued (scontrol requeue); it resumes from the checkpoint", job)
    return True


class RequeueOnSignal(pl.Callback):
    """On ``signal`` (any rank): save a checkpoint atomically into ``directory``, requeue, stop (module docstring).

    Args:
        directory: where the preemption checkpoints and ``latest.json`` go; the requeued job must see the
            same directory (the SLURM config derives it from the job id).
        signal: ``"USR1"`` (Slurm's ``--signal`` default here), ``"USR2"``, ``"TERM"``, ... or a number.
        requeue: run ``scontrol requeue`` after saving (False: save and stop only).
    """

    def __init__(self, directory: str | os.PathLike[str], signal: Any = "USR1", requeue: bool = True) -> None:
        if not isinstance(requeue, bool):
            raise ValueError(f"requeue must be True or False, got {requeue!r}")
        if directory is None or str(directory) == "":
            raise ValueError(f"directory must be a path for the preemption checkpoints, got {directory!r}")
        self.directory = Path(directory)
        self.signal = resolve_signal(signal)
        self.requeue = requeue
        self.preempted = False
        self.checkpoint: Path | None = None
        self.requeued = False
        self._received: float | None = None
        self._previous: Any = None
        self._installed = False

    # ------------------------------------------------------------------ signal
    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._received is None:  # only a flag: the ranks act together at the next step boundary
            self._received = time.monotonic()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._installed:
            return
        if not isinstance(getattr(trainer.strategy, "exact_data", None), ExactData) and trainer.is_global_zero:
            log.warning(
                "requeue: %s is not a lightning_sync strategy, so a preemption checkpoint holds Lightning's "
                "state only: a resume restarts the epoch from its first batch and the RNG streams keep "
                "their seeding",
                type(trainer.strategy).__name__,
            )
        if threading.current_thread() is not threading.main_thread():
            log.warning("requeue: not on the main thread, so no %s handler (Python signals need it)", self.signal.name)
            return
        self._previous = signal.signal(self.signal, self._on_signal)
        self._installed = True

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self._installed:
            signal.signal(self.signal, self._previous)
            self._installed = False

    # ------------------------------------------------------------------ the stop
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if should_accumulate(trainer) or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return  # the same on every rank: mid-accumulation or epoch end, act at the next step instead
        if not trainer.strategy.reduce_boolean_decision(self._received is not None, all=False):
            return
        self._preempt(trainer, batch_idx)

    def _preempt(self, trainer: pl.Trainer, batch_idx: int) -> None:
        started = time.monotonic()
        if trainer.is_global_zero:
            seen = f"here {started - self._received:.2f} s ago" if self._received is not None else "by another rank"
            log.warning(
                "requeue: %s received %s; saving at global step %d (epoch %d, batch %d)",
                self.signal.name,
                seen,
                trainer.global_step,
                trainer.current_epoch,
                batch_idx + 1,
            )
        name = f"{_PREFIX}{trainer.global_step:09d}.ckpt"
        tmp = self.directory / f".{name}.tmp"
        if trainer.is_global_zero:
            self.directory.mkdir(parents=True, exist_ok=True)
            remove_path(tmp)  # a half-written file from a save that was itself killed
        trainer.strategy.barrier("requeue_prepare")
        trainer.save_checkpoint(tmp)
        trainer.strategy.barrier("requeue_saved")
        with deferred_signal(signal.SIGTERM):  # Slurm's SIGTERM for the requeue: after the barrier (docstring)
            if trainer.is_global_zero:
                final = publish_checkpoint(self.directory, tmp, name, {"global_step": trainer.global_step})
                log.warning("requeue: checkpoint %s written in %.2f s", final, time.monotonic() - started)
                if self.requeue:
                    self.requeued = requeue_job()
            trainer.strategy.barrier("requeue_published")
        self.checkpoint = self.directory / name
        self.preempted = True
        trainer.should_stop = True
