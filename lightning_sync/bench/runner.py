"""Benchmark trials, run inside every rank in the same order: one ``Trainer.fit`` per trial, each step timed from
batch start to batch end, its traffic the delta of the strategy's statistics (:func:`stats_of`; compression,
op ``codec``, apart), ``peak_mib`` the largest malloc'd memory above the level before the model was built (it falls
when tensors are freed, unlike RSS), sampled before and after backward, at each batch end and, during warm-up,
before every module's forward. A trial marked :data:`IN_STEP` is the cost model's compute row: each rank fits
the plain model alone, every step started together by :class:`Lockstep`.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_sync import comms
from lightning_sync.bench.fsdp2 import FullyShardStrategy
from lightning_sync.bench.rows import FIT, Measurement
from lightning_sync.sync.compression import CODEC_OP

__all__ = ["IN_STEP", "SINGLE_ROW", "StepProbe", "Trial", "quiet", "run_trials", "stats_of"]
__all__ += ["torch_collectives_counted"]

#: ``Trial.extra`` key of the rows that measure compute alone under a K-rank job's time-sharing.
IN_STEP = "in_step"
#: Name of the single-process row of the plain model (T1) in the one-rank rounds.
SINGLE_ROW = "single"
#: The ``torch.distributed`` functions FSDP2 sends through, per ``comms`` op they are counted as: the first
#: name torch has (``_single``: torch 2.13's; older releases call the others).
TORCH_OPS = {
    "torch_all_gather": ("all_gather_single", "all_gather_into_tensor"),
    "torch_reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
}


def stats_of(strategy: Any) -> comms.CommStats:
    """The statistics a strategy's traffic is recorded in: its context's observer, or for a foreign strategy
    (Lightning's, FSDP2) statistics kept on the strategy object (:func:`torch_collectives_counted`)."""
    comm = getattr(strategy, "comm", None)
    if isinstance(comm, comms.CommContext):
        if not isinstance(comm.observer, comms.CommStats):
            comm.observer = comms.CommStats()  # measuring is what the bench is for
        return comm.observer
    return vars(strategy).setdefault("_lightning_sync_bench_stats", comms.CommStats())


@contextmanager
def torch_collectives_counted(strategy: Any) -> Iterator[None]:
    """Count what FSDP2 sends outside ``comms``: while the block runs, each call of :data:`TORCH_OPS` is recorded
    into :func:`stats_of` with its input's bytes (as ``comms`` counts them) and the seconds it took."""
    import torch.distributed as dist

    saved, stats = {}, stats_of(strategy)

    def counted(op: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            source = kwargs.get("input_tensor", kwargs.get("input", args[1] if len(args) > 1 else None))
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            stats.record(op, int(source.numel() * source.element_size()), time.perf_counter() - t0)
            return out

        return call

    for op, names in TORCH_OPS.items():
        if name := next((n for n in names if hasattr(dist, n)), None):
            saved[name] = getattr(dist, name)
            setattr(dist, name, counted(op, saved[name]))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@dataclass
class Trial:
    """One measured fit: row ``name`` on ``model``, the Hydra nodes (``None`` target: single device), ``steps``
    timed steps after ``warmup`` untimed ones, ``extra`` labels and the Trainer's ``devices`` (None: the group)."""

    name: str
    model: str
    strategy: dict[str, Any]
    model_cfg: dict[str, Any]
    data_cfg: dict[str, Any]
    steps: int = 20
    warmup: int = 5
    extra: dict[str, Any] = field(default_factory=dict)
    devices: int | None = None


class _MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2, every field: it is returned by value
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks".split()]
    _fields_ += [(n, ctypes.c_size_t) for n in ("fordblks", "keepcost")]


def _allocated_mib() -> float:
    """MiB allocated through malloc (glibc's ``mallinfo2``; elsewhere the resident set)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
        return (info.uordblks + info.hblkhd) / 2**20
    except (OSError, AttributeError):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class StepProbe(pl.Callback):
    """Times each step and samples bytes, exposed communication and memory (see module docstring)."""

    #: What it records per timed step (:class:`~lightning_sync.bench.rows.Measurement`'s fields of that name).
    PER_STEP = ("step_s", "step_calls", "codec_s", "covered_s", "blocked_s")

    def __init__(self, warmup: int) -> None:
        self.warmup, self.peak_rss, self.bytes = warmup, 0.0, []
        self.per_step: dict[str, list[Any]] = {k: [] for k in (*self.PER_STEP, "exposed_s")}
        self.per_op: dict[str, dict[str, float]] = {"bytes": {}, "calls": {}, "seconds": {}}  # summed over steps
        self.bucketer: Any = None  # kept past teardown, for the communication-alone measurement
        self._t0 = self._covered0 = self._blocked0 = 0.0
        self._snap0: dict[str, comms.OpStats] = {}
        self._sampling: list[Any] = []  # the forward pre-hooks that sample the peak during warm-up

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        stats = stats_of(trainer.strategy)
        self._snap0 = stats.snapshot()
        self._covered0, self._blocked0 = stats.covered_seconds(), stats.blocked_seconds()
        self._t0 = time.perf_counter()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """During the warm-up steps, also sample before every module's forward, after the strategy's own hooks
        (ZeRO-3's and FSDP2's peak comes inside forward: the unit computing and the one prefetched); timed steps
        run without these hooks."""
        if self.warmup > 0:  # with no warm-up, every step is timed
            self._sampling = [m.register_forward_pre_hook(self._sample) for m in pl_module.modules()]

    def _sample(self, *args: Any) -> None:
        self.peak_rss = max(self.peak_rss, _allocated_mib())

    on_before_backward = _sample  # activations are alive here
    on_after_backward = _sample

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        elapsed = time.perf_counter() - self._t0
        self._sample()
        if trainer.global_step >= self.warmup:  # the warm-up is over: the timed steps run without these hooks
            for handle in self._sampling:
                handle.remove()
            self._sampling = []
        if trainer.global_step <= self.warmup:
            return
        stats, step, codec = stats_of(trainer.strategy), dict.fromkeys(self.per_op, 0), 0.0
        for op, now in stats.snapshot().items():
            before = self._snap0.get(op, comms.OpStats())
            if op == CODEC_OP:
                codec += now.seconds - before.seconds
                continue
            for key, sums in self.per_op.items():
                delta = getattr(now, key) - getattr(before, key)
                sums[op], step[key] = sums.get(op, 0) + delta, step[key] + delta
        self.bytes.append(step["bytes"])
        covered, blocked = stats.covered_seconds() - self._covered0, stats.blocked_seconds() - self._blocked0
        for key, value in zip(self.PER_STEP, (elapsed, step["calls"], codec, covered, blocked)):
            self.per_step[key].append(value)
        if (bucketer := getattr(trainer.strategy, "bucketer", None)) is not None:
            self.bucketer = bucketer
            self.per_step["exposed_s"].append(bucketer.trace.exposed_seconds)


def _comm_alone(bucketer: Any, repeats: int = 3) -> float:
    """Seconds to all-reduce the strategy's buckets with no compute (median of repeats), through a bare context."""
    times, ctx = [], comms.CommContext()
    for _ in range(repeats):
        ctx.barrier()
        t0 = time.perf_counter()
        for w in [ctx.all_reduce(b.buffer.clone(), op="avg", async_op=True) for b in bucketer.buckets]:
            w.wait()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _run_one(trial: Trial, world: int, callbacks: tuple[pl.Callback, ...] = ()) -> Measurement:
    from hydra.utils import instantiate

    import lightning_sync  # noqa: F401 - registers the strategy names

    gc.collect()  # the previous trial's Trainer/module cycles, so the baseline is not inflated
    base_rss = _allocated_mib()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    pl.seed_everything(0, verbose=False)
    model, data = instantiate(trial.model_cfg), instantiate(trial.data_cfg)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    strategy = instantiate(trial.strategy) if trial.strategy.get("_target_") else "auto"
    probe = StepProbe(trial.warmup)
    kw = {"devices": trial.devices or world, "max_steps": trial.warmup + trial.steps, "callbacks": [*callbacks, probe]}
    trainer = pl.Trainer(accelerator="gpu" if torch.cuda.is_available() else "cpu", strategy=strategy, **kw, **FIT)
    stats_of(trainer.strategy).reset()
    with torch_collectives_counted(strategy) if isinstance(strategy, FullyShardStrategy) else nullcontext():
        trainer.fit(model, datamodule=data)
    bucketer = probe.bucketer
    comm_s = _comm_alone(bucketer) if bucketer is not None and world > 1 else None
    peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else probe.peak_rss - base_rss
    if bucketer is not None:
        bucketer.close()
    n = max(len(probe.bytes), 1)
    per_op = {f"op_{key}_per_step": {op: v / n for op, v in sums.items()} for key, sums in probe.per_op.items()}
    return Measurement(
        name=trial.name,
        model=trial.model,
        world=world,
        bytes_per_step=sum(probe.bytes) / n,
        comm_calls=sum(probe.per_step["step_calls"]),
        comm_s=comm_s,
        param_bytes=param_bytes,
        n_linear=sum(isinstance(m, torch.nn.Linear) for m in model.modules()),
        strategy=dict(trial.strategy),
        peak_mib=peak,
        extra=trial.extra,
        **probe.per_step,
        **per_op,
    )


class Lockstep(pl.Callback):
    """Holds every step until all ranks reached it (a barrier through a bare context, no traffic of the row), so
    K single-process fits compute in step as a synchronous job's ranks do."""

    def __init__(self) -> None:
        self._ctx = comms.CommContext()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._ctx.barrier()


#: What a launcher sets for a rank; an in-step trial hides it, so Lightning sees one device and no cluster.
_RANK_ENV = "RANK LOCAL_RANK NODE_RANK WORLD_SIZE LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT TORCHELASTIC_USE_AGENT_STORE"


def _run_in_step(trial: Trial, world: int) -> Measurement:
    """The trial as a single-process fit on this rank in step with the others': ``c(K) T_comp`` of the cost model."""
    saved = {name: os.environ.pop(name) for name in _RANK_ENV.split() if name in os.environ}
    try:
        out = _run_one(replace(trial, devices=1), 1, (Lockstep(),))
    finally:
        os.environ.update(saved)
    return replace(out, world=world)


def run_trials(rank: int, world: int, trials: list[Trial], threads: int = 1, label: str = "") -> list[Measurement]:
    """Run every trial in order on this rank (called by ``run_distributed``); rank 0 shows a progress bar
    (``label``: the group, e.g. ``"K=4"``). A trial whose ``extra`` has :data:`IN_STEP` runs in step."""
    from tqdm import tqdm

    quiet(threads)
    bar = tqdm(trials, desc=f"bench {label}".strip(), unit="trial", disable=rank != 0, dynamic_ncols=True)
    out = []
    for i, t in enumerate(bar):
        bar.set_postfix_str(f"{t.model} / {t.name}")
        measured = _run_in_step(t, world) if t.extra.get(IN_STEP) else _run_one(t, world)
        out.append(replace(measured, rank=rank, trial=i))
    return out


def quiet(threads: int) -> None:
    """A bench rank: ``threads`` torch threads; Lightning's errors only, no warnings (they would split the bar)."""
    torch.set_num_threads(threads)
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
