"""Full checkpoints of a :class:`~lightning_sync.sync.zero.engine.ZeroEngine`, in the form Lightning's ``ddp`` writes.

A *full* checkpoint is one file that plain Lightning, ``torch.load(weights_only=True)`` and
``Model.load_from_checkpoint`` read. Of what it holds, two pieces live in the engine's shards, and this module
converts them both ways:

* the module's ``state_dict``: canonical keys, original dtypes, tied parameters as the module has them (one
  tensor under each of its names), frozen parameters and persistent buffers as they are;
* each optimizer's ``state_dict()`` as the *unsharded* optimizer would have it: parameters numbered in the
  order of the param groups the user built (:attr:`ZeroEngine.user_params`), every per-element state
  (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ...) in its parameter's shape, and every scalar state
  (``step``) once per parameter.

**Saving** gathers to rank 0 one flat parameter at a time: every rank takes part in that flat parameter's
all-gather, rank 0 copies its parameters' pieces to CPU, where it accumulates the checkpoint, and the gathered
buffer goes before the next one is gathered. No rank holds more than one flat parameter's full tensor beside
what rank 0 accumulates. **Loading** needs no collective: every rank has read the file and takes its own shard
of each flat parameter, one at a time, so a full checkpoint resumes at any world size and stage, and so does a
checkpoint Lightning's ``ddp`` wrote.

Which form a strategy writes is :func:`resolve_state_dict_type`'s: a full file needs rank 0 to hold the whole
model and optimizer state, which stage 3 exists to avoid.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from lightning_sync.sync.zero.checkpoint import elementwise, replicated_state
from lightning_sync.sync.zero.flat_param import FlatParam

if TYPE_CHECKING:
    from lightning_sync.sync.zero.engine import ZeroEngine

__all__ = [
    "STATE_DICT_TYPES",
    "full_model_state",
    "full_optimizer_state",
    "is_plain_optimizer_state",
    "load_full_optimizer_state",
    "resolve_state_dict_type",
]

STATE_DICT_TYPES = ("full", "sharded")


def resolve_state_dict_type(state_dict_type: str | None, stage: int) -> str:
    """``"full"`` or ``"sharded"``; ``None`` is ``"full"`` at stages 1/2 (every rank holds the full parameters
    anyway, and Lightning's conventions assume one file) and ``"sharded"`` at stage 3 (chosen when one rank cannot
    hold the model, so rank 0 cannot hold a full checkpoint either). Anything else raises ``ValueError``."""
    if state_dict_type is None:
        return "full" if stage < 3 else "sharded"
    if not isinstance(state_dict_type, str) or state_dict_type not in STATE_DICT_TYPES:
        raise ValueError(f"state_dict_type must be one of {[*STATE_DICT_TYPES, None]}, got {state_dict_type!r}")
    return state_dict_type


def _gathered(engine: ZeroEngine, flat: FlatParam, shard: torch.Tensor) -> torch.Tensor:
    """The full padded tensor of one flat parameter's ``shard`` (the master or a state of it), on every rank, on
    the device the collectives run on (an offloaded shard is on the host)."""
    full = torch.empty(flat.layout.padded, dtype=shard.dtype, device=flat.device)
    engine.comm.all_gather_into(full, shard.detach().to(flat.device).contiguous())
    return full


def _pieces_on_cpu(flat: FlatParam, full: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """Copies of each parameter's piece of a gathered ``full`` buffer, shaped, on CPU (no view of it outlives
    the call, so the buffer goes as soon as its caller drops it)."""
    return [view.to("cpu", dtype, copy=True) for view in flat.layout.views(full)]


def _on_cpu(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def full_model_state(engine: ZeroEngine) -> dict[str, torch.Tensor]:
    """The module's full ``state_dict`` on rank 0, on CPU, gathered one flat parameter at a time from the fp32
    master shards; ``{}`` on the other ranks. A collective."""
    root = engine.comm.rank == 0
    params: dict[str, torch.Tensor] = {}
    for f in engine.flats:
        full = _gathered(engine, f, f.master)
        if root:
            params.update(zip(f.names, _pieces_on_cpu(f, full, f.orig_dtype)))
        del full
    if not root:
        return {}
    keys, replicated = replicated_state(engine)
    return {key: params[c] if c is not None else _on_cpu(replicated[key]) for key, c in keys}


def full_optimizer_state(engine: ZeroEngine, index: int = 0) -> dict[str, Any] | None:
    """The engine's optimizer ``index``'s ``state_dict()`` as the unsharded optimizer would have it (module
    docstring), on rank 0, on CPU; ``None`` on the other ranks and without an optimizer. A collective."""
    if index >= len(engine.optimizers):
        return None
    opt, user_params = engine.optimizers[index], engine.user_params[index]
    root = engine.comm.rank == 0
    number = {id(p): i for i, p in enumerate(p for group in user_params for p in group)}
    state: dict[int, dict[str, Any]] = {}
    for f in engine.flats_of(opt):
        own = opt.state.get(f.master, {})
        entries: list[dict[str, Any]] = [{} for _ in f.params]
        for key, value in own.items():  # the same keys, in the same order, on every rank
            if elementwise(value, f):
                full = _gathered(engine, f, value)
                if root:
                    for entry, piece in zip(entries, _pieces_on_cpu(f, full, value.dtype)):
                        entry[key] = piece
                del full
            elif root:  # a copy for each parameter: optimizers step a scalar state in place ('step' += 1)
                for entry in entries:
                    entry[key] = _on_cpu(value)
        if root and own:
            state.update({number[id(p)]: entry for p, entry in zip(f.params, entries) if id(p) in number})
    if not root:
        return None
    sharded = {id(p) for f in engine.flats for p in f.params}
    for group in user_params:  # parameters the engine does not shard (frozen ones the user passed)
        for p in group:
            if id(p) not in sharded and p in opt.state:
                state[number[id(p)]] = {k: _on_cpu(v) for k, v in opt.state[p].items()}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [number[id(p)] for p in mine]}
        for g, mine in zip(opt.param_groups, user_params)
    ]
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def is_plain_optimizer_state(state: Mapping[str, Any]) -> bool:
    """A torch ``optimizer.state_dict()`` (per-parameter ``state`` and numbered ``params``), not the
    hyperparameters alone that a sharded checkpoint's Lightning state holds."""
    groups = state.get("param_groups")
    return "state" in state and isinstance(groups, list) and all("params" in g for g in groups)


