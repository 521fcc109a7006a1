"""``NoProcessGroupStrategy``: the Lightning plumbing of a strategy whose ranks share no process group.

Lightning's parallel strategies assume one: its ``DDPStrategy`` creates it, reduces metrics over it and
broadcasts a flag on it before every training step, so every rank waits for the others. A strategy whose ranks
must never wait for each other (the asynchronous parameter server, which talks over RPC) keeps what is not
about synchronization, written here once:

* Lightning's launchers start the processes (``popen``: re-run the script per rank; or multiprocessing), and
  each rank knows its global rank and the world size (:meth:`NoProcessGroupStrategy.set_world_ranks`).
* ``reduce``, ``all_gather``, ``broadcast``, ``barrier`` and ``reduce_boolean_decision`` are local: with no
  group there is nothing to reduce over, and ranks reach evaluation at different times anyway. So training
  data is sharded (a ``DistributedSampler`` per rank) but evaluation data is not: each rank evaluates the
  whole set, and its metrics are its own.
* Backward never communicates, so accumulation micro-steps need nothing held back.
* A fit starts from the communication state of a fresh process (a multirun's next job, a second fit).

It holds what it shares with the strategies on a process group, as they do: ``comm`` (its
:class:`~lightning_sync.comms.CommContext`, for the subclass's own traffic and its statistics), ``telemetry``
(:class:`~lightning_sync.strategies._telemetry.CommTelemetry`) and an atomic ``checkpoint_io``.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from lightning_sync import comms
from lightning_sync._lightning import (
    MultiProcessingLauncher,
    SubprocessScriptLauncher,
    set_checkpoint_io,
    set_launcher,
    trainer_of,
)
from lightning_sync.strategies._checkpoint_io import atomic_unless_set
from lightning_sync.strategies._common import new_comm
from lightning_sync.strategies._telemetry import CommTelemetry

__all__ = ["NoProcessGroupStrategy"]


class NoProcessGroupStrategy(ParallelStrategy):
    """Ranks launched by Lightning that share no process group (see the module docstring).

    Args:
        start_method: ``"popen"`` (re-run the script per rank), ``"spawn"``, ``"fork"`` or ``"forkserver"``
            (checked by the subclass).
        **kwargs: Lightning's components (``accelerator``, ``parallel_devices``, ``cluster_environment``, ...).
    """

    def __init__(self, start_method: str = "popen", **kwargs: Any) -> None:
        self.comm: comms.CommContext = new_comm()  # this strategy's own; nothing of it is shared
        self.telemetry = CommTelemetry(self, self._comm_counters, self._comm_gauges)
        super().__init__(**kwargs)
        self._start_method = start_method
        self._num_nodes = 1

    def __getstate__(self) -> dict[str, Any]:
        """A context lives in one process (it holds locks): a pickled strategy (the spawn launcher's) takes
        none along, and the new process gets a fresh one."""
        state = super().__getstate__()
        state.pop("comm", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.comm = new_comm()

    @property
    def checkpoint_io(self) -> Any:
        atomic_unless_set(self)
        return super().checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        set_checkpoint_io(self, io)

    # ------------------------------------------------------------------ what a subclass adds to a step
    def _after_optimizer_step(self) -> None:
        """Synchronize what follows an optimizer step (nothing here)."""

    def _comm_counters(self) -> dict[str, float]:
        """Cumulative counts whose per-step increase is logged (none here)."""
        return {}

    def _comm_gauges(self) -> dict[str, float]:
        """Values logged as they are after each step (none here)."""
        return {}

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self.telemetry.start()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.telemetry.batch_start()

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._after_optimizer_step()
        self.telemetry.step_end()
        return out

    @property
    def is_distributed(self) -> bool:
        """True: Lightning shards the training data with a DistributedSampler."""
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Training data is sharded; evaluation data is not (each rank evaluates on all of it)."""
        trainer = self._trainer()
        if trainer is not None and trainer.state.stage != RunningStage.TRAINING:
            return {"num_replicas": 1, "rank": 0}
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            set_launcher(self, SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes))
        else:
            set_launcher(self, MultiProcessingLauncher(self, start_method=self._start_method))

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        """This rank's place in the job, and, for a fit, the communication state of a fresh process."""
        trainer = self._trainer()
        if trainer is not None and trainer.state.fn == "fit":
            self.comm.begin_job()
        super().setup_environment()
        reset_seed()  # spawned ranks re-seed from PL_GLOBAL_SEED, as Lightning's DDP does
        self.set_world_ranks()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _trainer(self) -> Any:
        return trainer_of(self.lightning_module)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        yield None  # backward never communicates: accumulation needs nothing

    # ------------------------------------------------------------------ no process group: local collectives
    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        return tensor

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        return None

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision
