"""Checkpoint I/O, free of Lightning: reading without trusting the file, and writing atomically.

* :mod:`~lightning_sync.checkpoint.reading` - every read of a checkpoint (files and sharded directories) is
  ``weights_only`` unless the caller opts in, and stays inside its directory;
* :mod:`~lightning_sync.checkpoint.atomic` - files and directories replaced atomically, and recovered after a
  kill mid-replacement;
* :mod:`~lightning_sync.checkpoint.rank_states` - every rank's own state gathered to the writing rank as
  tensors with a JSON header, never pickled.

The Lightning plugin that writes through it is :class:`~lightning_sync.launch.atomic.AtomicCheckpointIO`; the
ZeRO sharded format is :mod:`lightning_sync.sync.zero.format`.
"""

from lightning_sync.checkpoint.atomic import publish_path, recover_dir, recover_path, write_atomically
from lightning_sync.checkpoint.reading import UntrustedCheckpointError, load_file, resolve_weights_only

__all__ = [
    "UntrustedCheckpointError",
    "load_file",
    "publish_path",
    "recover_dir",
    "recover_path",
    "resolve_weights_only",
    "write_atomically",
]
