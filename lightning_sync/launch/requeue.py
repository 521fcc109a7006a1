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
(:func:`latest_checkpoint`) and fits with ``ckpt_path`` on it. Lightning restores the weights, the
optimizer, the LR schedulers and the loop counters, but for an ordinary ``DataLoader`` it restarts the
epoch from its first batch (issue #2397). This callback records how many batches of the epoch were
trained and, on resume, makes the epoch's sampler skip exactly those indices
(:func:`skip_batches`; the ``DistributedSampler`` permutation comes from seed and epoch, so it is the
same one). It also restores every rank's RNG states: torch's CPU generator, the rank's CUDA generator on
a CUDA strategy (GPU dropout draws from it), and Python's ``random`` and NumPy's global generator
(:func:`host_rng_state`), which augmentations and samplers of user code draw from. Final weights then equal an uninterrupted run's.

Lightning's own SLURM auto-requeue (``SLURMEnvironment(auto_requeue=True)``: it saves from inside the
handler and restarts the epoch) must be off; the train app passes ``SLURMEnvironment(auto_requeue=False)``.
Pitfalls from Lightning's tracker handled here: #21406 (work inside the signal handler), #21404 (a
hard-coded SIGUSR1; a missing ``scontrol`` ending the job without a checkpoint), #15022 (an array job must
be requeued as ``<array job id>_<task id>``, not its whole array) and #2397 (mid-epoch resume).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

from lightning_sync.launch.atomic import publish_path, remove_path, write_atomically

__all__ = ["POINTER", "Preempted", "RequeueOnSignal", "deferred_signal", "host_rng_state", "latest_checkpoint",
           "publish_checkpoint", "requeue_job", "resolve_signal", "set_host_rng_state", "skip_batches"]

log = logging.getLogger("lightning_sync.launch")
POINTER = "latest.json"
_PREFIX = "requeue-step"
_ALLOWED_SIGNALS = ("USR1", "USR2", "TERM", "INT", "HUP", "CONT", "URG", "XCPU")


def resolve_signal(value: Any) -> signal.Signals:
    """``"USR1"``, ``"SIGUSR1"``, ``10`` or ``signal.SIGUSR1`` -> ``signal.SIGUSR1``; anything else: ValueError."""
    if isinstance(value, signal.Signals):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return signal.Signals(value)
        except ValueError:
            pass
    elif isinstance(value, str):
        name = value.strip().upper().removeprefix("SIG")
        if name in _ALLOWED_SIGNALS:
            return signal.Signals[f"SIG{name}"]
    raise ValueError(f"signal must be one of {list(_ALLOWED_SIGNALS)} (or its number), got {value!r}")


def host_rng_state() -> torch.Tensor:
    """Python's ``random`` and NumPy's global Mersenne Twister states as one float64 tensor (every
    field is an integer below 2**53 or a float64, so the packing is exact), for an all-gather.

    Layout: Python's version, its 625 words, whether a Gaussian is cached and its value; NumPy's 624
    keys, position, whether a Gaussian is cached and its value (1255 numbers).
    """
    version, words, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    py = [float(version), *map(float, words), float(gauss is not None), 0.0 if gauss is None else float(gauss)]
    return torch.tensor([*py, *map(float, keys), float(pos), float(has_gauss), float(cached)], dtype=torch.float64)


def set_host_rng_state(state: torch.Tensor) -> None:
    """Restore what :func:`host_rng_state` returned (raises ``ValueError`` for a tensor of another length)."""
    values = state.reshape(-1).double().tolist()
    if len(values) != _HOST_RNG_NUMEL:
        raise ValueError(f"a host RNG state holds {_HOST_RNG_NUMEL} numbers, got {len(values)}")
    words = tuple(int(v) for v in values[1:626])
    random.setstate((int(values[0]), words, values[627] if values[626] else None))
    keys = np.array([int(v) for v in values[628:1252]], dtype=np.uint32)
    np.random.set_state(("MT19937", keys, int(values[1252]), int(values[1253]), values[1254]))


_HOST_RNG_NUMEL = 1 + 625 + 2 + 624 + 3


class Preempted(Exception):
    """Raised by the train app after a preemption stop: the run did not finish, so it reports no final metrics."""


# --------------------------------------------------------------------------- atomic files
def publish_checkpoint(directory: str | os.PathLike[str], tmp: str | os.PathLike[str], name: str,
                       info: Mapping[str, Any] | None = None) -> Path:
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


def latest_checkpoint(directory: str | os.PathLike[str] | None) -> Path | None:
    """The checkpoint ``latest.json`` in ``directory`` names, or None when there is none yet (a first run).

    A pointer naming a checkpoint that is gone raises ``FileNotFoundError`` naming both: resuming from
    scratch silently would throw the preempted work away."""
    if directory is None:
        return None
    pointer = Path(directory) / POINTER
    if not pointer.is_file():
        return None
    name = json.loads(pointer.read_text())["checkpoint"]
    path = Path(directory) / name
    if not path.exists():
        raise FileNotFoundError(f"{pointer} names the checkpoint {path}, which does not exist")
    return path


