"""Launching on clusters (issue 6 grows this package): the SLURM rendezvous environment and the per-node banner."""

from lightning_sync.launch.banner import NodeBanner
from lightning_sync.launch.slurm_env import Rendezvous, expand_hostlist, first_host, master_port, prepare

__all__ = ["NodeBanner", "Rendezvous", "expand_hostlist", "first_host", "master_port", "prepare"]