def load_full_optimizer_state(engine: ZeroEngine, state_dict: Mapping[str, Any], index: int = 0) -> None:
    """Load an unsharded optimizer's ``state_dict()`` (:func:`full_optimizer_state`'s, or Lightning ``ddp``'s)
    into the engine's optimizer ``index``: this rank's shard of every per-element state, the scalar states, and
    the groups' hyperparameters. Raises ``ValueError`` when the param groups do not match this optimizer's."""
    if index >= len(engine.optimizers):
        raise ValueError(
            f"the engine has {len(engine.optimizers)} optimizers, none at index {index} to load an optimizer state into"
        )
    opt, user_params = engine.optimizers[index], engine.user_params[index]
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(user_params):
        raise ValueError(
            f"checkpoint has {len(saved_groups)} optimizer param groups, this optimizer has {len(user_params)}"
        )
    number: dict[int, Any] = {}
    for gi, (saved, mine) in enumerate(zip(saved_groups, user_params)):
        if len(saved["params"]) != len(mine):
            raise ValueError(
                f"optimizer param group {gi} has {len(saved['params'])} parameters in the checkpoint, "
                f"{len(mine)} in this optimizer"
            )
        number.update({id(p): i for p, i in zip(mine, saved["params"])})
    saved_state: Mapping[Any, Mapping[str, Any]] = state_dict["state"]
    group_of = {id(p): g for g, mine in zip(opt.param_groups, user_params) for p in mine}
    sharded = {id(p): shape for f in engine.flats for p, shape in zip(f.params, f.layout.shapes)}
    # the parameters' shapes by their number (a sharded one's from its layout: at stage 3 it holds no data)
    shape_of = {number[id(p)]: sharded.get(id(p), p.shape) for mine in user_params for p in mine}
    per_element = _per_element_keys(saved_state, shape_of)
    for f in engine.flats_of(opt):
        entries = [saved_state.get(number[id(p)]) if id(p) in number else None for p in f.params]
        present = [(p, e) for p, e in zip(f.params, entries) if e]
        if not present:
            opt.state.pop(f.master, None)  # nothing saved: it starts fresh, as the unsharded one would
            continue
        own: dict[str, Any] = {}
        for key in dict.fromkeys(k for _, e in present for k in e):
            if key in per_element:
                full = f.layout.flatten(
                    [e[key].reshape(s) if e and key in e else None for e, s in zip(entries, f.layout.shapes)],
                    dtype=f.master_dtype,
                )
                own[key] = f.layout.shard(full).to(f.master.device, copy=True)  # the state lives with its master
                del full
            else:
                own[key] = _scalar(key, present, f, group_of[id(present[0][0])])
        opt.state[f.master] = own
    for mine in user_params:  # parameters the engine does not shard
        for p in mine:
            entry = saved_state.get(number[id(p)])
            if id(p) not in sharded and entry:
                opt.state[p] = {k: _placed(k, v, p, group_of[id(p)]) for k, v in entry.items()}
    for group, saved in zip(opt.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})


