"""ZeRO sharding (Rajbhandari et al., SC 2020): where its pieces live, and the names importers use.

Sharded data parallelism keeps 1/K of the training state per rank and moves the rest with two even,
metadata-free collectives: an **all-gather** of the flat parameter shards before they are used, and a
**reduce-scatter** of the flat gradients into each rank's averaged shard. It is written in parts, one
concern a module, and this module re-exports their public names so ``lightning_sync.sync.sharding``
keeps working as the one import:

* :mod:`~lightning_sync.sync.flat` - the flat, padded, evenly sharded layout (:class:`FlatShard`,
  :class:`OwnedSlice`), shared with DDP bucketing and the parameter-server wire;
* :mod:`~lightning_sync.sync.flat_param` - one flat parameter's buffers and collectives (:class:`FlatParam`);
* :mod:`~lightning_sync.sync.zero_units` - which parameters go together (:class:`Unit`);
* :mod:`~lightning_sync.sync.zero_engine` - :class:`ZeroEngine`, stages 1-3 on the shared backward engine;
* :mod:`~lightning_sync.sync.zero_checkpoint` / :mod:`~lightning_sync.sync.zero_format` - sharded and
  full checkpoints, and their on-disk format (:func:`read_meta`);
* :mod:`~lightning_sync.sync.zero_consolidate` - :func:`consolidate_checkpoint`, one process, no group;
* :mod:`~lightning_sync.sync.zero_options` - argument checks and the memory model (:func:`zero_memory_bytes`).
"""

from __future__ import annotations

from lightning_sync.sync.flat import FlatShard, OwnedSlice
from lightning_sync.sync.flat_param import FlatParam
from lightning_sync.sync.zero_consolidate import consolidate_checkpoint
from lightning_sync.sync.zero_engine import ZeroEngine
from lightning_sync.sync.zero_format import read_meta
from lightning_sync.sync.zero_options import (
    ZERO_STAGES,
    check_stage,
    import_class,
    resolve_dtype,
    resolve_wrap_policy,
    storage_bytes,
    zero_memory_bytes,
)
from lightning_sync.sync.zero_units import Unit

__all__ = [
    "FlatParam",
    "FlatShard",
    "OwnedSlice",
    "Unit",
    "ZERO_STAGES",
    "ZeroEngine",
    "check_stage",
    "consolidate_checkpoint",
    "import_class",
    "read_meta",
    "resolve_dtype",
    "resolve_wrap_policy",
    "storage_bytes",
    "zero_memory_bytes",
]
