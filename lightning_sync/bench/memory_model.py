r"""The memory model: each rank's peak during training, predicted from the model's description.

A row is DDP, ZeRO-3 (``ShardedStrategy(stage=3)``, with ``offload`` or ``activation_checkpointing``) or FSDP2
(:class:`~lightning_sync.bench.fsdp2.FullyShardStrategy`). With K ranks, P the bytes of the trainable parameters
(each once), U the largest wrap unit's (ZeRO-3: the largest group of consecutive units it gathers in one call,
``coalesce_mb``) and R the root unit's (P minus every unit's), O the optimizer's state bytes
per parameter byte (AdamW: 2, its two moments) and A the bytes one forward saves for backward, the prediction is
the sum of five terms::

                 params          grads      optimizer    gathered    activations
    DDP          P               P          O P          0           A
    ZeRO-3       P/K             U          O P/K        2U + R      A   (A_ckpt with activation checkpointing)
    + offload    3P/K            P/K + U    O P/K        2U + R      A
    FSDP2        P/K             U          O P/K        2U + R      A

**Where the peak is.** Lightning's ``zero_grad`` sets gradients to None before each forward, so the peak is at
the start of backward: every activation is saved and the gradients are only beginning; by the end of backward,
when every gradient exists, the activations are gone. So the gradient term is what exists at that moment: DDP's
reducer keeps a bucket copy of every gradient between steps (``gradient_as_bucket_view=False``); ZeRO-3 and FSDP2
hold one unit's full gradient before its reduce-scatter (their gradient shards come later, as activations go).
*Gathered* is the unit computing plus the one prefetched, and the root unit, gathered for the whole step. Offload
on a CPU-only machine keeps the device shard, the fp32 master and the staging copy (3 P/K) and its gradient buffer
(P/K), all in the same memory. Not modelled: backward's transient buffers (an activation's gradient, a few
``batch x time x width`` tensors), the optimizer's temporaries in ``step`` (after the activations are freed), the
allocator's slack, and communication buffers.

**Activations** are measured, not estimated: :func:`saved_bytes` runs one training forward in one process under
:func:`torch.autograd.graph.saved_tensors_hooks` and adds the storages autograd keeps (each once, parameters
excluded: they are counted above). With activation checkpointing a unit saves only its inputs and recomputes its
activations in backward, one unit at a time: ``A_ckpt`` = what is saved outside the units + the units' inputs +
the largest unit's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass, fields

import torch
from torch import nn

from lightning_sync.sync.zero.units import consecutive_groups

__all__ = ["KINDS", "ModelMemory", "Prediction", "describe", "predict", "saved_bytes", "wrap_units"]

#: The rows the model predicts.
KINDS = ("ddp", "zero3", "fsdp2")


@dataclass(frozen=True)
class ModelMemory:
    """What the prediction reads from a model (bytes)."""

    param_bytes: int  # trainable parameters, each once (a tied weight once)
    unit_bytes: tuple[int, ...]  # each wrap unit's trainable parameters (the modules of the row's classes)
    activation_bytes: int  # A: saved for backward by one forward of a rank's micro-batch, parameters excluded
    checkpointed_bytes: int  # A_ckpt: the same with every unit checkpointed
    optimizer_factor: float = 2.0  # optimizer-state bytes per parameter byte (AdamW, Adam: two moments)

    @property
    def largest_unit(self) -> int:
        return max(self.unit_bytes, default=0)

    def largest_group(self, cap: int) -> int:
        """The largest group of consecutive units whose bytes add up to at most ``cap``, cut from the last unit
        as ZeRO-3 cuts them (:func:`~lightning_sync.sync.zero.units.consecutive_groups`; the units in module
        order, which is their forward order in the models this describes)."""
        order = list(range(len(self.unit_bytes)))[::-1]
        groups = consecutive_groups(order, dict(enumerate(self.unit_bytes)), cap)
        return max((sum(self.unit_bytes[i] for i in g) for g in groups), default=0)

    @property
    def root_bytes(self) -> int:
        return self.param_bytes - sum(self.unit_bytes)


@dataclass(frozen=True)
class Prediction:
    """A row's predicted per-rank training peak, by term (bytes; module docstring)."""

    params: float
    grads: float
    optimizer: float
    gathered: float
    activations: float

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