def _per_element_keys(saved_state: Mapping[Any, Mapping[str, Any]], shape_of: Mapping[Any, torch.Size]) -> set[str]:
    """The state keys held per element: a tensor of its (sharded) parameter's shape where that shape is not 0-d.
    A 0-d parameter's 0-d state is per element when the key is so for another parameter (``exp_avg``), and scalar
    otherwise (``step``)."""
    keys: set[str] = set()
    for index, entry in saved_state.items():
        shape = shape_of.get(index)
        for key, value in entry.items():
            if shape is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            if value.shape != shape:
                raise ValueError(
                    f"optimizer state {key!r} of parameter {index} has shape {tuple(value.shape)} in the "
                    f"checkpoint; the parameter's is {tuple(shape)}"
                )
            keys.add(key)
    return keys


def _scalar(key: str, present: list[tuple[Any, Mapping[str, Any]]], flat: FlatParam, group: Mapping[str, Any]) -> Any:
    """A scalar state of the flat parameter's master from its parameters' entries, which one master steps
    together: they should agree (a parameter stepped fewer times under DDP, when it got no gradient, does not)."""
    values = [e[key] for _, e in present if key in e]
    first = values[0]
    if any(not _equal(v, first) for v in values[1:]):
        warnings.warn(
            f"optimizer state {key!r} differs between parameters of one flat parameter ({flat.names}); "
            f"they are stepped together from here, with the first one's value {first!r}",
            stacklevel=3,
        )
    return _placed(key, first, flat.master, group)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    return a == b


def _placed(key: str, value: Any, param: torch.Tensor, group: Mapping[str, Any]) -> Any:
    """``value`` where the optimizer expects a state of ``param``, as torch's ``Optimizer.load_state_dict`` puts
    it: ``step`` stays a float32 scalar on the CPU unless the group is fused or capturable; other floating-point
    states take the parameter's dtype and device. Always a copy, never shared with another parameter's."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        on_device = group.get("fused") or group.get("capturable")
        return value.to(torch.float32, device=param.device, copy=True) if on_device else value.clone()
    dtype = param.dtype if value.is_floating_point() and param.is_floating_point() else value.dtype
    return value.to(param.device, dtype, copy=True)
