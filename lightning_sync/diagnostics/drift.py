"""``ReplicaDriftCheck``: every N optimizer steps, all ranks must still hold bit-identical model replicas.

A synchronous strategy keeps every replica equal only by construction: the same averaged gradients go
into the same optimizer on the same weights. A rank that skips a step alone, a non-deterministic
kernel, a corrupted bucket or a stray in-place write breaks that silently, and the replicas then train
apart while the loss still looks fine. Every ``every_n_steps`` optimizer steps (at ``on_train_batch_end``
of a batch that ended with an optimizer step, and ``global_step`` a multiple of N) each rank computes
:func:`value_fingerprint` of its LightningModule and the ranks exchange it with one
``all_gather_object`` through the strategy's communication context.

**What is fingerprinted.** Per tensor, two 64-bit integer checksums of its raw bits (each element read
as an integer of its own width): the plain sum and the sum weighted by position (1-based), both modulo
2^64. Integer addition modulo 2^64 is exact and order-free, so equal tensors give equal checksums on any
device or thread count, and a single changed element (even one flipped bit) always changes the plain
sum (by its nonzero bit difference, less than 2^64 in size). Tensors are every parameter of the module
and, with ``buffers=True``, every buffer except the running statistics of normalization layers
(``running_mean``/``running_var``): each rank updates those from its own batch in every forward, so
they legitimately differ at the end of a step (``broadcast_buffers`` re-syncs them before the next).

**On a divergence** (replicas not all identical) the reference is the majority's fingerprint (a tie:
the group holding the lowest rank, so rank 0 with 2 ranks); the message names the global step, the
ranks that disagree with it, and the first differing tensor with each rank's checksum, for example::

    replicas diverged at global step 3: rank 1 differs from rank 0; first difference: parameter
    net.fc1.weight: rank 0 has shape (48, 16), torch.float32, checksum ...; rank 1 has ...

The decision is made from the gathered fingerprints, which every rank holds, so every rank decides alike:
``action="raise"`` raises that ``RuntimeError`` on every rank; ``action="warn"`` warns (rank 0) once per
divergence (again only after the replicas agreed in between). The metric ``replica_drift/diverged``
(0/1) is logged at every check; :attr:`ReplicaDriftCheck.first_divergent_step` keeps the first step
found diverged and :attr:`ReplicaDriftCheck.divergences` ``(step, ranks, first tensor)`` of each one.

**Strategies.** Synchronous ones are checked: ``bucketed_ddp``, Lightning's ``ddp``, and ZeRO stages 1
and 2 (``zero1``/``zero2``: after each step the module's parameters are the all-gathered full
parameters, so every tensor is compared). ZeRO-3 (``zero3``) keeps each trainable parameter as one 1/K
shard per rank between steps: there is no replica to drift (each element exists once), so only what is
replicated is compared: frozen parameters and buffers. Periodic and asynchronous strategies
(``local_sgd``, ``diloco``, ``async_ps``, ``hogwild``) and Lightning's sharding strategies (FSDP,
ModelParallel, DeepSpeed) are refused at ``setup`` with a ``ValueError`` saying why. One process: nothing
to compare, the check does nothing.

From Hydra::

    lightning-sync train \
        '+trainer.callbacks=[{_target_: lightning_sync.diagnostics.ReplicaDriftCheck, every_n_steps: 100}]'
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.modules.batchnorm import _NormBase

from lightning_sync._checks import check_bool, check_choice, check_int
from lightning_sync.diagnostics._comm import comm_of
from lightning_sync.diagnostics._steps import optimizer_step_ended
from lightning_sync.diagnostics.consistency import first_difference
from lightning_sync.strategies import (
    AsyncParameterServerStrategy,
    DiLoCoStrategy,
    HogwildStrategy,
    LocalSGDStrategy,
    ShardedStrategy,
)

__all__ = ["ACTIONS", "ReplicaDriftCheck", "checksum", "value_fingerprint"]

ACTIONS = ("raise", "warn")
"""What :class:`ReplicaDriftCheck` does on a divergence."""

_MASK = (1 << 64) - 1
_CHUNK = 1 << 22  # elements per pass: bounds the int64 temporaries to 32 MiB each
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_SHARDS = "it shards the parameters: no rank holds a full replica (lightning_sync's zero1/zero2/zero3 are supported)"
# Refused at setup, each naming why replicas differ by design; the first match explains a strategy.
_REFUSED: tuple[tuple[type, str], ...] = (
    (DiLoCoStrategy, "its inner steps are local: the replicas agree only right after an outer step"),
    (
        LocalSGDStrategy,
        ("every rank steps its own replica between averages (every sync_every steps), so replicas legitimately differ"),
    ),
    (
        AsyncParameterServerStrategy,
        (
            "workers train on stale copies of the server's parameters by design "
            "(bounded staleness), so replicas legitimately differ"
        ),
    ),
    (
        HogwildStrategy,
        (
            "the processes update one shared-memory model without locks: there are no replicas "
            "to compare (and no process group to compare them over)"
        ),
    ),
    (FSDPStrategy, _SHARDS),
    (ModelParallelStrategy, _SHARDS),
    (DeepSpeedStrategy, _SHARDS),
)


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """``[sum of bits, sum of bits x (position + 1)]`` (int64, modulo 2^64, on the tensor's device) of
    ``tensor``'s elements read as integers of their own width; exact and independent of summation order."""
    flat = tensor.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    bits = flat.view(_BITS[flat.element_size()])
    out = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start : start + _CHUNK].to(torch.int64)
        weights = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=flat.device)
        out[0] += chunk.sum()
        out[1] += (chunk * weights).sum()
    return out


