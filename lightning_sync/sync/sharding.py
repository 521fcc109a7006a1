"""Flat-parameter sharding: the data layout under ZeRO stages 1-3 (Rajbhandari et al., SC 2020).

A :class:`FlatShard` flattens a group of parameters (one dtype) into one buffer of
``padded = ceil(total / K) * K`` elements, so it splits into K equal contiguous shards; rank r owns
elements ``[r * shard, (r + 1) * shard)``. Padding sits at the very end of the last shard(s), is kept
at zero, and is never visible through :meth:`FlatShard.views`.

The two collectives of sharded training are then even and metadata-free:

* **all-gather** the K shards into the full flat buffer (before a unit's forward/backward in stage 3,
  after the optimizer step in stages 1 and 2): each rank sends ``shard`` elements;
* **reduce-scatter** the full flat gradient into this rank's averaged shard (stages 2 and 3): each
  rank contributes ``padded`` elements and keeps ``shard``.

:meth:`FlatShard.owned_slices` says which part of which parameter falls in this rank's shard, so an
optimizer can step exactly the owned elements (stage 1/2 optimizer-state sharding).

:func:`zero_memory_bytes` is the per-rank memory model of the ZeRO paper for mixed-precision Adam
(2 bytes fp16 parameters, 2 bytes fp16 gradients, K=12 bytes of optimizer state per parameter:
fp32 master copy, momentum and variance): baseline 16Ψ, stage 1 4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N,
stage 3 16Ψ/N.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lightning_sync.sync.bucketing import SyncSwitch, check_mib, plan_buckets
from lightning_sync.sync.communicator import Communicator
from lightning_sync.sync.safe_load import contained_path, dcp_load, read_dcp_metadata

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

ZERO_STAGES = (1, 2, 3)


@dataclass(frozen=True)
class OwnedSlice:
    """Elements ``[param_offset, param_offset + length)`` of parameter ``index`` (flattened) live at
    ``[shard_offset, shard_offset + length)`` of this rank's shard."""

    index: int
    param_offset: int
    shard_offset: int
    length: int


class FlatShard:
    """The flat, padded, evenly sharded layout of ``shapes`` over ``world_size`` ranks.

    Args:
        shapes: the parameters' shapes, in flattening order.
        world_size: K, the number of shards (>= 1).
        rank: this rank's shard index, ``0 <= rank < K``.
    """

    def __init__(self, shapes: Sequence[torch.Size | tuple[int, ...]], world_size: int, rank: int) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [math.prod(s) for s in self.shapes]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.total = sum(self.numels)
        self.world_size, self.rank = world_size, rank
        self.shard_numel = -(-self.total // world_size) if self.total else 0
        self.padded = self.shard_numel * world_size
        self.start = rank * self.shard_numel
        self.end = self.start + self.shard_numel

    @property
    def padding(self) -> int:
        """Zero elements appended so the buffer divides by K."""
        return self.padded - self.total

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """One padded flat buffer holding ``tensors`` (which must have :attr:`shapes`)."""
        if len(tensors) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} tensors, got {len(tensors)}")
        ref = tensors[0] if tensors else torch.empty(0)
        flat = ref.new_zeros(self.padded)
        for t, shape, off, n in zip(tensors, self.shapes, self.offsets, self.numels):
            if t.shape != shape:
                raise ValueError(f"tensor of shape {tuple(t.shape)} where {tuple(shape)} was planned")
            flat[off : off + n] = t.reshape(-1)
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a full flat buffer shaped like the parameters (padding excluded)."""
        self._check_full(flat)
        return [flat[off : off + n].view(shape) for off, n, shape in zip(self.offsets, self.numels, self.shapes)]

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full flat buffer (a view)."""
        self._check_full(flat)
        return flat[self.start : self.end]

    def owned_slices(self) -> list[OwnedSlice]:
        """The pieces of parameters inside this rank's shard, in order (padding excluded)."""
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(off, self.start), min(off + n, self.end)
            if lo < hi:
                out.append(OwnedSlice(i, lo - off, lo - self.start, hi - lo))
        return out

    def all_gather(self, shard: torch.Tensor, comm: Communicator, async_op: bool = False) -> object:
        """Gather every rank's shard into a new full flat buffer (a Work if ``async_op``)."""
        if shard.numel() != self.shard_numel:
            raise ValueError(f"shard has {shard.numel()} elements, the plan has {self.shard_numel}")
        full = shard.new_empty(self.padded)
        return comm.all_gather_into(full, shard, async_op=async_op)

    def reduce_scatter(self, flat: torch.Tensor, comm: Communicator, op: str = "avg", async_op: bool = False) -> object:
        """Reduce a full flat buffer over the ranks into a new shard (a Work if ``async_op``)."""
        self._check_full(flat)
        out = flat.new_empty(self.shard_numel)
        return comm.reduce_scatter_into(out, flat, op=op, async_op=async_op)

    def _check_full(self, flat: torch.Tensor) -> None:
        if flat.dim() != 1 or flat.numel() != self.padded:
            raise ValueError(f"expected a flat buffer of {self.padded} elements, got shape {tuple(flat.shape)}")


def zero_memory_bytes(
    num_params: int, world_size: int, stage: int, optimizer_bytes: int = 12, param_bytes: int = 2, grad_bytes: int = 2
) -> float:
    """Per-rank bytes of parameters, gradients and optimizer state (mixed-precision Adam by default).

    ``stage`` 0 is the unsharded baseline; ``optimizer_bytes`` is K of the ZeRO paper (12 for
    mixed-precision Adam: fp32 master, momentum, variance; 8 for fp32 Adam, whose parameters are their
    own master; 4 for SGD with momentum). With p = ``param_bytes`` and g = ``grad_bytes``: baseline
    (p+g+K)Ψ, stage 1 (p+g)Ψ + KΨ/N, stage 2 pΨ + (g+K)Ψ/N, stage 3 (p+g+K)Ψ/N.
    """
    if stage not in (0, *ZERO_STAGES):
        raise ValueError(f"stage must be one of {[0, *ZERO_STAGES]} (0 = no sharding), got {stage!r}")
    if world_size < 1 or num_params < 0:
        raise ValueError(f"need world_size >= 1 and num_params >= 0, got {world_size=}, {num_params=}")
    psi, n, k = float(num_params), float(world_size), float(optimizer_bytes)
    p, g = float(param_bytes), float(grad_bytes)
    return {
        0: (p + g + k) * psi,
        1: (p + g) * psi + k * psi / n,
        2: p * psi + (g + k) * psi / n,
        3: (p + g + k) * psi / n,
    }[stage]


