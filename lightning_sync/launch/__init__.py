"""Launching on clusters: the SLURM rendezvous environment, the per-node banner,
and atomic checkpoint files."""

from lightning_sync.launch.atomic import AtomicCheckpointIO
from lightning_sync.launch.banner import NodeBanner
from lightning_sync.launch.slurm_env import Rendezvous, expand_hostlist, first_host, master_port, prepare

__all__ = ["AtomicCheckpointIO", "NodeBanner", "Rendezvous", "expand_hostlist", "first_host", "master_port", "prepare"]