# --------------------------------------------------------------------------- exact mid-epoch resume
class _SkipFirst(torch.utils.data.Sampler):  # type: ignore[type-arg]
    """The wrapped sampler without its first ``skip`` indices, once (the resumed epoch); full length after."""

    def __init__(self, sampler: Any, skip: int) -> None:
        self.sampler = sampler
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.sampler), skip, None)

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def skip_batches(loader: Any, batches: int) -> None:
    """Make the next iteration of ``loader`` start after its first ``batches`` batches, without loading them.

    Needs a map-style ``DataLoader`` batched by a ``BatchSampler`` (what ``batch_size=`` builds, and what
    Lightning re-creates with its ``DistributedSampler``); anything else raises ``TypeError`` naming it."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    batch_size = getattr(batch_sampler, "batch_size", None)
    if batch_sampler is None or not hasattr(batch_sampler, "sampler") or not isinstance(batch_size, int):
        raise TypeError(f"cannot resume mid-epoch on {type(loader).__name__}: exact resume needs a map-style "
                        f"DataLoader with batch_size (a BatchSampler), got batch_sampler "
                        f"{type(batch_sampler).__name__}")
    batch_sampler.sampler = _SkipFirst(batch_sampler.sampler, batches * batch_size)


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
        log.error("requeue: scontrol is not on PATH, so job %s is NOT requeued; the checkpoint is saved: "
                  "resubmit the same job and it resumes from it", job)
        return False
    try:
        proc = subprocess.run([*_IGNORING_SIGTERM, scontrol, "requeue", job], capture_output=True, text=True, timeout=timeout,
                              env=dict(env), check=False)
    except subprocess.TimeoutExpired:
        log.error("requeue: `scontrol requeue %s` did not answer in %.0f s; the checkpoint is saved", job, timeout)
        return False
    if proc.returncode != 0:
        log.error("requeue: `scontrol requeue %s` failed (exit %d): %s; the checkpoint is saved", job,
                  proc.returncode, (proc.stderr or proc.stdout).strip())
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
        self._state: dict[str, Any] = {}
        self._resume: dict[str, Any] = {}

    # ------------------------------------------------------------------ signal
    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._received is None:  # only a flag: the ranks act together at the next step boundary
            self._received = time.monotonic()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._installed:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("requeue: not on the main thread, so no %s handler (Python signals need it)",
                        self.signal.name)
            return
        self._previous = signal.signal(self.signal, self._on_signal)
        self._installed = True

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self._installed:
            signal.signal(self.signal, self._previous)
            self._installed = False

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        return dict(self._state)  # empty except in the preemption checkpoint

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume = dict(state_dict)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state, self._resume = self._resume, {}
        if not state:
            return
        rng, host = state.get("rng"), state.get("host_rng")
        if rng is not None and rng.shape[0] == trainer.world_size:
            torch.set_rng_state(rng[trainer.global_rank].clone())
            if host is not None:  # absent from checkpoints written before it was saved
                set_host_rng_state(host[trainer.global_rank])
            self._restore_cuda_rng(trainer, state.get("cuda_rng"))
        elif rng is not None:
            log.warning("requeue: checkpoint from %d ranks, now %d: RNG states not restored", rng.shape[0],
                        trainer.world_size)
        if state.get("epoch") == trainer.current_epoch and state.get("batches", 0) > 0:
            for loader in trainer.fit_loop._combined_loader.flattened:  # type: ignore[union-attr]
                skip_batches(loader, int(state["batches"]))
            if trainer.is_global_zero:
                log.info("requeue: resuming epoch %d at batch %d (global step %d); the %d batches already trained "
                         "are skipped", trainer.current_epoch, state["batches"], trainer.global_step,
                         state["batches"])

    @staticmethod
    def _restore_cuda_rng(trainer: pl.Trainer, cuda: torch.Tensor | None) -> None:
        if cuda is None:  # saved on CPU, or before the CUDA state was saved
            return
        device = trainer.strategy.root_device
        if device.type != "cuda":
            log.warning("requeue: the checkpoint holds CUDA RNG states but this run is on %s: not restored", device)
            return
        torch.cuda.set_rng_state(cuda[trainer.global_rank].clone(), device)

    # ------------------------------------------------------------------ the stop
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        if epoch_loop._should_accumulate() or epoch_loop.batch_progress.is_last_batch:
            return  # the same on every rank: mid-accumulation or epoch end, act at the next step instead
        if not trainer.strategy.reduce_boolean_decision(self._received is not None, all=False):
            return
        self._preempt(trainer, batch_idx)

    def _preempt(self, trainer: pl.Trainer, batch_idx: int) -> None:
        started = time.monotonic()
        if trainer.is_global_zero:
            seen = (f"here {started - self._received:.2f} s ago" if self._received is not None
                    else "by another rank")
            log.warning("requeue: %s received %s; saving at global step %d (epoch %d, batch %d)",
                        self.signal.name, seen, trainer.global_step, trainer.current_epoch, batch_idx + 1)
        device = trainer.strategy.root_device  # NCCL gathers device tensors only
        rng, host = torch.get_rng_state(), host_rng_state()
        gathered = trainer.strategy.all_gather(rng.to(device))
        gathered = gathered.reshape(-1, rng.numel()).cpu()  # one row per rank (one process: just this one)
        hosts = trainer.strategy.all_gather(host.to(device)).reshape(-1, host.numel()).cpu()
        cuda = None  # the CUDA generator (dropout on the GPU draws from it), on a CUDA strategy only
        if device.type == "cuda":
            state = torch.cuda.get_rng_state(device)
            cuda = trainer.strategy.all_gather(state.to(device)).reshape(-1, state.numel()).cpu()
        name = f"{_PREFIX}{trainer.global_step:09d}.ckpt"
        tmp = self.directory / f".{name}.tmp"
        if trainer.is_global_zero:
            self.directory.mkdir(parents=True, exist_ok=True)
            remove_path(tmp)  # a half-written file from a save that was itself killed
        trainer.strategy.barrier("requeue_prepare")
        self._state = {"epoch": trainer.current_epoch, "batches": batch_idx + 1, "global_step": trainer.global_step,
                       "rng": gathered, "host_rng": hosts, "cuda_rng": cuda, "signal": self.signal.name,
                       "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)}
        try:
            trainer.save_checkpoint(tmp)
        finally:
            self._state = {}
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
