"""The on-disk format of a ZeRO sharded checkpoint, read by loading and by consolidation alike.

A checkpoint is a ``torch.distributed.checkpoint`` directory plus ``lightning_sync_meta.json``. Every
sharded tensor is saved in chunks keyed by parameter name and *element offset* (``model/<name>@<offset>``,
``optim/<name>/<state key>@<offset>``), never by rank, so a checkpoint written at one world size and
stage loads at any other: a reader asks for the chunks that overlap the elements it owns, reads those
that lie inside its range straight into place and copies the overlap of the others. A rank's range is
saved in pieces cut at multiples of :data:`PIECE` elements of its parameter, so a reader of another world
size reads at most two pieces per tensor beyond what it owns, not whole ranges of the writing ranks.
Replicated tensors (frozen parameters, persistent buffers) are saved whole under ``full/<key>``, and
scalar optimizer state under ``optim/<name>/<key>``. The JSON file records the format version, the
module's state-dict keys (each a sharded parameter's canonical name or replicated), and each parameter's
shape and dtype, so a mismatch is reported by key before any tensor is read. ``README.txt`` says, to whoever
lists the directory, what it is and how to read it without a sharded strategy (``lightning-sync consolidate``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from lightning_sync.checkpoint.reading import contained_path
from lightning_sync.sync.flat import OwnedSlice

__all__ = [
    "COMPLETE_MARKER",
    "FORMAT",
    "LIGHTNING_STATE",
    "META",
    "PIECE",
    "README",
    "README_TEXT",
    "Reads",
    "chunk_index",
    "pieces",
    "placeholder",
    "read_meta",
    "state_keys",
]

FORMAT = "lightning_sync.zero/1"
META = "lightning_sync_meta.json"
LIGHTNING_STATE = "lightning.pt"  # Lightning's own state in a sharded directory (rank 0 writes it)
COMPLETE_MARKER = "COMPLETE"  # rank 0 writes it after every shard and Lightning's state
README = "README.txt"
README_TEXT = """\
This directory is one sharded checkpoint of lightning_sync's ZeRO strategy (ShardedStrategy, strategy=zero1,
zero2 or zero3, state_dict_type="sharded"): every rank's shards of the parameters and the optimizer state
(torch.distributed.checkpoint), lightning_sync_meta.json (the layout) and lightning.pt (Lightning's state).

Resume or evaluate it with that strategy, at any world size and stage:
    trainer.fit(model, ckpt_path="<this directory>")

Model.load_from_checkpoint and torch.load open a file, and stop here with IsADirectoryError. One plain
Lightning checkpoint file with the full weights (for inference, export or fine-tuning), which both read:
    lightning-sync consolidate <this directory> model.ckpt
"""
#: Elements per saved piece (1 MiB of fp32): what a reader at another world size may read beyond its own range
#: is at most two pieces per tensor, and a few hundred pieces per 100M elements keep DCP's planning cheap.
PIECE = 2**18


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``lightning_sync_meta.json`` of a sharded checkpoint directory (clear error if absent)."""
    file = contained_path(path, META, "layout file")
    if not file.is_file():
        raise ValueError(f"{path} is not a lightning_sync sharded checkpoint (no {META} in it)")
    meta = json.loads(file.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{file} has format {meta.get('format')!r}; this version reads {FORMAT!r}")
    return meta


def chunk_index(saved: Mapping[str, Any]) -> dict[str, list[tuple[int, int]]]:
    """``prefix -> [(element offset, size)]`` for every ``prefix@offset`` key of a checkpoint."""
    index: dict[str, list[tuple[int, int]]] = {}
    for key, md in saved.items():
        prefix, at, lo = key.rpartition("@")
        if at and lo.isdigit():
            index.setdefault(prefix, []).append((int(lo), int(md.size[0])))
    for chunks in index.values():
        chunks.sort()
    return index


def state_keys(saved: Mapping[str, Any], name: str, scalar: bool = False) -> list[str]:
    """Optimizer-state keys saved for parameter ``name``: elementwise (``key@offset``) or scalar."""
    prefix = f"optim/{name}/"
    keys = set()
    for key in saved:
        if key.startswith(prefix):
            rest = key[len(prefix) :]
            is_chunk = "@" in rest and rest.rpartition("@")[2].isdigit()
            if is_chunk != scalar:
                keys.add(rest.rpartition("@")[0] if is_chunk else rest)
    return sorted(keys)


def placeholder(md: Any) -> Any:
    """An empty tensor shaped like a saved tensor's metadata, for DCP to load into (None: not a tensor)."""
    props = getattr(md, "properties", None)
    if props is not None and hasattr(md, "size"):
        return torch.empty(tuple(md.size), dtype=props.dtype)
    return None


def pieces(s: OwnedSlice) -> list[tuple[int, int]]:
    """The element range of ``s`` in its parameter, cut at multiples of :data:`PIECE`: ``(offset, length)``."""
    out, lo, end = [], s.param_offset, s.param_offset + s.length
    while lo < end:
        hi = min(end, (lo // PIECE + 1) * PIECE)
        out.append((lo, hi - lo))
        lo = hi
    return out


class Reads:
    """What one load asks DCP for (:attr:`want`, key -> tensor to read into) and the copies left afterwards.

    A saved chunk that lies inside a rank's range, in the destination's dtype, is read straight into the
    destination (a view): no second copy of it exists at any time. A chunk that straddles the range's edge,
    or has another dtype, is read into a buffer of its own and its overlap copied by :meth:`finish`."""

    def __init__(self) -> None:
        self.want: dict[str, Any] = {}
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(
        self,
        dest: torch.Tensor,
        prefix: str,
        chunks: Mapping[str, list[tuple[int, int]]],
        saved: Mapping[str, Any],
        s: OwnedSlice,
    ) -> None:
        """Elements ``[s.param_offset, +s.length)`` of a parameter, from its saved chunks, into ``dest``
        (at ``s.shard_offset``); ``ValueError`` when the chunks do not cover them."""
        want_lo, want_hi = s.param_offset, s.param_offset + s.length
        covered = 0
        for lo, size in chunks.get(prefix, []):
            a, b = max(lo, want_lo), min(lo + size, want_hi)
            if a >= b:
                continue
            key, view = f"{prefix}@{lo}", dest[s.shard_offset + a - want_lo : s.shard_offset + b - want_lo]
            dtype = saved[key].properties.dtype
            if (a, b) == (lo, lo + size) and dtype == dest.dtype:
                self.want[key] = view
            else:
                buffer = self.want.setdefault(key, torch.empty(size, dtype=dtype))
                self._copies.append((view, buffer[a - lo : b - lo]))
            covered += b - a
        if covered != s.length:
            raise ValueError(f"checkpoint holds {covered} of the {s.length} elements of {prefix} this rank needs")

    def finish(self) -> None:
        """Copy the overlaps of the buffered chunks into place, after DCP read them; the buffers go."""
        with torch.no_grad():
            for dest, source in self._copies:
                dest.copy_(source)
        self._copies.clear()
        self.want.clear()