def predict(
    m: ModelMemory,
    kind: str,
    world_size: int,
    *,
    offload: bool = False,
    checkpointing: bool = False,
    coalesce_bytes: int = 0,
) -> Prediction:
    """The per-rank training peak of row ``kind`` (one of :data:`KINDS`) at ``world_size`` ranks; ZeRO-3 gathers
    groups of consecutive units of up to ``coalesce_bytes`` together."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if (offload or checkpointing or coalesce_bytes) and kind != "zero3":
        raise ValueError(f"offload, checkpointing and coalesce_bytes are ZeRO-3 options, got them for kind {kind!r}")
    p, k, u = m.param_bytes, world_size, m.largest_group(coalesce_bytes)
    activations = m.checkpointed_bytes if checkpointing else m.activation_bytes
    if kind == "ddp":
        return Prediction(p, p, m.optimizer_factor * p, 0, activations)
    shard = p / k
    return Prediction(
        params=(3 if offload else 1) * shard,
        grads=u + (shard if offload else 0),
        optimizer=m.optimizer_factor * shard,
        gathered=2 * u + m.root_bytes,
        activations=activations,
    )


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def wrap_units(model: nn.Module, is_unit: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """The modules ``is_unit`` selects, bar the root and any inside another selected one."""
    units = [m for m in model.modules() if m is not model and is_unit(m)]
    inner = {id(c) for u in units for c in u.modules() if c is not u}
    return [u for u in units if id(u) not in inner]


def saved_bytes(
    model: nn.Module, forward: Callable[[], object], is_unit: Callable[[nn.Module], bool]
) -> tuple[int, int]:
    """``(A, A_ckpt)`` of one call of ``forward`` (a training forward of ``model``), measured with saved-tensor
    hooks: every storage autograd saves, once, bar the parameters'; ``A_ckpt`` as if every unit (the modules
    ``is_unit`` selects, outermost ones) were checkpointed (module docstring)."""
    units = wrap_units(model, is_unit)
    params = {_storage(p)[0] for p in model.parameters()}
    seen: set[int] = set()
    own = [0] * len(units)  # bytes each unit saves
    inputs = [0] * len(units)  # bytes of each unit's tensor inputs (what a checkpointed unit saves)
    outside = 0
    current: list[int] = []

    def count(t: torch.Tensor) -> int:
        ptr, nbytes = _storage(t)
        if ptr in params or ptr in seen or t.device.type == "meta":
            return 0
        seen.add(ptr)
        return nbytes

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal outside
        n = count(t)
        if current:
            own[current[-1]] += n
        else:
            outside += n
        return t

    def enter(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[object, ...]) -> None:
            inputs[i] += sum(_storage(a)[1] for a in args if isinstance(a, torch.Tensor))
            current.append(i)

        return hook

    def leave(*_: object) -> None:
        current.pop()

    with ExitStack() as stack:
        for i, u in enumerate(units):
            stack.callback(u.register_forward_pre_hook(enter(i)).remove)
            stack.callback(u.register_forward_hook(leave).remove)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        forward()
    total = outside + sum(own)
    return total, outside + sum(inputs) + max(own, default=0)


def describe(
    model: nn.Module, forward: Callable[[], object], is_unit: Callable[[nn.Module], bool], optimizer_factor: float
) -> ModelMemory:
    """``model``'s :class:`ModelMemory`: its parameter and unit bytes, and the activations of ``forward``."""

    def nbytes(params: Iterable[nn.Parameter]) -> int:
        unique = {id(p): p for p in params if p.requires_grad}
        return sum(p.numel() * p.element_size() for p in unique.values())

    unit_bytes = tuple(nbytes(u.parameters()) for u in wrap_units(model, is_unit))
    activations, checkpointed = saved_bytes(model, forward, is_unit)
    return ModelMemory(nbytes(model.parameters()), unit_bytes, activations, checkpointed, optimizer_factor)
