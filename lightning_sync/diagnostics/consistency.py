"""``ConsistencyCheck``: all ranks must agree on the model, the strategy and the world size before training.

A rank whose model differs (another width, a parameter missing, another dtype, a frozen layer that is
trainable elsewhere) or whose strategy was configured differently does not fail by itself: its first
collective waits for a tensor of another size, or pairs bucket 3 of one rank with bucket 4 of another, and
the job hangs or trains garbage. At ``setup`` (after the process group exists, before the strategy wraps,
broadcasts or shards anything) every rank builds its :func:`fingerprint` and the ranks exchange them with
one ``all_gather_object``. On a mismatch *every* rank raises the same ``RuntimeError``, naming the first
differing item and what each rank has, for example::

    ranks disagree at setup on parameter net.0.weight: rank 0 has shape (64, 32), dtype torch.float32,
    trainable; rank 1 has shape (48, 32), dtype torch.float32, trainable

The fingerprint holds, in order: the world size; the strategy class and its public scalar settings; every
parameter (name, shape, dtype, trainable) and buffer (name, shape, dtype) of the LightningModule as it is
at ``setup`` (layers a ``LightningModule.setup`` or ``configure_model`` builds later are not seen).
Strategies without a process group (``async_ps``, ``hogwild``) have nothing to compare with: the check
does nothing there.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_sync.diagnostics._comm import comm_of

__all__ = ["ConsistencyCheck", "first_difference", "fingerprint"]

log = logging.getLogger("lightning_sync.diagnostics")
_SCALARS = (bool, int, float, str, type(None))


def _strategy_settings(strategy: Any) -> str:
    settings = {k: v for k, v in sorted(vars(strategy).items()) if not k.startswith("_") and isinstance(v, _SCALARS)}
    return f"{type(strategy).__qualname__}({', '.join(f'{k}={v!r}' for k, v in settings.items())})"


def fingerprint(module: torch.nn.Module, strategy: Any = None, world_size: int | None = None) -> list[tuple[str, str]]:
    """``[(item, description), ...]`` that must be equal on every rank (see the module docstring)."""
    items: list[tuple[str, str]] = []
    if world_size is not None:
        items.append(("world size", str(world_size)))
    if strategy is not None:
        items.append(("strategy", _strategy_settings(strategy)))
    for name, p in module.named_parameters():
        items.append(
            (
                f"parameter {name}",
                f"shape {tuple(p.shape)}, dtype {p.dtype}, {'trainable' if p.requires_grad else 'frozen'}",
            )
        )
    for name, b in module.named_buffers():
        items.append((f"buffer {name}", f"shape {tuple(b.shape)}, dtype {b.dtype}"))
    return items


def first_difference(prints: list[list[tuple[str, str]]]) -> str | None:
    """The first item on which the ranks' fingerprints differ, said with what each rank has; None if none."""
    for i in range(max(len(p) for p in prints)):
        entries = [p[i] if i < len(p) else None for p in prints]
        if all(e == entries[0] for e in entries):
            continue
        names = {e[0] for e in entries if e is not None}
        if len(names) == 1:  # the same item, described differently
            return f"{names.pop()}: " + "; ".join(
                f"rank {r} has {e[1] if e else 'nothing'}" for r, e in enumerate(entries)
            )
        return f"item {i} of the model: " + "; ".join(
            f"rank {r} has {e[0]} ({e[1]})" if e else f"rank {r} has nothing" for r, e in enumerate(entries)
        )
    return None


class ConsistencyCheck(pl.Callback):
    """At ``setup``, every rank must have the same model, strategy settings and world size (module docstring)."""

    def __init__(self) -> None:
        self.items = 0  # how many items were compared (0 where there is nothing to compare with)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return
        live = getattr(trainer.strategy, "live", None)
        if live is not None and live.quiet:  # a replacement: its peers are training, and it takes their state
            return
        mine = fingerprint(pl_module, trainer.strategy, trainer.world_size)
        prints = comm_of(trainer).all_gather_object(mine)
        self.items = len(mine)
        difference = first_difference(prints)
        if difference is not None:
            raise RuntimeError(f"ranks disagree at setup on {difference}")
        if trainer.is_global_zero:
            log.info(
                "consistency check: %d ranks agree on %d items (world size, strategy, parameters, buffers)",
                trainer.world_size,
                len(mine),
            )