# ====================================================================== the ZeRO engine
_MB = 2**20
_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "16": torch.float16,
    "half": torch.float16,
}


def check_stage(stage: Any) -> int:
    """``stage`` if it is one of :data:`ZERO_STAGES` (an int, not a bool or float), else a ValueError."""
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in ZERO_STAGES:
        raise ValueError(f"stage must be one of {list(ZERO_STAGES)}, got {stage!r}")
    return stage


def resolve_dtype(value: Any, what: str) -> torch.dtype | None:
    """``None``, a floating ``torch.dtype`` or one of the names in ``_DTYPES`` (for Hydra)."""
    if value is None or isinstance(value, torch.dtype) and value.is_floating_point:
        return value
    if isinstance(value, str) and value.lower() in _DTYPES:
        return _DTYPES[value.lower()]
    raise ValueError(f"{what} must be None, a floating torch.dtype or one of {sorted(_DTYPES)}, got {value!r}")


def import_class(path: str, what: str = "wrap_policy") -> type:
    """The class a dotted path (``"torch.nn.Linear"``) names; a ValueError naming ``what`` and the path."""
    module_name, _, attr = path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"{what} names {path!r}, which is not an importable class") from err
    if not isinstance(obj, type):
        raise ValueError(f"{what} names {path!r}, which is not a class")
    return obj


