"""``AtomicCheckpointIO``: a checkpoint file is either the whole previous one or the whole new one.

Lightning's ``TorchCheckpointIO`` serializes into memory and then writes the target path in place: a
process killed during that write (preemption, OOM killer, a node failure) leaves a truncated file under
the final name, and ``ckpt_path="last"`` then picks it and fails to load, or the previous good checkpoint
was already overwritten. Here the bytes go to a hidden temporary file beside the target
(``.<name>.tmp-<pid>``: not a ``*.ckpt`` name, so ModelCheckpoint never lists it as "last" or top-k), are
fsynced, and replace the target with one ``os.replace`` (atomic on POSIX), after which the directory entry
is fsynced too (a sharded checkpoint directory of that name is renamed aside first, then deleted). A kill
at any moment leaves either the old checkpoint or the new one, plus at worst a stray temporary file that the
next save of the same name removes.

Every lightning_sync strategy uses it unless a ``checkpoint_io`` is passed; for another strategy pass
``Trainer(plugins=[AtomicCheckpointIO()])`` (its public name is ``lightning_sync.launch.AtomicCheckpointIO``; it
lives beside the strategies because they use it). Sharded directory checkpoints are made atomic by
:class:`~lightning_sync.strategies.ShardedStrategy` itself (completion marker, then
:func:`~lightning_sync.checkpoint.atomic.publish_path`).

The mechanism, files and directories alike, is :mod:`lightning_sync.checkpoint.atomic`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_sync._lightning import explicit_checkpoint_io, set_checkpoint_io
from lightning_sync.checkpoint.atomic import write_atomically
from lightning_sync.checkpoint.reading import refuse_directory

__all__ = ["AtomicCheckpointIO", "atomic_unless_set"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves are atomic (:func:`~lightning_sync.checkpoint.atomic.write_atomically`).

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

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's load; a sharded checkpoint directory is refused with what to do instead."""
        refuse_directory(path)
        return super().load_checkpoint(path, *args, **kwargs)


def atomic_unless_set(strategy: Any) -> None:
    """Give ``strategy`` an :class:`AtomicCheckpointIO` where the user set no ``checkpoint_io`` (a strategy's
    ``checkpoint_io`` property calls it before returning Lightning's)."""
    if explicit_checkpoint_io(strategy) is None:
        set_checkpoint_io(strategy, AtomicCheckpointIO())
