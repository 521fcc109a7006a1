"""Files and directories replaced atomically: a reader sees the whole old one or the whole new one, never a part.

The bytes of a file go to a hidden temporary file beside the target (``.<name>.tmp-<pid>``: not a ``*.ckpt``
name, so ModelCheckpoint never lists it as "last" or top-k), are fsynced, and replace the target with one
``os.replace`` (atomic on POSIX), after which the directory entry is fsynced too.

A directory cannot replace a non-empty one in one rename, nor a file a directory or a directory a file (a sharded
checkpoint saved where a full one of the same name is, or the other way round), so :func:`publish_path` then takes
three: the old checkpoint moves aside to ``.<name>.old``, the new one takes the name, and the old one moves on to a
``.<name>.del-<random>`` name before it is deleted. A kill between the first two leaves no checkpoint under the
name, only the whole old one aside: :func:`recover_path` (a start that loads a checkpoint) renames it back,
and :func:`recover_dir` does so for a whole checkpoint directory before ``ckpt_path="last"`` looks for one.
``.old`` only ever comes and goes by a rename, so it is always a whole checkpoint; a deletion killed partway
leaves a ``.del-`` name, never restored and cleared by the next save of that name.

Lightning-free, so that tools which only read or write checkpoint files (``lightning-sync consolidate``) start
without importing Lightning; :class:`~lightning_sync.launch.atomic.AtomicCheckpointIO` is Lightning's face of it.
"""

from __future__ import annotations

import glob
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["fsync_dir", "fsync_path", "publish_path", "recover_dir", "recover_path", "remove_path", "write_atomically"]


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
    """Write ``path`` through the hidden temporary file ``.<name>.tmp-<pid>`` beside it: ``write(f)``, then
    :func:`publish_path` (fsync, and one ``os.replace`` onto an old file; an old directory goes aside first).
    A kill at any moment leaves the old checkpoint or the new one (and at worst the stray temporary file, which
    the next write of ``path`` replaces)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
        publish_path(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _aside(final: Path) -> Path:
    return final.with_name(f".{final.name}.old")


def _discard(aside: Path, final: Path) -> None:
    """Delete the old checkpoint ``aside`` of ``final``: first out of the ``.old`` name in one rename (so a kill
    during the deletion never leaves a part of it there), then its tree. Nothing to do when another process
    took it first."""
    trash = final.with_name(f".{final.name}.del-{uuid.uuid4().hex}")
    try:
        os.replace(aside, trash)
    except FileNotFoundError:
        return
    fsync_dir(final.parent)
    remove_path(trash)


def recover_path(final: str | os.PathLike[str]) -> None:
    """Finish what a :func:`publish_path` of ``final`` killed midway left (module docstring): with ``final``
    missing, its old copy ``.<name>.old`` is renamed back; with both there, the old copy is deleted.

    Call it before loading ``final``. Safe in every rank of a job at once: each outcome is one rename of
    ``.old``, which only one process can make, and a loser finds the winner's result."""
    final = Path(final)
    aside = _aside(final)
    if not aside.exists():
        return
    if final.exists() or final.is_symlink():
        _discard(aside, final)
        return
    try:
        os.replace(aside, final)
    except FileNotFoundError:  # another process of the job renamed it back first
        return
    fsync_dir(final.parent)


def recover_dir(directory: str | os.PathLike[str]) -> None:
    """:func:`recover_path` for every checkpoint of ``directory`` with an old copy there: what a start must do
    before looking for one by listing the directory (Lightning's ``ckpt_path="last"``)."""
    for aside in Path(directory).glob(".?*.old"):
        recover_path(aside.with_name(aside.name[1:].removesuffix(".old")))


def publish_path(tmp: Path, final: Path) -> None:
    """Make the complete file or directory ``tmp`` the one at ``final``: fsync it, then rename it.

    A file replaces a file (or nothing) at ``final`` in one ``os.replace``. A rename cannot replace a non-empty
    directory, nor put a directory where a file is, so an existing ``final`` directory, or any ``final`` when
    ``tmp`` is a directory, is first renamed aside (``.<name>.old``), then deleted (module docstring).
    A publish killed earlier is finished first (:func:`recover_path`)."""
    fsync_path(tmp)
    recover_path(final)
    for trash in final.parent.glob(f".{glob.escape(final.name)}.del-*"):  # deletions killed partway
        remove_path(trash)
    aside = _aside(final)
    exists = final.exists() or final.is_symlink()
    move_aside = (final.is_dir() and not final.is_symlink()) or (exists and tmp.is_dir())
    if move_aside:
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if move_aside:
        _discard(aside, final)
