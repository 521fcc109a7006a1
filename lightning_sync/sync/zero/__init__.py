"""ZeRO sharding (Rajbhandari et al., SC 2020): the package, and the names importers use.

Sharded data parallelism keeps 1/K of the training state per rank and moves the rest with two even,
metadata-free collectives: an **all-gather** of the flat parameter shards before they are used, and a
**reduce-scatter** of the flat gradients into each rank's averaged shard. It is written in parts, one
concern a module; the package exports their public names:

* :mod:`~lightning_sync.sync.flat` - the flat, padded, evenly sharded layout (:class:`FlatShard`,
  :class:`OwnedSlice`), shared with DDP bucketing and the parameter-server wire;
* :mod:`~lightning_sync.sync.zero.flat_param` - one flat parameter's buffers and collectives (:class:`FlatParam`);
* :mod:`~lightning_sync.sync.zero.units` - which parameters go together (:class:`Unit`);
* :mod:`~lightning_sync.sync.zero.optimizers` - which optimizer steps each flat parameter (one or several);
* :mod:`~lightning_sync.sync.zero.engine` - :class:`ZeroEngine`, stages 1-3 on the shared backward engine;
* :mod:`~lightning_sync.sync.zero.checkpoint` / :mod:`~lightning_sync.sync.zero.format` - sharded and
  full checkpoints of an engine (:func:`save_sharded`, :func:`load_sharded`, :func:`full_state_dict`,
  :func:`load_full_state_dict`), and their on-disk format (:func:`read_meta`);
* :mod:`~lightning_sync.sync.zero.full_checkpoint` - one-file checkpoints in Lightning's ``ddp`` format: the
  module's state and the unsharded optimizer's ``state_dict()``, gathered to rank 0 and resharded on load;
* :mod:`~lightning_sync.sync.zero.grad_scaler` - :class:`ShardedGradScaler`: fp16 loss scaling whose skip-or-step
  decision every rank shares;
* :mod:`~lightning_sync.sync.zero.consolidate` - :func:`consolidate_checkpoint`, one process, no group;
* :mod:`~lightning_sync.sync.zero.summon` - :func:`summon_full_params`: the module's full parameters for a
  while, changes written back into the shards (for code written for a plain module, such as callbacks);
* :mod:`~lightning_sync.sync.zero.options` - argument checks and the memory model (:func:`zero_memory_bytes`).
"""

from __future__ import annotations

from lightning_sync.sync.flat import FlatShard, OwnedSlice
from lightning_sync.sync.zero.checkpoint import full_state_dict, load_full_state_dict, load_sharded, save_sharded
from lightning_sync.sync.zero.consolidate import consolidate_checkpoint
from lightning_sync.sync.zero.engine import ZeroEngine
from lightning_sync.sync.zero.flat_param import FlatParam
from lightning_sync.sync.zero.format import read_meta
from lightning_sync.sync.zero.grad_scaler import ShardedGradScaler
from lightning_sync.sync.zero.options import (
    ZERO_STAGES,
    check_stage,
    import_class,
    resolve_dtype,
    resolve_wrap_policy,
    storage_bytes,
    zero_memory_bytes,
)
from lightning_sync.sync.zero.summon import summon_full_params
from lightning_sync.sync.zero.units import Unit

__all__ = [
    "FlatParam",
    "FlatShard",
    "OwnedSlice",
    "ShardedGradScaler",
    "Unit",
    "ZERO_STAGES",
    "ZeroEngine",
    "check_stage",
    "consolidate_checkpoint",
    "full_state_dict",
    "import_class",
    "load_full_state_dict",
    "load_sharded",
    "read_meta",
    "resolve_dtype",
    "resolve_wrap_policy",
    "save_sharded",
    "storage_bytes",
    "summon_full_params",
    "zero_memory_bytes",
]
