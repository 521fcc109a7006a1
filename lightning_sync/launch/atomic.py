"""``AtomicCheckpointIO``: a checkpoint file is either the whole previous one or the whole new one.

Lightning's ``TorchCheckpointIO`` serializes into memory and then writes the target path in place: a
process killed during that write (preemption, OOM killer, a node failure) leaves a truncated file under
the final name, and ``ckpt_path="last"`` then picks it and fails to load, or the previous good checkpoint
was already overwritten. Here the bytes go to a hidden temporary file beside the target
(``.<name>.tmp-<pid>``: not a ``*.ckpt`` name, so ModelCheckpoint never lists it as "last" or top-k), are
fsynced, and replace the target with one ``os.replace`` (atomic on POSIX), after which the directory entry
is fsynced too. A kill at any moment leaves either the old file or the new one, plus at worst a stray
temporary file that the next save of the same name removes.

Every lightning_sync strategy uses it unless a ``checkpoint_io`` is passed; for another strategy pass
``Trainer(plugins=[AtomicCheckpointIO()])``. Sharded directory checkpoints are made atomic by
:class:`~lightning_sync.strategies.ShardedStrategy` itself (completion marker, then rename).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO

__all__ = ["AtomicCheckpointIO", "fsync_dir", "fsync_path", "publish_path", "remove_path", "write_atomically"]


def fsync_dir(directory: Path) -> None:
    """fsync a directory, so the names created or renamed in it survive a crash."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: Path) -> None:
    """fsync a file, or every file and directory under a directory (sharded checkpoints), then its parent."""
    paths = [path] if path.is_file() else [*sorted(p for p in path.rglob("*")), path]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(path.parent)


def remove_path(path: Path) -> None:
    """Remove a file, link or directory tree; nothing to do when there is nothing there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def write_atomically(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Write ``path`` through the hidden temporary file ``.<name>.tmp-<pid>`` beside it: ``write(f)``,
    flush, fsync, ``os.replace`` onto ``path``, fsync the directory. A kill at any moment leaves the old
    file or the new one (and at worst the stray temporary file, which the next write of ``path`` replaces)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def publish_path(tmp: Path, final: Path) -> None:
    """Make the complete file or directory ``tmp`` the one at ``final``: fsync it, then rename it.

    A file replaces ``final`` in one ``os.replace``. A directory cannot replace a non-empty one, so an
    existing ``final`` directory is first renamed aside (``.<name>.old``) and removed after the swap."""
    fsync_path(tmp)
    aside = final.with_name(f".{final.name}.old")
    move_aside = final.is_dir() and not final.is_symlink()
    if move_aside:
        remove_path(aside)
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if move_aside:
        remove_path(aside)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves are atomic (:func:`write_atomically`).

    Remote filesystems (``s3://`` and the like, through fsspec) fall back to Lightning's own write.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options, got {storage_options!r}")
        protocol = get_filesystem(path).protocol
        if "file" not in ((protocol,) if isinstance(protocol, str) else tuple(protocol)):
            super().save_checkpoint(checkpoint, path)
            return
        write_atomically(Path(path), lambda f: torch.save(checkpoint, f))
