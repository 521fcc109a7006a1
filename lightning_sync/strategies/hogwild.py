"""``HogwildStrategy``: N processes on one machine train one model in shared memory, without locks.

Hogwild! (Niu, Recht, Ré and Wright, NIPS 2011): the model's parameters and buffers live in shared
memory (``share_memory_()``); every process computes gradients on its own shard of the data and its
own optimizer writes its update straight into the shared tensors, with no lock and no message. Two
processes that update the same element at the same time may lose one of the two updates. That is
rare, and harmless, when updates are *sparse*: a bag-of-words or embedding model touches only the
rows of the words in its batch (``nn.EmbeddingBag(..., sparse=True)`` with SGD), so updates seldom
collide. Dense models collide on every step and gain little. CPU only, one node; nothing goes on a
wire, so ``comms`` counts no bytes.

What is synchronized, and when:

* **Parameters:** never exchanged; they *are* shared. Each process's optimizer (its own state, e.g.
  momentum) steps the shared tensors after every backward. Gradients are private to each process.
* **Start:** the launcher moves the module into shared memory before starting the processes (``fork``
  by default; ``spawn`` and ``forkserver`` share it through torch.multiprocessing's pickling). No
  process trains before every one has reached the start of training (a barrier): a resumed model is
  loaded by all of them, and a late one must not write it over a faster one's first updates.
* **Validation, test and checkpoints:** a barrier stops every process before evaluation or a
  checkpoint's snapshot, and another releases them after, so these see one consistent model (no
  update in flight) and metrics are reduced across processes as usual.
* **What a checkpoint holds, and what resume restores:** that model; each process's own optimizer
  state (every process has its own optimizer, e.g. its own momentum: Lightning's ``optimizer_states``
  are rank 0's, the per-rank states carry the others'); each process's RNG streams and its place in
  the training data (:mod:`lightning_sync.resume`); Lightning's loop counters and LR schedulers, rank
  0's (every process is at the same step when a checkpoint is written, so a scheduler driven by the
  step or by synced metrics is the same in all). On resume each process gets all of that back.
  **Guarantee:** a resumed run starts from exactly the state the interrupted run was in; what is not
  reproduced is the order in which the processes' updates reach the shared tensors, after a resume as
  between any two Hogwild runs. So it equals the uninterrupted run bit for bit where that order cannot
  matter (one process, or processes that never write the same element, e.g. disjoint rows of a sparse
  embedding), and otherwise differs from it only as two uninterrupted runs differ from each other.
  **At another number of processes** K' (a checkpoint of K): process r < min(K, K') continues process r's
  own optimizer state; a process the checkpoint has none for (r >= K) starts with a fresh one (no momentum,
  moments or step count) at the saved learning rate, since a copy of another process's state would apply
  that process's past gradients to the one shared model a second time; the states of processes K'..K-1
  are dropped. A log line says which. The shared model, LR schedulers and loop counters continue as
  above, rank r continues rank r's RNG streams, and the place in the data re-splits for K' processes
  (mid-epoch too, where the global batch, processes x per-process batch, is kept: :mod:`lightning_sync.resume`).
* **Clocks:** each process counts its own steps (``trainer.global_step``); the model receives N
  updates per step of the clock, each from a batch of the per-process size. LR schedulers step on
  each process's own clock and set that process's learning rate. Lightning 2.6 broadcasts a flag on
  the process group before every training step, so processes stay within a step of each other.
* **After fit** the main process's module holds the trained weights (it shares their memory).
* **Staleness** (logged as ``comm/staleness`` when a logger is attached): each process counts its own updates
  in a shared tensor, one slot per process (one writer each, so no lock); rank 0 logs how many updates the
  others made during each of its steps (:mod:`lightning_sync.strategies._telemetry`).

If a process fails, the others raise at the next barrier or collective (or at ``timeout``), and Lightning's launcher
ends the job naming it. If the launching process is killed, every worker dies with it (Linux's parent-death signal).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_sync._lightning import MultiProcessingLauncher, ddp_start_method, set_launcher
from lightning_sync._process import die_with_parent
from lightning_sync.resume import RANK_STATES
from lightning_sync.strategies._base import ProcessGroupStrategy
from lightning_sync.strategies._common import as_timedelta, check_bool, check_launch_args
from lightning_sync.strategies._telemetry import STALENESS

__all__ = ["HogwildStrategy"]

_START_METHODS = ("fork", "spawn", "forkserver")


class _SharedMemoryLauncher(MultiProcessingLauncher):
    """Lightning's multiprocessing launcher, with the module moved into shared memory first, and rank 0's
    fit-loop progress brought back to the main process (so ``trainer.global_step`` is right there too)."""

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        module = trainer.lightning_module if trainer is not None else None
        if module is not None:
            module.share_memory()
        self._strategy.launcher_pid = os.getpid()  # each worker dies with this process (setup_environment)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def get_extra_results(self, trainer: Any) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        extra["fit_loop"] = trainer.fit_loop.state_dict()
        return extra

    @override
    def update_main_process_results(self, trainer: Any, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        if "fit_loop" in extra:
            trainer.fit_loop.load_state_dict(extra["fit_loop"])


class HogwildStrategy(ProcessGroupStrategy):
    """Lock-free shared-memory SGD on one machine (see the module docstring). The process group carries
    barriers, metric reductions and the checkpoints' per-rank states, never a parameter or a gradient.

    Args:
        num_processes: how many processes share the model (None: the Trainer's ``devices``). It may not
            exceed the CPU count unless ``oversubscribe=True``.
        oversubscribe: allow more processes than CPUs (each then gets a fraction of a core).
        start_method: ``"fork"`` (default; no pickling), ``"spawn"`` or ``"forkserver"``. Processes
            must start from this one to share its memory, so ``"popen"`` is not offered.
        timeout: seconds a barrier or metric reduction may wait for a peer.
    """

    strategy_name = "hogwild"
    _per_rank_optimizer_state = True  # every rank steps an optimizer of its own

    def __init__(
        self,
        num_processes: int | None = None,
        oversubscribe: bool = False,
        start_method: str = "fork",
        timeout: float | timedelta = 1800.0,
        **kwargs: Any,
    ) -> None:
        if num_processes is not None and (
            isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1
        ):
            raise ValueError(f"num_processes must be None or an int >= 1, got {num_processes!r}")
        check_bool("oversubscribe", oversubscribe)
        cpus = os.cpu_count() or 1
        if num_processes is not None and num_processes > cpus and not oversubscribe:
            raise ValueError(
                f"num_processes={num_processes!r} is more than this machine's {cpus} CPUs (allowed: 1 to "
                f"{cpus}); lock-free updates then compete for cores. Pass oversubscribe=True to run "
                f"it anyway"
            )
        if start_method not in _START_METHODS:
            raise ValueError(
                f"start_method must be one of {list(_START_METHODS)} (processes must share this "
                f"process's memory), got {start_method!r}"
            )
        check_launch_args(type(self).__name__, None, start_method, kwargs)
        if num_processes is not None:
            kwargs["parallel_devices"] = [torch.device("cpu")] * num_processes
        super().__init__(
            process_group_backend="gloo", timeout=as_timedelta(timeout), start_method=start_method, **kwargs
        )
        self.num_processes_requested, self.oversubscribe = num_processes, oversubscribe
        self._updates: torch.Tensor | None = None  # shared: optimizer steps taken, one slot per process
        self._count_updates = False  # a logger is attached: count them (for the staleness figure)
        self._mapped_optimizer_states: list[dict[str, Any]] | None = None  # from a checkpoint of another size
        self.launcher_pid: int | None = None  # the process that started the workers

    @override
    def _configure_launcher(self) -> None:
        # before the processes start, so that they all share it
        self._updates = torch.zeros(max(self.num_processes, 1), dtype=torch.int64).share_memory_()
        set_launcher(self, _SharedMemoryLauncher(self, start_method=ddp_start_method(self)))

    @override
    def on_train_start(self) -> None:
        trainer = self.lightning_module.trainer
        self._count_updates = self._updates is not None and bool(trainer.loggers)
        super().on_train_start()  # builds the telemetry, which reads the counts from the start
        # Lightning calls this after the callbacks' and the module's own on_train_start: until every process
        # is here, none updates the shared model, so each has loaded the checkpoint into it and each hook saw
        # the model as loaded, not a faster peer's first steps
        self._quiesce()

    @override
    def _after_optimizer_step(self) -> None:
        if self._count_updates:
            self._updates[self.global_rank] += 1  # type: ignore[index]

    @override
    def _comm_counters(self) -> dict[str, float]:
        if not self._count_updates:
            return {}
        assert self._updates is not None
        return {STALENESS: float(self._updates.sum() - self._updates[self.global_rank])}

    @override
    def setup_environment(self) -> None:
        if self.launcher_pid not in (None, os.getpid()) and ddp_start_method(self) != "forkserver":
            die_with_parent(self.launcher_pid)  # a worker: a killed launcher must not leave it training
            # (a forkserver's worker is the server's child, not the launcher's: it keeps torch's own bond)
        if not isinstance(self.accelerator, CPUAccelerator) or self.root_device.type != "cpu":
            raise ValueError(
                f"{type(self).__name__} runs on CPU (shared host memory), got "
                f"{type(self.accelerator).__name__} on {self.root_device}; use accelerator='cpu'"
            )
        if self.num_nodes != 1:
            raise ValueError(
                f"{type(self).__name__} shares memory, so it runs on one node, got num_nodes={self.num_nodes}"
            )
        cpus = os.cpu_count() or 1
        if self.num_processes > cpus and not self.oversubscribe:
            raise ValueError(
                f"{self.num_processes} processes (devices) is more than this machine's {cpus} CPUs; pass "
                f"oversubscribe=True to run it anyway"
            )
        super().setup_environment()

    @override
    def configure_ddp(self) -> None:
        """No wrapper and no broadcast: every process already holds the same (shared) tensors."""
        assert self.model is not None
        private = [
            n
            for n, t in [*self.model.named_parameters(), *self.model.named_buffers()]
            if t.numel() and not t.is_shared()
        ]
        if private:
            raise RuntimeError(
                f"{type(self).__name__}: {private[:3]} are not in shared memory; the module must come "
                f"through the strategy's launcher (trainer.fit), not be created inside a rank"
            )
        rank_zero_info(
            f"{type(self).__name__}: {self.num_processes} processes share "
            f"{sum(p.numel() for p in self.model.parameters())} parameters, lock-free"
        )

    def _quiesce(self) -> None:
        """A barrier: once every process is here, no update is in flight on any of them."""
        if torch.distributed.is_initialized():
            self.barrier()

    @override
    def on_validation_start(self) -> None:
        self._quiesce()

    @override
    def on_validation_end(self) -> None:
        self._quiesce()

    @override
    def on_test_start(self) -> None:
        self._quiesce()

    @override
    def on_test_end(self) -> None:
        self._quiesce()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """A copy taken while every process waits (one consistent model; every rank calls this when saving)."""
        if not torch.distributed.is_initialized():
            return super().lightning_module_state_dict()
        self.barrier()
        state = {
            k: v.detach().clone() if isinstance(v, torch.Tensor) else v
            for k, v in super().lightning_module_state_dict().items()
        }
        self.barrier()
        return state

    @override
    def _restore_rank_state(self, mine: dict[str, Any] | None, checkpoint: dict[str, Any]) -> None:
        """From a checkpoint of another number of processes: the optimizer state this process continues
        (module docstring). At the checkpoint's own number every process loads its own (``exact_data``)."""
        self._mapped_optimizer_states = None
        states, saved = checkpoint.get(RANK_STATES), checkpoint.get("optimizer_states")
        if mine is not None or not states or saved is None:
            return
        rank, before, after = self.global_rank, len(states), self.world_size
        if rank == 0:
            own = saved  # Lightning's optimizer_states are process 0's
        elif rank < before:
            own = states[rank].get("optimizer_states", saved)  # (a checkpoint without them: process 0's)
        else:
            own = [{"state": {}, "param_groups": s["param_groups"]} for s in saved]  # the learning rate only
        self._mapped_optimizer_states = own
        change = (
            f"processes {before}-{after - 1} start with a fresh optimizer state at the saved learning rate"
            if after > before
            else f"the states of processes {after}-{before - 1} are dropped"
        )
        rank_zero_info(
            f"{type(self).__name__}: the checkpoint holds the optimizer states of {before} processes, this run "
            f"has {after}: processes 0-{min(before, after) - 1} continue their own, {change}"
        )

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        mapped, self._mapped_optimizer_states = self._mapped_optimizer_states, None
        super().load_optimizer_state_dict(checkpoint if mapped is None else {"optimizer_states": mapped})

    @override
    def teardown(self) -> None:
        if torch.distributed.is_initialized():  # nobody leaves while another still writes the shared model
            self.barrier()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "hogwild",
            cls,
            description="Hogwild!: processes update one shared-memory model without locks (lightning_sync)",
            override=True,
        )
