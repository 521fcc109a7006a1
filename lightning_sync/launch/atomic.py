"""Atomic checkpoints for launching and requeueing: :class:`AtomicCheckpointIO` (Lightning's face of them, kept
beside the strategies in :mod:`lightning_sync.strategies._checkpoint_io`, which every strategy uses by default) and
the atomic file and directory replacement of :mod:`lightning_sync.checkpoint.atomic`, under the names the launch
code and users import them by.
"""

from __future__ import annotations

from lightning_sync.checkpoint.atomic import (
    fsync_dir,
    fsync_path,
    publish_path,
    recover_dir,
    recover_path,
    remove_path,
    write_atomically,
)
from lightning_sync.strategies._checkpoint_io import AtomicCheckpointIO

__all__ = [
    "AtomicCheckpointIO",
    "fsync_dir",
    "fsync_path",
    "publish_path",
    "recover_dir",
    "recover_path",
    "remove_path",
    "write_atomically",
]
