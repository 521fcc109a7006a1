"""Launching on clusters (issue 6 grows this package): the SLURM rendezvous environment for now."""

from lightning_sync.launch.slurm_env import Rendezvous, expand_hostlist, first_host, master_port, prepare

__all__ = ["Rendezvous", "expand_hostlist", "first_host", "master_port", "prepare"]
