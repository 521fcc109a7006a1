"""One full ``state_dict`` from a ZeRO sharded checkpoint, in one process, for inference or export.

It reads the same chunks a sharded load reads (see :mod:`lightning_sync.sync.zero_format`), but asks
for every element of every parameter at once, so it needs neither a process group nor the model.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import torch

from lightning_sync.sync.flat import OwnedSlice
from lightning_sync.sync.safe_load import dcp_load, read_dcp_metadata
from lightning_sync.sync.zero_format import chunk_index, fill, placeholder, read_meta

__all__ = ["consolidate_checkpoint"]


def consolidate_checkpoint(path: str | os.PathLike[str], weights_only: bool = True) -> dict[str, torch.Tensor]:
    """A plain full ``state_dict`` (original keys, order and dtypes; tied parameters under every name)
    from a sharded checkpoint directory, in one process, without a process group. For inference.
    Weights-only (see :mod:`lightning_sync.sync.safe_load`) unless ``weights_only=False``; a directory that
    would read files outside itself, or has no DCP ``.metadata``, raises ``ValueError`` whatever the trust."""
    meta = read_meta(path)
    metadata = read_dcp_metadata(path, weights_only)
    saved = metadata.state_dict_metadata
    chunks = chunk_index(saved)
    want: dict[str, Any] = {
        k: placeholder(md) for k, md in saved.items() if k.startswith("full/") or (k.startswith("model/") and "@" in k)
    }
    with warnings.catch_warnings():  # "torch.distributed is disabled..." is what no_dist asks for
        warnings.filterwarnings("ignore", message=".*torch.distributed.*disabled.*")
        dcp_load(want, path, weights_only, metadata=metadata, no_dist=True)
    params: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in meta["params"].items():
        numel = math.prod(shape)
        flat = torch.empty(numel, dtype=torch.float64 if dtype == "torch.float64" else torch.float32)
        fill(flat, f"model/{name}", chunks, want, OwnedSlice(0, 0, 0, numel))
        params[name] = flat.view(shape).to(getattr(torch, dtype.removeprefix("torch.")))
    return {key: params[canon] if canon is not None else want[f"full/{key}"] for key, canon in meta["keys"]}