def resolve_wrap_policy(policy: Any) -> Callable[[nn.Module, int], bool] | None:
    """Turn a user's wrap policy into ``fn(module, unclaimed_numel) -> bool`` (None: whole model).

    Allowed forms: ``None`` (the whole model is one unit); an ``int`` N or ``{"min_num_params": N}``
    (a module whose not-yet-wrapped parameters number at least N); a module class, a dotted class path
    (``"torch.nn.Linear"``), a bare class name (``"Linear"``), or a list of those, or
    ``{"module_classes": [...]}``; or a callable ``fn(module) -> bool``.
    """
    allowed = (
        "None, an int (min_num_params), {'min_num_params': N}, a module class / class path / class "
        "name or a list of them, {'module_classes': [...]}, or a callable(module) -> bool"
    )
    if policy is None:
        return None
    if isinstance(policy, Mapping):
        extra = set(policy) - {"min_num_params", "module_classes"}
        if len(policy) != 1 or extra:
            raise ValueError(
                f"wrap_policy mapping must have exactly one of 'min_num_params' or 'module_classes', "
                f"got keys {sorted(policy)}; allowed forms: {allowed}"
            )
        key, value = next(iter(policy.items()))
        if key == "min_num_params":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"wrap_policy min_num_params must be an int >= 1, got {value!r}")
            return resolve_wrap_policy(value)
        if isinstance(value, (str, type)):
            return resolve_wrap_policy([value])
        if not isinstance(value, Sequence):
            raise ValueError(
                f"wrap_policy module_classes must be a list of module classes / class paths / class "
                f"names, got {value!r}"
            )
        return resolve_wrap_policy(list(value))
    if isinstance(policy, int) and not isinstance(policy, bool):
        if policy < 1:
            raise ValueError(f"wrap_policy min_num_params must be an int >= 1, got {policy!r}")
        return lambda module, unclaimed: unclaimed >= policy
    if isinstance(policy, (str, type)):
        policy = [policy]
    if isinstance(policy, Sequence) and policy and all(isinstance(p, (str, type)) for p in policy):
        classes = tuple(p for p in policy if isinstance(p, type)) + tuple(
            import_class(p) for p in policy if isinstance(p, str) and "." in p
        )
        names = {p for p in policy if isinstance(p, str) and "." not in p}
        return lambda module, unclaimed: isinstance(module, classes) or type(module).__name__ in names
    if callable(policy) and not isinstance(policy, Sequence):
        return lambda module, unclaimed: bool(policy(module))
    raise ValueError(f"unknown wrap_policy {policy!r}; allowed forms: {allowed}")


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (each storage counted once across calls)."""
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


class FlatParam:
    """The parameters of one unit that share an optimizer group and a dtype, flattened and sharded.

    Holds the fp32 *master shard* (an ``nn.Parameter`` the optimizer steps), the full flat buffer in
    ``compute_dtype`` while it is gathered (always in stages 1 and 2, where the module's parameters
    are views into it), and the full flat gradient in ``reduce_dtype`` while one is being accumulated.
    With ``compute_dtype == master dtype`` in stages 1/2 the master shard *is* this rank's slice of the
    full buffer (no second copy); in stage 1 the master's gradient is likewise this rank's slice of
    the full gradient buffer.
    """

    def __init__(
        self,
        names: list[str],
        params: list[nn.Parameter],
        group: int,
        comm: Communicator,
        compute_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        stage: int,
    ) -> None:
        self.names, self.params, self.group, self.comm, self.stage = names, params, group, comm, stage
        self.layout = FlatShard([p.shape for p in params], comm.world_size, comm.rank)
        self.orig_dtype = params[0].dtype
        self.compute_dtype = compute_dtype or self.orig_dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        self.master_dtype = torch.float64 if self.orig_dtype == torch.float64 else torch.float32
        self.device = params[0].device
        self.full: torch.Tensor | None = None
        self.grad_full: torch.Tensor | None = None
        self._gather_work: Any = None
        self._gather_src: torch.Tensor | None = None
        self._reduce: tuple[torch.Tensor, Any] | None = None
        self._touched: set[int] = set()  # parameters whose gradient is in grad_full this window
        with torch.no_grad():
            flat = self.layout.flatten([p.detach() for p in params])
            if stage < 3:
                self.full = flat.to(self.compute_dtype)
                self._point_params(self.full)
                aliased = self.compute_dtype == self.master_dtype
                shard = self.layout.shard(self.full if aliased else flat)
                self.master = nn.Parameter(shard if aliased else shard.to(self.master_dtype).clone())
            else:
                self.master = nn.Parameter(self.layout.shard(flat).to(self.master_dtype).clone())
                self.free()

    # ------------------------------------------------------------------ parameters
    @property
    def aliased(self) -> bool:
        """The master shard shares storage with the full buffer (stages 1/2, compute dtype = master's)."""
        return self.full is not None and self.stage < 3 and self.compute_dtype == self.master_dtype

    def _point_params(self, full: torch.Tensor) -> None:
        for p, view in zip(self.params, self.layout.views(full)):
            p.data = view

    def free(self) -> None:
        """Drop the full parameters (stage 3); the module's parameters become empty tensors."""
        self.full = None
        with torch.inference_mode(False):  # never an inference tensor, even when freed during validation
            empty = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        for p in self.params:
            p.data = empty

    def start_gather(self) -> None:
        """Issue the all-gather of the master shards into a fresh full buffer (stage 3, async)."""
        if self.full is not None or self._gather_work is not None:
            return
        with torch.inference_mode(False), torch.no_grad():
            src = self.master.detach()
            self._gather_src = src if src.dtype == self.compute_dtype else src.to(self.compute_dtype)
            buffer = torch.empty(self.layout.padded, dtype=self.compute_dtype, device=self.device)
            self._gather_work = (buffer, self.comm.all_gather_into(buffer, self._gather_src, async_op=True))

    def finish_gather(self) -> None:
        """Wait for the all-gather and point the parameters at the full buffer."""
        if self._gather_work is None:
            return
        buffer, work = self._gather_work
        work.wait()
        self._gather_work, self._gather_src = None, None
        with torch.inference_mode(False):
            self.full = buffer
            self._point_params(buffer)

    def refresh_full(self) -> Any:
        """Stages 1/2 after a step: all-gather the updated master shards into the full buffer (async)."""
        assert self.full is not None
        with torch.no_grad():
            src = self.master.detach()
            self._gather_src = src.clone() if self.aliased else src.to(self.compute_dtype)
        return self.comm.all_gather_into(self.full, self._gather_src, async_op=True)

    # ------------------------------------------------------------------ gradients
    def _grad_buffer(self) -> torch.Tensor:
        if self.grad_full is None:  # uninitialised: each parameter's first gradient is copied in
            self.grad_full = torch.empty(self.layout.padded, dtype=self.reduce_dtype, device=self.device)
            self._touched = set()
        return self.grad_full

    def accumulate(self, index: int, grad: torch.Tensor) -> None:
        """Add parameter ``index``'s gradient into the full flat gradient (copy on its first gradient
        of the accumulation window, so the buffer is never cleared as a whole)."""
        off, n = self.layout.offsets[index], self.layout.numels[index]
        view = self._grad_buffer()[off : off + n]
        if index in self._touched:
            view.add_(grad.reshape(-1))
        else:
            view.copy_(grad.reshape(-1))
            self._touched.add(index)

    def complete_grad(self) -> torch.Tensor:
        """The full gradient, with zeros where no gradient arrived this window and in the padding."""
        buffer = self._grad_buffer()
        for i, (off, n) in enumerate(zip(self.layout.offsets, self.layout.numels)):
            if i not in self._touched:
                buffer[off : off + n].zero_()
                self._touched.add(i)
        buffer[self.layout.total :].zero_()
        return buffer

    def launch_reduce(self) -> None:
        """Issue the averaging reduce-scatter of the full gradient into this rank's shard (async)."""
        full = self.complete_grad()
        out = torch.empty(self.layout.shard_numel, dtype=self.reduce_dtype, device=self.device)
        # the full gradient is not needed after this (stage 1 keeps only its own slice, copied from out)
        self._reduce = (out, self.comm.reduce_scatter_into(out, full, op="avg", async_op=True, scratch=True))

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter; add the averaged shard to the master's gradient. Stage 1 keeps
        the full gradient buffer (the master's gradient is its slice); stages 2/3 free it."""
        assert self._reduce is not None and self.grad_full is not None
        out, work = self._reduce
        work.wait()
        self._reduce = None
        with torch.no_grad():
            if self.stage == 1:
                own = self.layout.shard(self.grad_full)
                own.copy_(out)
                shard = own if own.dtype == self.master_dtype else own.to(self.master_dtype)
            else:
                shard = out if out.dtype == self.master_dtype else out.to(self.master_dtype)
                self.grad_full = None
            master_grad = self.master.grad
            if master_grad is None or master_grad.data_ptr() == shard.data_ptr():
                self.master.grad = shard
            else:
                master_grad.add_(shard)

    def start_window(self) -> None:
        """A new accumulation window: every parameter's next gradient is copied, not added (stage 1
        keeps its full gradient buffer between steps)."""
        self._touched = set()


@dataclass
class Unit:
    """A wrap unit (stage 3) or a gradient bucket (stages 1/2): the flat parameters handled together."""

    index: int
    name: str
    module: nn.Module | None
    flats: list[FlatParam]
    is_root: bool = False
    expected: int = 0
    fired: set[int] = field(default_factory=set)
    done: bool = False

    def reset(self) -> None:
        """Ready for the next backward: no gradient has arrived yet."""
        self.fired, self.done = set(), False

    @property
    def gathered(self) -> bool:
        return all(f.full is not None for f in self.flats)

    @property
    def numel(self) -> int:
        return sum(f.layout.total for f in self.flats)


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's outputs whose backward re-gathers the unit before its own backward runs."""

    @staticmethod
    def forward(ctx: Any, engine: ZeroEngine, unit: Unit, *tensors: torch.Tensor) -> Any:
        ctx.engine, ctx.unit = engine, unit
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.engine._pre_backward(ctx.unit)
        return (None, None, *grads)


class ZeroEngine(SyncSwitch):
    """ZeRO stages 1-3 over ``module`` and its ``optimizer``, every collective through ``comm``.

    Building the engine broadcasts rank 0's parameters and buffers, flattens and shards the
    trainable parameters, and rewrites ``optimizer.param_groups`` in place to step the fp32 master
    shards (same groups, same hyperparameters, so LR schedulers keep working). After that:

    * forward/backward as usual: hooks reduce-scatter gradients (stage 1 at the end of backward,
      stages 2/3 unit by unit during it) into the masters' ``.grad``; the module's ``.grad`` stay None;
    * ``optimizer.step()`` steps this rank's shards; a post-step hook all-gathers the full parameters
      (stages 1/2); stage 3 gathers each unit just before it runs;
    * :meth:`no_sync` for accumulation micro-steps (no collective; full gradients accumulate locally).

    Args:
        module: the model (its parameters are broadcast from rank 0 and sharded).
        optimizer: a torch optimizer over (some of) ``module``'s parameters, not yet stepped.
        comm: the :class:`~lightning_sync.sync.communicator.Communicator`.
        stage: 1, 2 or 3.
        wrap_policy: stage 3 wrap units (see :func:`resolve_wrap_policy`; None: the whole model).
        prefetch: stage 3: issue the next unit's all-gather while the current one computes.
        reshard_after_forward: stage 3: free a unit's full parameters after its forward.
        param_dtype: dtype parameters are gathered and computed in (None: their own).
        reduce_dtype: dtype gradients are reduced in (None: the compute dtype).
        bucket_cap_mb: stages 1/2: gradient bucket size (each bucket is one flat shard).
        broadcast: broadcast rank 0's parameters and buffers first.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        comm: Communicator,
        stage: int = 3,
        wrap_policy: Any = None,
        prefetch: bool = True,
        reshard_after_forward: bool = True,
        param_dtype: Any = None,
        reduce_dtype: Any = None,
        bucket_cap_mb: float = 25.0,
        broadcast: bool = True,
    ) -> None:
        check_stage(stage)
        check_mib("bucket_cap_mb", bucket_cap_mb)
        if optimizer is not None and hasattr(optimizer, "_params"):
            raise ValueError(
                f"{type(optimizer).__name__} keeps its own parameter list and cannot step shards; "
                f"use an optimizer that reads param_groups (SGD, Adam, AdamW, ...)"
            )
        if optimizer is not None and any(len(s) for s in optimizer.state.values()):
            raise ValueError("the optimizer already has state; build the ZeroEngine before the first step")
        self.module, self.optimizer, self.comm, self.stage = module, optimizer, comm, stage
        self.prefetch, self.reshard_after_forward = bool(prefetch), bool(reshard_after_forward)
        self.param_dtype = resolve_dtype(param_dtype, "param_dtype")
        self.reduce_dtype = resolve_dtype(reduce_dtype, "reduce_dtype")
        self._policy = resolve_wrap_policy(wrap_policy)
        self._cap = max(1, int(bucket_cap_mb * _MB))
        if broadcast and comm.world_size > 1:
            with torch.no_grad():
                for t in [*module.parameters(), *module.buffers()]:
                    comm.broadcast(t.data, src=0)
        self._sync = True
        self._in_backward = False
        self._window_open = False
        self._forward_order: list[int] | None = None
        self._recording: list[int] = []
        self._order_checked = False
        self._frozen_orig: dict[int, torch.Tensor] = {}  # frozen parameters' own data (param_dtype set)
        self.events: list[tuple[str, int]] = []
        """``(event, unit index)`` in order: gather_issue, gather_wait, forward_begin, forward_end,
        backward_begin, reduce_issue, free; appended while :attr:`record_events` is True (tests clear it)."""
        self.record_events = False
        self._build()

    # ------------------------------------------------------------------ layout
    def _trainable(self) -> tuple[list[str], list[nn.Parameter]]:
        names, params, seen = [], [], set()
        for name, p in self.module.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                names.append(name)
                params.append(p)
        return names, params

    def _groups(self, params: list[nn.Parameter]) -> dict[int, int]:
        """Parameter id -> optimizer group index (-1: not in the optimizer)."""
        group_of: dict[int, int] = {}
        if self.optimizer is None:
            return {id(p): -1 for p in params}
        known = {id(p) for p in self.module.parameters()}
        for gi, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in known:
                    raise ValueError(
                        "the optimizer holds a parameter that is not in the module; ZeroEngine can "
                        "only shard the module's own parameters"
                    )
                group_of[id(p)] = gi
        return {id(p): group_of.get(id(p), -1) for p in params}

    def _build(self) -> None:
        names, params = self._trainable()
        self.names = names
        group_of = self._groups(params)
        name_of = {id(p): n for n, p in zip(names, params)}
        if self.stage < 3:
            order = list(reversed(range(len(params))))
            sizes = [params[i].numel() * params[i].element_size() for i in range(len(params))]
            keys = [(group_of[id(params[i])], params[i].dtype, params[i].device) for i in range(len(params))]
            plan = plan_buckets(sizes, keys, order, self._cap, self._cap) if params else []
            members_of = [("", None, [params[i] for i in members], False) for members in plan]
        else:
            members_of = self._wrap_units(params)
        self.units: list[Unit] = []
        for ui, (uname, umodule, uparams, is_root) in enumerate(members_of):
            by_key: dict[tuple[int, torch.dtype], list[nn.Parameter]] = {}
            for p in uparams:
                by_key.setdefault((group_of[id(p)], p.dtype), []).append(p)
            flats = [
                FlatParam(
                    [name_of[id(p)] for p in ps], ps, key[0], self.comm, self.param_dtype, self.reduce_dtype, self.stage
                )
                for key, ps in by_key.items()
            ]
            self.units.append(Unit(ui, uname, umodule, flats, is_root, expected=len(uparams)))
        self.flats = [f for u in self.units for f in u.flats]
        self._where: dict[int, tuple[Unit, FlatParam, int]] = {}
        for unit in self.units:
            for flat in unit.flats:
                for i, p in enumerate(flat.params):
                    self._where[id(p)] = (unit, flat, i)
        self._rewrite_optimizer()
        self._cast_frozen()
        self._handles: list[Any] = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        if self.stage == 3:
            for unit in self.units:
                if unit.module is None:
                    continue
                self._handles.append(
                    unit.module.register_forward_pre_hook(
                        functools.partial(self._pre_forward, unit), prepend=True, with_kwargs=True
                    )
                )
                if not unit.is_root:
                    self._handles.append(unit.module.register_forward_hook(functools.partial(self._post_forward, unit)))
        if self.optimizer is not None and self.stage < 3:
            self._handles.append(self.optimizer.register_step_post_hook(self._after_step))
        if self.stage < 3 and self.param_dtype is not None:  # stage 3 casts in every unit's pre-forward
            self._handles.append(self.module.register_forward_pre_hook(self._cast_inputs, with_kwargs=True))
        root = [u for u in self.units if u.is_root]
        self.root = root[0] if root else None
        # launch order of reduce-scatters: reverse forward order, root last (stage 3); bucket order (1/2)
        self._launch_order = self._default_launch_order()
        self._next_launch = 0

    def _wrap_units(self, params: list[nn.Parameter]) -> list[tuple[str, nn.Module | None, list[nn.Parameter], bool]]:
        """Stage 3 units: modules chosen by the policy (children before parents claim parameters); a
        parameter registered in several places (tied) belongs to the smallest unit holding all of them;
        whatever is left belongs to the root unit."""
        trainable = {id(p) for p in params}
        places: dict[int, list[str]] = {}
        for mname, mod in self.module.named_modules(remove_duplicate=False):
            for p in mod._parameters.values():
                if p is not None and id(p) in trainable:
                    places.setdefault(id(p), []).append(mname)
        claimed: set[int] = set()
        units: list[tuple[str, nn.Module | None, list[nn.Parameter], bool]] = []
        modules = list(self.module.named_modules())
        if self._policy is not None:
            for mname, mod in reversed(modules):  # post-order-ish: deeper modules (registered later) first
                if mod is self.module:
                    continue
                mine = [
                    p
                    for p in mod.parameters()
                    if id(p) in trainable
                    and id(p) not in claimed
                    and all(pl == mname or pl.startswith(mname + ".") for pl in places[id(p)])
                ]
                if mine and self._policy(mod, sum(p.numel() for p in mine)):
                    claimed.update(id(p) for p in mine)
                    units.append((mname, mod, mine, False))
            if not units:
                warnings.warn(
                    "wrap_policy matched no submodule with trainable parameters; the whole model is "
                    "one unit (stage 3 then holds all full parameters during forward and backward)",
                    stacklevel=3,
                )
        position = {name: i for i, (name, _) in enumerate(modules)}
        units.sort(key=lambda u: position[u[0]])
        rest = [p for p in params if id(p) not in claimed]
        return [("", self.module, rest, True), *units]

    def _default_launch_order(self) -> list[int]:
        if self.stage < 3:
            return [u.index for u in self.units]
        forward = self._forward_order or [u.index for u in self.units if not u.is_root]
        return list(reversed(forward)) + ([self.root.index] if self.root is not None else [])

    def _cast_frozen(self) -> None:
        """With ``param_dtype``, frozen floating parameters compute in it too; their own data is kept
        (for checkpoints, :meth:`full_state_dict` and :meth:`unshard`)."""
        if self.param_dtype is None:
            return
        for p in self.module.parameters():
            if not p.requires_grad and p.is_floating_point():
                original = self._frozen_orig.setdefault(id(p), p.data)
                p.data = original.to(self.param_dtype)

    def _rewrite_optimizer(self) -> None:
        if self.optimizer is None:
            return
        sharded = {id(p) for f in self.flats for p in f.params}
        for gi, group in enumerate(self.optimizer.param_groups):
            kept = [p for p in group["params"] if id(p) not in sharded]  # frozen ones stay as they are
            group["params"] = [f.master for f in self.flats if f.group == gi] + kept
        self.optimizer.state.clear()

    # ------------------------------------------------------------------ stage 3: forward
    def _log(self, event: str, unit: Unit) -> None:
        if self.record_events:
            self.events.append((event, unit.index))

    def _gather(self, unit: Unit, wait: bool) -> None:
        if not unit.gathered:
            if any(f._gather_work is None and f.full is None for f in unit.flats):
                self._log("gather_issue", unit)
            for f in unit.flats:
                f.start_gather()
        if wait and any(f._gather_work is not None for f in unit.flats):
            for f in unit.flats:
                f.finish_gather()
            self._log("gather_wait", unit)

    def gather_root(self) -> None:
        """Stage 3: gather the root unit (the parameters no wrapped submodule owns). Call before a
        step function that may use them without calling the root module's ``forward``."""
        if self.stage == 3 and self.root is not None:
            self._gather(self.root, wait=True)

    def reshard(self) -> None:
        """Stage 3: free every unit's full parameters (after an evaluation step, for example)."""
        if self.stage == 3:
            for unit in self.units:
                for f in unit.flats:
                    f.finish_gather()
                    f.free()

    def _pre_forward(self, unit: Unit, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if not unit.is_root:
            if self._forward_order is None and unit.index not in self._recording:
                self._recording.append(unit.index)
            self._log("forward_begin", unit)
        self._gather(unit, wait=True)
        if self.prefetch and not unit.is_root and self._forward_order is not None:
            nxt = self._neighbour(unit, +1)
            if nxt is not None:
                self._gather(nxt, wait=False)
        return self._cast_inputs(module, args, kwargs) if self.param_dtype is not None else None

    def _cast_inputs(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        """Floating-point inputs to ``param_dtype`` (the parameters are in it)."""
        cast = functools.partial(_cast_floating, dtype=self.param_dtype)
        return tree_map(cast, args), tree_map(cast, kwargs)

    def _neighbour(self, unit: Unit, step: int) -> Unit | None:
        order = self._forward_order or []
        if unit.index not in order:
            return None
        j = order.index(unit.index) + step
        return self.units[order[j]] if 0 <= j < len(order) else None

    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> Any:
        self._log("forward_end", unit)
        if self.reshard_after_forward:
            for f in unit.flats:
                f.free()
            self._log("free", unit)
        if not torch.is_grad_enabled():
            return None
        leaves, spec = tree_flatten(output)
        idx = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return None
        out = _PreBackward.apply(self, unit, *[leaves[i] for i in idx])
        out = out if isinstance(out, tuple) else (out,)
        for i, t in zip(idx, out):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    def _pre_backward(self, unit: Unit) -> None:
        self._log("backward_begin", unit)
        self._gather(unit, wait=True)
        if self.prefetch:
            prev = self._neighbour(unit, -1)
            if prev is not None and not prev.done:
                self._gather(prev, wait=False)

    # ------------------------------------------------------------------ backward
    def _on_grad(self, p: torch.Tensor) -> None:
        unit, flat, i = self._where[id(p)]
        if not self._in_backward:
            self._begin_backward()
        if p.grad is not None:
            flat.accumulate(i, p.grad)
            p.grad = None
        unit.fired.add(id(p))
        if len(unit.fired) == unit.expected and not unit.done:
            self._unit_done(unit)

    def _begin_backward(self) -> None:
        self._in_backward = True
        if not self._window_open:
            self._window_open = True
            for f in self.flats:
                f.start_window()
        for unit in self.units:
            unit.reset()
        self._next_launch = 0
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _unit_done(self, unit: Unit) -> None:
        unit.done = True
        if self.stage == 3 and not unit.is_root:
            for f in unit.flats:
                f.free()
            self._log("free", unit)
        if self._sync and self.stage > 1:
            self._launch_in_order()

    def _launch_in_order(self) -> None:
        while self._next_launch < len(self._launch_order):
            unit = self.units[self._launch_order[self._next_launch]]
            if not unit.done:
                return
            self._log("reduce_issue", unit)
            for f in unit.flats:
                f.launch_reduce()
            self._next_launch += 1

    def _finalize(self) -> None:
        self._in_backward = False
        for unit in self.units:
            if not unit.done:  # parameters without a gradient this window count as zero gradients
                self._unit_done(unit)
        if self._sync:
            self._launch_in_order()
            for uid in self._launch_order:
                for f in self.units[uid].flats:
                    f.finish_reduce()
            self._window_open = False
        if self.stage == 3:
            self.reshard()
        for unit in self.units:  # ready for the next backward (its first pre-backward hook reads them)
            unit.reset()
        if self.stage == 3 and not self._order_checked:
            self._check_forward_order()

    def _check_forward_order(self) -> None:
        """After the first backward: every rank must have run the units in the same order (the
        all-gathers are matched by order); it becomes the prefetch and reduce-scatter order."""
        self._order_checked = True
        orders = self.comm.all_gather_object(list(self._recording))
        if any(o != orders[0] for o in orders):
            raise RuntimeError(
                f"ZeroEngine: ranks ran the wrap units in different orders {orders}; every rank "
                f"must run the same units in the same order"
            )
        self._forward_order = list(orders[0]) + [
            u.index for u in self.units if not u.is_root and u.index not in orders[0]
        ]
        self._launch_order = self._default_launch_order()

    # ------------------------------------------------------------------ optimizer step
    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Stages 1/2: all-gather every updated master shard into the full parameters."""
        works = [f.refresh_full() for f in self.flats]
        for work in works:
            work.wait()
        for f in self.flats:
            f._gather_src = None

    def after_load(self) -> None:
        """Re-derive the full parameters from freshly loaded master shards (stages 1/2) and the
        compute copies of frozen parameters."""
        if self.stage < 3:
            self._after_step(None, None, None)
        self._cast_frozen()

    # ------------------------------------------------------------------ inspection
    def memory_bytes(self) -> dict[str, int]:
        """Bytes of parameter, gradient and optimizer-state storage this rank holds now (each storage once)."""
        seen: set[int] = set()
        params = storage_bytes([p for p in self.module.parameters()], seen)
        params += storage_bytes([f.master for f in self.flats], seen)
        grads = storage_bytes([p.grad for p in self.module.parameters()], seen)
        grads += storage_bytes([f.grad_full for f in self.flats] + [f.master.grad for f in self.flats], seen)
        state: list[Any] = []
        if self.optimizer is not None:
            for s in self.optimizer.state.values():
                state.extend(s.values())
        return {"params": params, "grads": grads, "optimizer": storage_bytes(state, seen)}

    @property
    def largest_unit_numel(self) -> int:
        return max((u.numel for u in self.units), default=0)

    def _full_params(self) -> dict[str, torch.Tensor]:
        """Canonical name -> full parameter in its original dtype, gathered from the master shards
        (full precision whatever ``param_dtype`` is); a collective."""
        issued = []
        for f in self.flats:
            buffer = torch.empty(f.layout.padded, dtype=f.master_dtype, device=f.device)
            issued.append((f, buffer, self.comm.all_gather_into(buffer, f.master.detach(), async_op=True)))
        out: dict[str, torch.Tensor] = {}
        for f, buffer, work in issued:
            work.wait()
            for name, view in zip(f.names, f.layout.views(buffer)):
                out[name] = view.to(f.orig_dtype, copy=True)
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's full ``state_dict`` (copies, original dtypes, gathered from the fp32 master
        shards; tied parameters under each name); a collective."""
        params = self._full_params()
        keys, replicated = self._replicated()
        return {k: params[c] if c is not None else replicated[k].clone() for k, c in keys}

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the masters' gradients by the *global* norm (all ranks' shards together); a collective.
        Padding gradients are zero, so they do not change the norm."""
        if norm_type != 2.0:
            raise ValueError(f"ZeroEngine.clip_grad_norm_ supports norm_type=2.0 only, got {norm_type!r}")
        grads = [f.master.grad for f in self.flats if f.master.grad is not None]
        device = self.flats[0].device if self.flats else torch.device("cpu")
        sq = torch.zeros(1, dtype=torch.float64, device=device)
        for g in grads:
            sq += g.detach().double().pow(2).sum()
        self.comm.all_reduce(sq, op="sum")
        total = sq.sqrt().squeeze(0)
        coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total.float()

    # ------------------------------------------------------------------ checkpoints
    def _replicated(self) -> tuple[list[tuple[str, str | None]], dict[str, torch.Tensor]]:
        """The module's state-dict keys, each either a sharded parameter (its canonical name) or a
        replicated tensor (frozen parameter or persistent buffer) returned in the second dict."""
        canonical = {id(p): n for f in self.flats for n, p in zip(f.names, f.params)}
        keys: list[tuple[str, str | None]] = []
        replicated: dict[str, torch.Tensor] = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            if id(value) in canonical:
                keys.append((key, canonical[id(value)]))
            else:
                keys.append((key, None))
                replicated[key] = self._frozen_orig.get(id(value), value).detach()
        return keys, replicated

    def save_sharded(self, path: str | os.PathLike[str]) -> None:
        """Write this rank's shards (parameters and optimizer state, keyed by parameter name and element
        offset, so they reshard to any world size) through ``torch.distributed.checkpoint``; rank 0
        adds the replicated tensors and ``lightning_sync_meta.json``. A collective."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        out: dict[str, Any] = {}
        for f in self.flats:
            master = f.master.detach()
            state = self.optimizer.state.get(f.master, {}) if self.optimizer is not None else {}
            for s in f.layout.owned_slices():
                name, lo, hi = f.names[s.index], s.shard_offset, s.shard_offset + s.length
                out[f"model/{name}@{s.param_offset}"] = master[lo:hi].clone()
                for key, value in state.items():
                    if _elementwise(value, f):
                        out[f"optim/{name}/{key}@{s.param_offset}"] = value.detach()[lo:hi].clone()
                    elif s.param_offset == 0:
                        out[f"optim/{name}/{key}"] = (
                            value.detach().clone() if isinstance(value, torch.Tensor) else value
                        )
        keys, replicated = self._replicated()
        if self.comm.rank == 0:
            out.update({f"full/{k}": v.clone() for k, v in replicated.items()})
            meta = {
                "format": _FORMAT,
                "world_size": self.comm.world_size,
                "stage": self.stage,
                "params": {
                    n: [list(shape), str(f.orig_dtype)]
                    for f in self.flats
                    for n, shape in zip(f.names, f.layout.shapes)
                },
                "keys": keys,
            }
            (path / _META).write_text(json.dumps(meta, indent=1))
        dcp.save(out, checkpoint_id=str(path), process_group=getattr(self.comm, "group", None))

    def check_compatible(self, meta: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` naming the first key where the checkpoint and this module differ."""
        mine, _ = self._replicated()
        theirs = [tuple(k) for k in meta["keys"]]
        shapes = {n: list(shape) for f in self.flats for n, shape in zip(f.names, f.layout.shapes)}
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

    def load_sharded(self, path: str | os.PathLike[str], weights_only: bool | None = None) -> None:
        """Load a :meth:`save_sharded` checkpoint written at any world size and stage; a collective.
        Weights-only (see :mod:`lightning_sync.sync.safe_load`) unless ``weights_only=False``; a directory that
        would read files outside itself, or has no DCP ``.metadata``, raises ``ValueError`` whatever the trust."""
        path = Path(path)
        meta = read_meta(path)
        self.check_compatible(meta)
        metadata = read_dcp_metadata(path, weights_only)
        saved = metadata.state_dict_metadata
        chunks = _chunk_index(saved)
        want: dict[str, Any] = {}
        for f in self.flats:
            for s in f.layout.owned_slices():
                name = f.names[s.index]
                for prefix in [f"model/{name}"] + [f"optim/{name}/{k}" for k in _state_keys(saved, name)]:
                    for lo, size in chunks.get(prefix, []):
                        if lo < s.param_offset + s.length and s.param_offset < lo + size:
                            want.setdefault(
                                f"{prefix}@{lo}", torch.empty(size, dtype=saved[f"{prefix}@{lo}"].properties.dtype)
                            )
                for k in _state_keys(saved, name, scalar=True):
                    want[f"optim/{name}/{k}"] = _placeholder(saved[f"optim/{name}/{k}"])
        _, replicated = self._replicated()
        for key, tensor in replicated.items():
            want[f"full/{key}"] = tensor
        dcp_load(want, path, weights_only, metadata=metadata, process_group=getattr(self.comm, "group", None))
        with torch.no_grad():
            for f in self.flats:
                state: dict[str, Any] = {}
                for s in f.layout.owned_slices():
                    name = f.names[s.index]
                    _fill(f.master.data, f"model/{name}", chunks, want, s)
                    for k in _state_keys(saved, name):
                        buf = state.setdefault(
                            k,
                            torch.zeros(
                                f.layout.shard_numel,
                                dtype=saved[f"optim/{name}/{k}@{chunks[f'optim/{name}/{k}'][0][0]}"].properties.dtype,
                                device=f.device,
                            ),
                        )
                        _fill(buf, f"optim/{name}/{k}", chunks, want, s)
                    for k in _state_keys(saved, name, scalar=True):
                        value = want[f"optim/{name}/{k}"]
                        state.setdefault(k, value.to(f.device) if isinstance(value, torch.Tensor) else value)
                if self.optimizer is not None:
                    if state:
                        self.optimizer.state[f.master] = state
                    else:
                        self.optimizer.state.pop(f.master, None)
        self.after_load()

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load a plain full ``state_dict`` (e.g. one :meth:`full_state_dict` or DDP wrote): every rank
        takes its shards from it. Names the first missing key."""
        keys, replicated = self._replicated()
        for key, _ in keys:
            if key not in state_dict:
                raise ValueError(f"state_dict does not match this model: first mismatched key {key!r} (missing)")
        with torch.no_grad():
            for f in self.flats:
                flat = f.layout.flatten(
                    [state_dict[n].to(f.master_dtype).reshape(s) for n, s in zip(f.names, f.layout.shapes)]
                )
                f.master.data.copy_(f.layout.shard(flat))
            for key, tensor in replicated.items():
                tensor.copy_(state_dict[key])
        self.after_load()

    def unshard(self) -> None:
        """Leave the module with its full parameters (stage 3 gathers every unit) and remove the hooks:
        after training the module is an ordinary module with the trained weights on every rank."""
        params = self._full_params()
        self.reshard()
        with torch.no_grad():
            for f in self.flats:
                for name, p in zip(f.names, f.params):
                    p.data = params[name]
            for p in self.module.parameters():
                if id(p) in self._frozen_orig:
                    p.data = self._frozen_orig[id(p)]
        self.close()

    def close(self) -> None:
        """Remove the hooks; the module keeps its current (possibly empty, stage 3) parameters."""
        for h in self._handles:
            h.remove()
        self._handles = []


_FORMAT = "lightning_sync.zero/1"
_META = "lightning_sync_meta.json"


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``lightning_sync_meta.json`` of a sharded checkpoint directory (clear error if absent)."""
    file = contained_path(path, _META, "layout file")
    if not file.is_file():
        raise ValueError(f"{path} is not a lightning_sync sharded checkpoint (no {_META} in it)")
    meta = json.loads(file.read_text())
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{file} has format {meta.get('format')!r}; this version reads {_FORMAT!r}")
    return meta


def _elementwise(value: Any, flat: FlatParam) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == flat.layout.shard_numel


def _chunk_index(saved: Mapping[str, Any]) -> dict[str, list[tuple[int, int]]]:
    """``prefix -> [(element offset, size)]`` for every ``prefix@offset`` key of a checkpoint."""
    index: dict[str, list[tuple[int, int]]] = {}
    for key, md in saved.items():
        prefix, at, lo = key.rpartition("@")
        if at and lo.isdigit():
            index.setdefault(prefix, []).append((int(lo), int(md.size[0])))
    for chunks in index.values():
        chunks.sort()
    return index


def _state_keys(saved: Mapping[str, Any], name: str, scalar: bool = False) -> list[str]:
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


def _placeholder(md: Any) -> Any:
    props = getattr(md, "properties", None)
    if props is not None and hasattr(md, "size"):
        return torch.empty(tuple(md.size), dtype=props.dtype)
    return None


def _fill(
    dest: torch.Tensor,
    prefix: str,
    chunks: Mapping[str, list[tuple[int, int]]],
    loaded: Mapping[str, Any],
    s: OwnedSlice,
) -> None:
    """Copy elements ``[s.param_offset, +s.length)`` of a parameter from its saved chunks into ``dest``."""
    want_lo, want_hi = s.param_offset, s.param_offset + s.length
    covered = 0
    for lo, size in chunks.get(prefix, []):
        a, b = max(lo, want_lo), min(lo + size, want_hi)
        if a < b:
            dest[s.shard_offset + a - want_lo : s.shard_offset + b - want_lo].copy_(
                loaded[f"{prefix}@{lo}"][a - lo : b - lo]
            )
            covered += b - a
    if covered != s.length:
        raise ValueError(f"checkpoint holds {covered} of the {s.length} elements of {prefix} this rank needs")


def consolidate_checkpoint(path: str | os.PathLike[str], weights_only: bool = True) -> dict[str, torch.Tensor]:
    """A plain full ``state_dict`` (original keys, order and dtypes; tied parameters under every name)
    from a sharded checkpoint directory, in one process, without a process group. For inference.
    Weights-only (see :mod:`lightning_sync.sync.safe_load`) unless ``weights_only=False``; a directory that
    would read files outside itself, or has no DCP ``.metadata``, raises ``ValueError`` whatever the trust."""
    meta = read_meta(path)
    metadata = read_dcp_metadata(path, weights_only)
    saved = metadata.state_dict_metadata
    chunks = _chunk_index(saved)
    want: dict[str, Any] = {
        k: _placeholder(md) for k, md in saved.items() if k.startswith("full/") or (k.startswith("model/") and "@" in k)
    }
    with warnings.catch_warnings():  # "torch.distributed is disabled..." is what no_dist asks for
        warnings.filterwarnings("ignore", message=".*torch.distributed.*disabled.*")
        dcp_load(want, path, weights_only, metadata=metadata, no_dist=True)
    params: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in meta["params"].items():
        numel = math.prod(shape)
        flat = torch.empty(numel, dtype=torch.float64 if dtype == "torch.float64" else torch.float32)
        _fill(flat, f"model/{name}", chunks, want, OwnedSlice(0, 0, 0, numel))
        params[name] = flat.view(shape).to(getattr(torch, dtype.removeprefix("torch.")))
    return {key: params[canon] if canon is not None else want[f"full/{key}"] for key, canon in meta["keys"]}


def _cast_floating(x: Any, dtype: torch.dtype) -> Any:
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
