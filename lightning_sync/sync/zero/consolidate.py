"""One full ``state_dict`` from a ZeRO sharded checkpoint, in one process, for inference or export.

It reads the chunks a sharded load reads (see :mod:`lightning_sync.sync.zero.format`), but for every
element of every parameter, so it needs neither a process group nor the model. It streams: each full
parameter is allocated once, in its original dtype, and every saved chunk is read straight into its
slice of it (DCP reads one chunk at a time and copies it into the destination it was handed), so the
chunks are never all held beside the full model, and the optimizer state in the same files is never read.
Peak memory is the full model plus one chunk.
Measured: a 2-rank ZeRO-3 checkpoint of a 64 MiB MLP with AdamW (193 MiB on disk) raises a fresh process's peak
RSS by 131 MiB loading every chunk first and copying, by 83 MiB streamed (the largest chunk is 16 MiB).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from lightning_sync.checkpoint.reading import dcp_load, read_dcp_metadata
from lightning_sync.sync.zero.format import chunk_index, placeholder, read_meta

__all__ = ["consolidate_checkpoint"]


def consolidate_checkpoint(path: str | os.PathLike[str], weights_only: bool = True) -> dict[str, torch.Tensor]:
    """A plain full ``state_dict`` (original keys, order and dtypes; tied parameters under every name)
    from a sharded checkpoint directory, in one process, without a process group. For inference.
    Weights-only (see :mod:`lightning_sync.checkpoint.reading`) unless ``weights_only=False``; a directory that
    would read files outside itself, or has no DCP ``.metadata``, raises ``ValueError`` whatever the trust,
    before anything is read. A parameter whose chunks do not cover it raises ``ValueError`` naming it."""
    meta = read_meta(path)
    metadata = read_dcp_metadata(path, weights_only)
    saved = metadata.state_dict_metadata
    chunks = chunk_index(saved)
    params: dict[str, torch.Tensor] = {}
    # every destination DCP fills: a chunk's slice of its full parameter, or a replicated tensor whole
    into: dict[str, Any] = {}
    for name, (shape, dtype) in meta["params"].items():
        full = torch.empty(shape, dtype=_dtype(dtype, name))
        flat = full.view(-1)
        for lo, size in _covering(f"model/{name}", chunks.get(f"model/{name}", []), flat.numel()):
            into[f"model/{name}@{lo}"] = flat[lo : lo + size]  # DCP casts fp32 masters to this dtype
        params[name] = full
    for key, canonical in meta["keys"]:
        if canonical is None:
            if f"full/{key}" not in saved:
                raise ValueError(f"checkpoint {os.fspath(path)} lists {key!r} as replicated but holds no full/{key}")
            into[f"full/{key}"] = placeholder(saved[f"full/{key}"])
    with warnings.catch_warnings():  # "torch.distributed is disabled..." is what no_dist asks for
        warnings.filterwarnings("ignore", message=".*torch.distributed.*disabled.*")
        dcp_load(into, path, weights_only, metadata=metadata, no_dist=True)
    return {key: params[canon] if canon is not None else into[f"full/{key}"] for key, canon in meta["keys"]}


def _dtype(name: str, param: str) -> torch.dtype:
    """The torch dtype a layout file names (``"torch.float32"``); anything else is refused."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"parameter {param!r} has dtype {name!r} in the layout file, which is no torch dtype")
    return dtype


def _covering(prefix: str, spans: list[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    """``spans`` (the sorted ``(offset, size)`` chunks of a parameter), checked to tile ``[0, numel)``: a gap,
    an overlap or a chunk past the end means another layout than this one, or elements left unset."""
    end = 0
    for lo, size in spans:
        if lo != end or lo + size > numel:
            break
        end = lo + size
    else:
        if end == numel:
            return spans
    raise ValueError(f"checkpoint holds chunks {spans} of {prefix}, which do not tile its {numel} elements")
