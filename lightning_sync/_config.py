"""Where the shipped Hydra config lives, for the console script and for anything that composes it.

Its own module, importing nothing of lightning_sync, so that :mod:`lightning_sync.cli` and the modules the CLI
runs (:mod:`lightning_sync.launch.sbatch`) can both use it without importing each other.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["config_dir"]


def config_dir() -> str:
    """Absolute path of the shipped config: ``lightning_sync.conf`` when installed, else ``<repo>/conf``."""
    try:
        spec = importlib.util.find_spec("lightning_sync.conf")
    except ModuleNotFoundError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return str(Path(next(iter(spec.submodule_search_locations))).resolve())
    return str((Path(__file__).resolve().parent.parent / "conf").resolve())
