"""The memory table: each rank's peak resident memory during setup and during training, and the step time, of
every row of ``memory.rows`` on one model, each trial in fresh processes.

Resident set size (RSS) is the memory the operating system has handed a process; its high-water mark (VmHWM in
``/proc/self/status``) only rises, so one process measures one trial: every trial spawns its ranks anew, and
the data module is built before the level the figures start from. Linux resets the mark when ``5`` is written to
``/proc/self/clear_refs``, which splits a trial into **setup** (from before the Trainer and the model are built
until the first training batch: the model, Lightning's setup, the strategy's broadcast and sharding, the
optimizer) and **training** (the warm-up and timed steps). A row with ``init_module: true`` builds its model
inside ``trainer.init_module()``, others before ``fit``. A model whose layers are created in its own
``configure_model()`` (:class:`~lightning_sync.models.char_gpt.DeferredCharGPT`) has them built by ``fit``
inside the strategy's init context where the row says ``deferred: true`` (ZeRO-3 and FSDP2 build them on the
meta device and each rank materializes only its shards), else by the bench at the setup hook, with storage on the
CPU (eager: the whole model on every rank, then sharded). Where CUDA is available each phase's
``torch.cuda.max_memory_allocated`` is recorded too.

**The prediction's basis.** :func:`~lightning_sync.bench.memory_predict.predict_rows` predicts each row's
training peak per rank from the model (:mod:`~lightning_sync.bench.memory_model`). It is compared with the
training peak above the **base**: the resident set at the setup hook, once the process group exists and before
``configure_model`` builds any layer. The absolute RSS holds the process (Python, torch, Lightning, the data:
~380 MiB here), which the model does not predict. Before the figures start each rank runs one training step of
the model alone and frees it: the code of the kernels training runs is then resident already, so the rise counts
tensors, not the ~20 MiB of code pages a process touches the first time it trains (measured in one process: a
training peak 23 MiB lower after such a step).
Each rank sets glibc's mmap threshold to 1 MiB first (``mallopt``): glibc otherwise keeps freed blocks below
its growing threshold in its heap, still resident, so a tensor freed in setup (the eager model's full copy)
would count in the training phase's peak; with it, a freed tensor leaves the resident set.

A figure is the largest rank's, the median over the rounds of the alternating schedule; the step time is the
median of the timed steps, over ranks and rounds. For the ZeRO rows the engine's own accounting
(:meth:`~lightning_sync.sync.zero.engine.ZeroEngine.memory_report`, at the last step) splits their bytes into
device and host: on a CPU-only machine offload moves nothing, and that column shows what it would move.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_sync._checks import check_bool, check_int
from lightning_sync.bench.memory_predict import built, first_batch, predict_rows, step_alone
from lightning_sync.bench.rows import FIT, fmt, median, node, schedule
from lightning_sync.bench.runner import Trial, quiet

__all__ = ["DEFERRED", "INIT_MODULE", "MemoryResult", "memory_markdown", "memory_trials", "peak_rss_mib"]
__all__ += ["run_memory"]

log = logging.getLogger("lightning_sync.bench")
_MIB = 2**20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number


def _freed_tensors_leave_the_resident_set() -> None:
    """glibc: allocations of 1 MiB and more are mapped on their own and unmapped when freed (module docstring)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, _MIB)
    except (OSError, AttributeError):  # not glibc: its allocator's own policy stands
        pass


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(key + ":")))


def peak_rss_mib() -> float:
    """This process's resident-set high-water mark, MiB."""
    return _status_kib("VmHWM") / 1024


def reset_peak_rss() -> float:
    """Reset the high-water mark to the current RSS (Linux: ``/proc/self/clear_refs``); returns that RSS, MiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") / 1024


#: ``Trial.extra`` key: build the model inside ``trainer.init_module()``; ``"round"`` is the trial's round.
INIT_MODULE = "init_module"
#: ``Trial.extra`` key: leave the model's own ``configure_model()`` to ``fit`` (the strategy's deferred route);
#: otherwise the bench calls it first, in the setup hook, with storage on the CPU (eager).
DEFERRED = "deferred"


@dataclass
class MemoryResult:
    """One rank's figures of one trial (MiB and seconds; see the module docstring)."""

    name: str
    round: int
    rank: int
    start_mib: float
    setup_mib: float
    train_mib: float
    step_s: list[float] = field(default_factory=list)
    cuda_setup_mib: float | None = None
    cuda_train_mib: float | None = None
    engine: dict[str, dict[str, int]] | None = None  # ZeroEngine.memory_report() at the last step
    init_peak_mib: float | None = None  # a deferred ZeroEngine's own peak while it materialized the model
    base_mib: float | None = None  # RSS once the process group exists, before configure_model (the prediction's)

    @property
    def train_rise_mib(self) -> float | None:
        """The training peak above :attr:`base_mib`: the basis the prediction is compared on."""
        return None if self.base_mib is None else self.train_mib - self.base_mib


