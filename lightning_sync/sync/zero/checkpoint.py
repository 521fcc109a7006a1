"""Saving and loading a :class:`~lightning_sync.sync.zero.engine.ZeroEngine`'s state.

Two forms: a *sharded* directory (every rank writes only the elements it owns, in the format of
:mod:`lightning_sync.sync.zero.format`, which reshards on load to any world size and stage), and a
*full* ``state_dict`` gathered from the shards (what a plain module or DDP would write). Both are
collectives: every rank calls them. They are functions of the engine, not methods, so the engine
module stays about training: this module imports the engine, never the other way round (the strategies,
the benchmarks and the tests call these with the engine; :mod:`lightning_sync.sync.zero` exports them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp

from lightning_sync.checkpoint.reading import dcp_load, read_dcp_metadata
from lightning_sync.sync.zero.flat_param import FlatParam
from lightning_sync.sync.zero.format import (
    FORMAT,
    META,
    README,
    README_TEXT,
    Reads,
    chunk_index,
    pieces,
    placeholder,
    read_meta,
    state_keys,
)

if TYPE_CHECKING:
    from lightning_sync.sync.zero.engine import ZeroEngine

__all__ = [
    "check_compatible",
    "full_state_dict",
    "load_full_state_dict",
    "load_sharded",
    "replicated_state",
    "save_sharded",
]


def full_state_dict(engine: ZeroEngine) -> dict[str, torch.Tensor]:
    """The module's full ``state_dict`` (copies, original dtypes, gathered from the fp32 master
    shards; tied parameters under each name); a collective."""
    params = engine.full_params()
    keys, replicated = replicated_state(engine)
    return {k: params[c] if c is not None else replicated[k].clone() for k, c in keys}


def replicated_state(engine: ZeroEngine) -> tuple[list[tuple[str, str | None]], dict[str, torch.Tensor]]:
    """The module's state-dict keys, each either a sharded parameter (its canonical name) or a
    replicated tensor (frozen parameter or persistent buffer) returned in the second dict."""
    canonical = {id(p): n for f in engine.flats for n, p in zip(f.names, f.params)}
    keys: list[tuple[str, str | None]] = []
    replicated: dict[str, torch.Tensor] = {}
    for key, value in engine.module.state_dict(keep_vars=True).items():
        if id(value) in canonical:
            keys.append((key, canonical[id(value)]))
        else:
            keys.append((key, None))
            replicated[key] = engine.original(value).detach()
    return keys, replicated


def save_sharded(engine: ZeroEngine, path: str | os.PathLike[str]) -> None:
    """Write this rank's shards (parameters and optimizer state, keyed by parameter name and element
    offset, so they reshard to any world size) through ``torch.distributed.checkpoint``; rank 0
    adds the replicated tensors, ``lightning_sync_meta.json`` and ``README.txt``. A collective."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    for f in engine.flats:
        master = f.master.detach()
        opt = engine.optimizer_of(f)  # a parameter is in one optimizer: its name keys its state
        state = opt.state.get(f.master, {}) if opt is not None else {}
        for s in f.layout.owned_slices():
            name = f.names[s.index]
            for offset, length in pieces(s):
                lo = s.shard_offset + offset - s.param_offset
                out[f"model/{name}@{offset}"] = master[lo : lo + length].clone()
                for key, value in state.items():
                    if elementwise(value, f):
                        out[f"optim/{name}/{key}@{offset}"] = value.detach()[lo : lo + length].clone()
            for key, value in state.items():
                if not elementwise(value, f) and s.param_offset == 0:
                    out[f"optim/{name}/{key}"] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    keys, replicated = replicated_state(engine)
    if engine.comm.rank == 0:
        out.update({f"full/{k}": v.clone() for k, v in replicated.items()})
        meta = {
            "format": FORMAT,
            "world_size": engine.comm.world_size,
            "stage": engine.stage,
            "params": {
                n: [list(shape), str(f.orig_dtype)] for f in engine.flats for n, shape in zip(f.names, f.layout.shapes)
            },
            "keys": keys,
        }
        (path / META).write_text(json.dumps(meta, indent=1))
        (path / README).write_text(README_TEXT)
    dcp.save(out, checkpoint_id=str(path), process_group=getattr(engine.comm, "group", None))


def param_shapes(engine: ZeroEngine) -> dict[str, list[int]]:
    """Canonical name -> shape (a list, as the layout file stores it) of every parameter the engine shards."""
    return {n: list(shape) for f in engine.flats for n, shape in zip(f.names, f.layout.shapes)}


