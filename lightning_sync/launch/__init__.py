"""Launching on clusters: the SLURM rendezvous environment, the per-node banner, and atomic checkpoint files.

The names are imported on first access (PEP 562): the sbatch renderer, which lives here too, must not pay for
Lightning, which the checkpoint I/O and the banner import.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["AtomicCheckpointIO", "NodeBanner", "Rendezvous", "expand_hostlist", "first_host", "master_port", "prepare"]

_FROM = {
    "AtomicCheckpointIO": "lightning_sync.launch.atomic",
    "NodeBanner": "lightning_sync.launch.banner",
    **{name: "lightning_sync.launch.slurm_env" for name in __all__[2:]},
}


def __getattr__(name: str) -> Any:
    if name not in _FROM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_FROM[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