class _Phases(pl.Callback):
    """Ends the setup phase at ``on_train_start`` and times the steps after the warm-up."""

    def __init__(self, warmup: int, deferred: bool) -> None:
        self.warmup, self.setup_mib, self.step_s, self._t0 = warmup, 0.0, [], 0.0
        self.deferred, self.base_mib = deferred, 0.0
        self.cuda_setup_mib: float | None = None
        self.engine: dict[str, dict[str, int]] | None = None
        self.init_peak_mib: float | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """After the process group, before Lightning's ``configure_model``: the basis, then an eager build."""
        gc.collect()
        self.base_mib = _status_kib("VmRSS") / 1024
        own = type(pl_module).configure_model  # the module's own hook, not one a strategy installed
        if not self.deferred and own is not pl.LightningModule.configure_model:
            own(pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.setup_mib = peak_rss_mib()
        reset_peak_rss()
        init_peak = getattr(getattr(trainer.strategy, "engine", None), "init_peak_bytes", None)
        self.init_peak_mib = init_peak / _MIB if init_peak is not None else None
        if torch.cuda.is_available():
            self.cuda_setup_mib = torch.cuda.max_memory_allocated() / _MIB
            torch.cuda.reset_peak_memory_stats()

    def on_train_batch_start(self, *args: Any) -> None:
        self._t0 = time.perf_counter()

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        self.engine = engine.memory_report() if engine is not None else None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step > self.warmup:
            self.step_s.append(time.perf_counter() - self._t0)


def _trial(rank: int, world: int, trial: Trial) -> MemoryResult:
    from hydra.utils import instantiate

    import lightning_sync  # noqa: F401 - registers the strategy names

    quiet(1)
    _freed_tensors_leave_the_resident_set()
    data = instantiate(trial.data_cfg)
    model = built(trial.model_cfg)
    step_alone(model, first_batch(data))  # the kernels' code is resident before the figures start (module doc)
    del model
    pl.seed_everything(0, verbose=False)
    gc.collect()
    start = reset_peak_rss()
    probe = _Phases(trial.warmup, trial.extra[DEFERRED])
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    kw = {"devices": world, "max_steps": trial.warmup + trial.steps, "callbacks": [probe]}
    trainer = pl.Trainer(accelerator=accelerator, strategy=instantiate(trial.strategy), **kw, **FIT)
    with trainer.init_module() if trial.extra[INIT_MODULE] else nullcontext():
        model = instantiate(trial.model_cfg)
    trainer.fit(model, datamodule=data)
    cuda_train = torch.cuda.max_memory_allocated() / _MIB if torch.cuda.is_available() else None
    return MemoryResult(
        trial.name, trial.extra["round"], rank, start, probe.setup_mib, peak_rss_mib(), probe.step_s,
        probe.cuda_setup_mib, cuda_train, probe.engine, probe.init_peak_mib, probe.base_mib,
    )  # fmt: skip


def memory_trials(cfg: Any) -> list[Trial]:
    """The alternating schedule of ``cfg.memory`` (a plain dict or DictConfig), checked; a trial's ``devices`` are
    the world size, its ``extra`` says :data:`INIT_MODULE` and its round."""
    m = cfg.memory
    world, steps = check_int("memory.world_size", m.world_size, 1), check_int("memory.steps", m.steps, 1)
    warmup, pairs = check_int("memory.warmup_steps", m.warmup_steps, 0), check_int("memory.pairs", m.pairs, 1)
    if not m.rows:
        raise ValueError("memory.rows must name at least one row (row name -> {strategy: ..., init_module: ...})")
    rows = {}
    for name, row in m.rows.items():
        if set(row) - {"strategy", INIT_MODULE, DEFERRED} or "strategy" not in row:
            raise ValueError(
                f"memory.rows.{name} must have a strategy node and may set init_module and deferred, got {sorted(row)}"
            )
        rows[str(name)] = (
            node(row["strategy"]),
            check_bool(f"memory.rows.{name}.init_module", row.get(INIT_MODULE, False)),
            check_bool(f"memory.rows.{name}.deferred", row.get(DEFERRED, False)),
        )
    model, data, label = node(m.model.model), node(m.model.data), str(m.model.model._target_).rsplit(".", 1)[-1]
    return [
        Trial(
            name,
            label,
            rows[name][0],
            model,
            data,
            steps,
            warmup,
            {INIT_MODULE: rows[name][1], DEFERRED: rows[name][2], "round": i // len(rows)},
            world,
        )
        for i, name in enumerate(schedule(list(rows), pairs))
    ]


def run_memory(cfg: Any, out_dir: Path, meta: dict[str, Any] | None = None) -> list[MemoryResult]:
    """Run every trial in processes of its own; write ``memory.md`` and ``memory.json``; return the results."""
    from lightning_sync.testing import run_distributed

    trials, results = memory_trials(cfg), []
    predicted = predict_rows(cfg)
    for i, trial in enumerate(trials, 1):
        log.info("memory %d/%d: %s (round %d)", i, len(trials), trial.name, trial.extra["round"])
        results += run_distributed(
            _trial, trial.devices or 1, trial, timeout=float(cfg.memory.timeout_s), env={"OMP_NUM_THREADS": "1"}
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    predicted_mib = {n: None if p is None else p.total / _MIB for n, p in predicted.items()}
    (out_dir / "memory.md").write_text(memory_markdown(results, cfg, meta, predicted_mib) + "\n")
    (out_dir / "memory.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    terms = {n: None if p is None else {k: v / _MIB for k, v in asdict(p).items()} for n, p in predicted.items()}
    (out_dir / "memory_predicted.json").write_text(json.dumps(terms, indent=1))
    return results


def _largest(results: list[MemoryResult], key: str) -> float:
    """Median over rounds of the largest rank's figure."""
    rounds = sorted({r.round for r in results})
    values = [[v for r in results if r.round == k and (v := getattr(r, key)) is not None] for k in rounds]
    return median([max(v) for v in values if v])


def _round_ratio(results: list[MemoryResult], name: str, reference: str, k: int) -> float | None:
    """Row ``name``'s median step over ``reference``'s in round ``k`` (None where either has no step there)."""
    mine, theirs = ([s for r in results if r.name == n and r.round == k for s in r.step_s] for n in (name, reference))
    return median(mine) / median(theirs) if mine and theirs else None


def memory_markdown(
    results: list[MemoryResult],
    cfg: Any,
    meta: dict[str, Any] | None = None,
    predicted: dict[str, float | None] | None = None,
) -> str:
    """The table: per row the peak RSS of setup and training (absolute and above the start), the training peak
    above the base with its prediction (``predicted``: MiB by row) and their ratio, the step time and its ratio to
    the first row's (median of same-round ratios), CUDA peaks where measured, and the ZeRO engine's device / host
    split."""
    m = cfg.memory
    names, rounds = list(dict.fromkeys(r.name for r in results)), sorted({r.round for r in results})
    cuda = any(r.cuda_train_mib is not None for r in results)
    head = ["row", "setup peak RSS (MiB)", "training peak RSS (MiB)", "setup above start", "training above start"]
    head += ["training above base", "predicted (MiB)", "predicted / measured", "step (s)", f"step / {names[0]}"] + (
        ["CUDA setup / training (MiB)"] if cuda else []
    )
    lines = [
        "## Memory per rank",
        "",
        f"`{m.model.model._target_.rsplit('.', 1)[-1]}` at {m.world_size} ranks, {m.pairs} rounds of {m.steps} timed "
        f"steps after {m.warmup_steps}; peak resident set size of the largest rank, median over rounds "
        f"(lightning_sync/bench/memory.py)" + (f"; {meta['cpu']}, {meta['date']}." if meta else "."),
        "",
        "| " + " | ".join([*head, "engine device / host MiB"]) + " |",
        "|" + "---|" * (len(head) + 1),
    ]
    steps = {n: median([s for r in results if r.name == n for s in r.step_s]) for n in names}
    ratios = {n: median([ratio for k in rounds if (ratio := _round_ratio(results, n, names[0], k))]) for n in names}
    for n in names:
        mine = [r for r in results if r.name == n]
        setup, train, start = (_largest(mine, k) for k in ("setup_mib", "train_mib", "start_mib"))
        cells = [n, fmt(setup, ".0f"), fmt(train, ".0f"), fmt(setup - start, ".0f"), fmt(train - start, ".0f")]
        rise = _largest(mine, "train_rise_mib")
        guess = (predicted or {}).get(n)
        guess = math.nan if guess is None else guess
        cells += [fmt(rise, ".0f"), fmt(guess, ".0f"), fmt(guess / rise, ".2f")]
        cells += [fmt(steps[n], ".3f"), fmt(ratios[n], ".2f")]
        if cuda:
            cells.append(
                f"{fmt(_largest(mine, 'cuda_setup_mib'), '.0f')} / {fmt(_largest(mine, 'cuda_train_mib'), '.0f')}"
            )
        engine = next((r.engine for r in mine if r.engine is not None), None)
        cells.append(
            "n/a" if engine is None else " / ".join(f"{sum(engine[p].values()) / _MIB:.1f}" for p in ("device", "host"))
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
