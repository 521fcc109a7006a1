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

What it shares with the strategies on a process group comes from their common first base,
:class:`~lightning_sync.strategies._parts.StrategyParts`: ``comm`` (its :class:`~lightning_sync.comms.CommContext`,
for the subclass's own traffic and its statistics), ``telemetry``
(:class:`~lightning_sync.strategies._telemetry.CommTelemetry`), an atomic ``checkpoint_io``, and the hooks
that call them.
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

from lightning_sync._lightning import MultiProcessingLauncher, SubprocessScriptLauncher, set_launcher, trainer_of
from lightning_sync.strategies._parts import StrategyParts

__all__ = ["NoProcessGroupStrategy"]


class NoProcessGroupStrategy(StrategyParts, ParallelStrategy):
    """Ranks launched by Lightning that share no process group (see the module docstring).

    Args:
        start_method: ``"popen"`` (re-run the script per rank), ``"spawn"``, ``"fork"`` or ``"forkserver"``
            (checked by the subclass).
        **kwargs: Lightning's components (``accelerator``, ``parallel_devices``, ``cluster_environment``, ...).
    """

    def __init__(self, start_method: str = "popen", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._start_method = start_method
        self._num_nodes = 1

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
        """This rank's seed and place in the job, once a fit's communication state is clean (:class:`StrategyParts`)."""
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