def value_fingerprint(
    module: torch.nn.Module, buffers: bool = True, skip: set[int] | frozenset[int] = frozenset()
) -> list[tuple[str, str]]:
    """``[(item, "shape ..., dtype, checksum ..."), ...]`` for every parameter and (with ``buffers``)
    buffer of ``module`` but normalization running statistics and tensors whose ``id`` is in ``skip``;
    the format of :func:`~lightning_sync.diagnostics.consistency.first_difference`."""
    tensors = [(f"parameter {n}", p) for n, p in module.named_parameters() if id(p) not in skip]
    if buffers:
        local = {
            id(t)
            for m in module.modules()
            if isinstance(m, _NormBase)
            for t in (m.running_mean, m.running_var)
            if t is not None
        } | set(skip)
        tensors += [(f"buffer {n}", b) for n, b in module.named_buffers() if id(b) not in local]
    if not tensors:
        return []
    parts = [checksum(t) for _, t in tensors]
    sums = torch.stack([c.to(parts[0].device) for c in parts]).tolist()  # one device-to-host copy
    return [
        (item, f"shape {tuple(t.shape)}, {t.dtype}, checksum {a & _MASK:016x}:{b & _MASK:016x}")
        for (item, t), (a, b) in zip(tensors, sums)
    ]


def _first_item(reference: list[tuple[str, str]], others: list[list[tuple[str, str]]]) -> str:
    """The first tensor (in module order) on which any of ``others`` differs from ``reference``."""
    for i, entry in enumerate(reference):
        if any(i >= len(o) or o[i] != entry for o in others):
            return entry[0]
    return "the number of tensors"  # the others hold all of the reference's, and more


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


class ReplicaDriftCheck(pl.Callback):
    """Every ``every_n_steps`` optimizer steps, compare exact checksums of every rank's model (module docstring).

    Args:
        every_n_steps: check when ``global_step`` is a multiple of this (an int >= 1).
        action: ``"raise"`` (a ``RuntimeError`` on every rank) or ``"warn"`` (once per divergence).
        buffers: compare buffers too (normalization running statistics never are); False: parameters only.

    Attributes:
        checked_steps: the global steps at which the ranks were compared.
        compared: how many tensors this rank fingerprinted at the last check.
        first_divergent_step: the first global step found diverged (None while none was).
        divergences: ``(global step, ranks that differ from the majority, first differing tensor)`` each
            time the replicas were found diverged after agreeing.
    """

    def __init__(self, every_n_steps: int = 100, action: str = "raise", buffers: bool = True) -> None:
        check_int("every_n_steps", every_n_steps, 1)
        check_choice("action", action, ACTIONS)
        check_bool("buffers", buffers)
        self.every_n_steps, self.action, self.buffers = every_n_steps, action, buffers
        self.checked_steps: list[int] = []
        self.compared = 0
        self.first_divergent_step: int | None = None
        self.divergences: list[tuple[int, list[int], str]] = []
        self._diverged = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return  # the check runs in training only
        strategy = trainer.strategy
        for cls, why in _REFUSED:
            if isinstance(strategy, cls):
                name = getattr(strategy, "strategy_name", type(strategy).__name__)
                raise ValueError(
                    f"ReplicaDriftCheck does not support the {name!r} strategy "
                    f"({type(strategy).__name__}): {why}. It checks synchronous strategies: "
                    f"bucketed_ddp, ddp, zero1, zero2, zero3 (replicated tensors only)"
                )
        if isinstance(strategy, ShardedStrategy) and strategy.stage == 3:
            rank_zero_info(
                "ReplicaDriftCheck with ZeRO-3: each trainable parameter lives as one shard per rank "
                "(nothing to drift); comparing the replicated tensors only (frozen parameters, buffers)"
            )

    def _sharded_ids(self, strategy: Any) -> set[int]:
        """ZeRO-3's trainable parameters (one shard per rank between steps): not replicas, not compared."""
        engine = getattr(strategy, "engine", None)
        if not isinstance(strategy, ShardedStrategy) or strategy.stage != 3 or engine is None:
            return set()
        return {id(p) for flat in engine.flats for p in flat.params}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if (
            trainer.world_size == 1
            or not optimizer_step_ended(trainer)
            or step % self.every_n_steps
            or (self.checked_steps and self.checked_steps[-1] == step)
        ):
            return
        mine = value_fingerprint(pl_module, self.buffers, self._sharded_ids(trainer.strategy))
        prints: list[list[tuple[str, str]]] = comm_of(trainer).all_gather_object(mine)
        self.checked_steps.append(step)
        self.compared = len(mine)
        groups: dict[tuple[tuple[str, str], ...], list[int]] = {}
        for rank, p in enumerate(prints):
            groups.setdefault(tuple(p), []).append(rank)
        diverged = len(groups) > 1
        pl_module.log("replica_drift/diverged", float(diverged))
        if not diverged:
            self._diverged = False
            return
        majority = max(groups.values(), key=lambda ranks: (len(ranks), -ranks[0]))
        others = sorted(r for ranks in groups.values() if ranks is not majority for r in ranks)
        first = _first_item(prints[majority[0]], [prints[r] for r in others])
        if self.first_divergent_step is None:
            self.first_divergent_step = step
        message = (
            f"replicas diverged at global step {step}: {_ranks(others)} "
            f"{'differs' if len(others) == 1 else 'differ'} from {_ranks(majority)}; "
            f"first difference: {first_difference(prints)}"
        )
        if self.action == "raise":
            self.divergences.append((step, others, first))
            raise RuntimeError(message)
        if not self._diverged:
            self.divergences.append((step, others, first))
            rank_zero_warn(message)
        self._diverged = True
