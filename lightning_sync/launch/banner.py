"""``NodeBanner``: one clear line per node, once, saying where this node sits in the job."""

from __future__ import annotations

import logging
import socket
from typing import Any

import lightning.pytorch as pl
import torch

__all__ = ["NodeBanner"]

log = logging.getLogger("lightning_sync.launch")


class NodeBanner(pl.Callback):
    """At the start of fit, local rank 0 of every node logs its hostname, node rank, local rank, world size,
    backend and rendezvous (``rendezvous``: the :class:`~lightning_sync.launch.slurm_env.Rendezvous`)."""

    def __init__(self, rendezvous: Any = None) -> None:
        self.rendezvous = rendezvous
        self.line: str | None = None  # what was logged (None on ranks that stay quiet)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.local_rank != 0 or self.line is not None:
            return
        backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "none (no process group)"
        where = (
            f", rendezvous {self.rendezvous.address}:{self.rendezvous.port} ({self.rendezvous.source})"
            if self.rendezvous is not None
            else ""
        )
        self.line = (
            f"node {trainer.node_rank} of {trainer.num_nodes} on host {socket.gethostname()}: local rank "
            f"{trainer.local_rank}, global rank {trainer.global_rank}, world size {trainer.world_size}, "
            f"backend {backend}{where}"
        )
        log.info(self.line)