def check_compatible(engine: ZeroEngine, meta: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the first key where the checkpoint and this module differ."""
    mine, _ = replicated_state(engine)
    theirs = [tuple(k) for k in meta["keys"]]
    shapes = param_shapes(engine)
    for (mk, mc), (tk, tc) in zip(mine, theirs):
        if mk != tk or (mc is None) != (tc is None):
            raise ValueError(
                f"checkpoint does not match this model: first mismatched key {mk!r} (checkpoint has {tk!r} there)"
            )
        if mc is not None and (mc != tc or shapes[mc] != meta["params"][tc][0]):
            raise ValueError(
                f"checkpoint does not match this model: first mismatched key {mk!r} "
                f"(shape {shapes.get(mc)} here, {meta['params'].get(tc, [None])[0]} in the checkpoint)"
            )
    if len(mine) != len(theirs):
        first = mine[len(theirs)][0] if len(mine) > len(theirs) else theirs[len(mine)][0]
        raise ValueError(
            f"checkpoint does not match this model: first mismatched key {first!r} "
            f"({'missing from the checkpoint' if len(mine) > len(theirs) else 'not in this model'})"
        )


def check_parameters(engine: ZeroEngine, meta: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the first of this engine's parameters the checkpoint lacks or shapes otherwise."""
    for name, shape in param_shapes(engine).items():
        theirs = meta["params"].get(name, [None])[0]
        if theirs != shape:
            there = "missing from the checkpoint" if theirs is None else f"shape {theirs} there"
            raise ValueError(f"checkpoint does not match this model: parameter {name!r} ({there}, {shape} here)")


class _Scalar(NamedTuple):
    """A scalar optimizer state to take from the read checkpoint entry ``key``."""

    key: str


def load_sharded(
    engine: ZeroEngine, path: str | os.PathLike[str], weights_only: bool | None = None, model: bool = True
) -> None:
    """Load a :func:`save_sharded` checkpoint written at any world size and stage; a collective.
    Weights-only (see :mod:`lightning_sync.checkpoint.reading`) unless ``weights_only=False``; a directory that
    would read files outside itself, or has no DCP ``.metadata``, raises ``ValueError`` whatever the trust.
    ``model=False`` reads the optimizer state only, and asks of the checkpoint only that it holds this engine's
    parameters (by name and shape), whatever else its module's state held (the caller loads the model)."""
    path = Path(path)
    meta = read_meta(path)
    if model:
        check_compatible(engine, meta)
    else:
        check_parameters(engine, meta)
    metadata = read_dcp_metadata(path, weights_only)
    saved = metadata.state_dict_metadata
    chunks = chunk_index(saved)
    reads = Reads()
    states: list[dict[str, Any]] = []
    for f in engine.flats:
        # the optimizer's state is filled in place where it exists (a run that already stepped); a resuming
        # run's fresh optimizer has none, and gets this rank's shard of it, once
        opt = engine.optimizer_of(f)
        old = opt.state.get(f.master, {}) if opt is not None else {}
        state: dict[str, Any] = {}
        for s in f.layout.owned_slices():
            name = f.names[s.index]
            if model:
                reads.add(f.master.data, f"model/{name}", chunks, saved, s)
            for k in state_keys(saved, name):
                dtype = saved[f"optim/{name}/{k}@{chunks[f'optim/{name}/{k}'][0][0]}"].properties.dtype
                if k not in state:
                    mine = old.get(k)
                    fits = isinstance(mine, torch.Tensor) and elementwise(mine, f) and mine.dtype == dtype
                    state[k] = mine if fits else torch.zeros(f.layout.shard_numel, dtype=dtype, device=f.master.device)
                reads.add(state[k], f"optim/{name}/{k}", chunks, saved, s)
            for k in state_keys(saved, name, scalar=True):
                reads.want[f"optim/{name}/{k}"] = placeholder(saved[f"optim/{name}/{k}"])
                state.setdefault(k, _Scalar(f"optim/{name}/{k}"))  # its value once read
        states.append(state)
    _, replicated = replicated_state(engine)
    for key, tensor in replicated.items() if model else ():
        reads.want[f"full/{key}"] = tensor
    engine.reshard()  # no all-gather in flight (a step's prefetch) reads the masters while they are written
    with torch.no_grad():
        dcp_load(reads.want, path, weights_only, metadata=metadata, process_group=getattr(engine.comm, "group", None))
        scalars = {k: v for k, v in reads.want.items() if k.startswith("optim/") and "@" not in k}
        reads.finish()
    for f, state in zip(engine.flats, states):
        for k, value in state.items():
            if isinstance(value, _Scalar):
                scalar = scalars[value.key]
                state[k] = scalar.to(f.master.device) if isinstance(scalar, torch.Tensor) else scalar
        opt = engine.optimizer_of(f)
        if opt is not None:
            if state:
                opt.state[f.master] = state
            else:
                opt.state.pop(f.master, None)
    engine.after_load()


def load_full_state_dict(engine: ZeroEngine, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a plain full ``state_dict`` (e.g. one :func:`full_state_dict` or DDP wrote): every rank
    takes its shards from it. Names the first missing key, or the first of another shape, before anything loads
    (a flat buffer would take any tensor of as many elements, and a replicated one any it broadcasts from)."""
    keys, replicated = replicated_state(engine)
    shapes = param_shapes(engine)
    for key, name in keys:
        if key not in state_dict:
            raise ValueError(f"state_dict does not match this model: first mismatched key {key!r} (missing)")
        here = shapes[name] if name is not None else list(replicated[key].shape)
        if list(state_dict[key].shape) != here:
            raise ValueError(
                f"state_dict does not match this model: first mismatched key {key!r} "
                f"(shape {list(state_dict[key].shape)} in it, {here} here)"
            )
    engine.reshard()  # no all-gather in flight (a step's prefetch) reads the masters while they are written
    with torch.no_grad():
        for f in engine.flats:
            flat = f.layout.flatten(
                [state_dict[n].to(f.master_dtype).reshape(s) for n, s in zip(f.names, f.layout.shapes)]
            )
            f.master.data.copy_(f.layout.shard(flat))
        for key, tensor in replicated.items():
            tensor.copy_(state_dict[key])
    engine.after_load()


def elementwise(value: Any, flat: FlatParam) -> bool:
    """An optimizer-state tensor with one value per shard element (sharded with it), not a scalar."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == flat.layout.shard_numel
