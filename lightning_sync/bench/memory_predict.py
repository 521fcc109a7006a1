"""The memory table's predictions: each row of ``memory.rows`` described to the memory model
(:mod:`~lightning_sync.bench.memory_model`) from the model built and run alone in this process, and the helpers
that run a model alone (which the table's ranks use to warm up)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_sync.bench.memory_model import Prediction, describe, predict
from lightning_sync.bench.rows import node
from lightning_sync.sync.zero.engine import DEFAULT_COALESCE_MB
from lightning_sync.sync.zero.options import storage_bytes

__all__ = ["built", "first_batch", "predict_rows", "step_alone", "training_loss"]


def built(model_cfg: Any) -> pl.LightningModule:
    """The model of ``model_cfg`` with its layers: its own ``configure_model()`` run, with storage on the CPU."""
    from hydra.utils import instantiate

    model = instantiate(model_cfg)
    if type(model).configure_model is not pl.LightningModule.configure_model:
        type(model).configure_model(model)
    return model


def first_batch(data: pl.LightningDataModule) -> Any:
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def training_loss(model: pl.LightningModule, batch: Any) -> torch.Tensor:
    """``training_step``'s loss, outside a Trainer (where ``self.log`` only warns)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.training_step(batch, 0)
    return out["loss"] if isinstance(out, dict) else out


def step_alone(model: pl.LightningModule, batch: Any) -> torch.optim.Optimizer:
    """One training step of ``model`` and its first optimizer, outside Lightning; returns the optimizer."""
    from lightning.pytorch.core.optimizer import _configure_optimizers

    optimizer = _configure_optimizers(model.configure_optimizers())[0][0]
    training_loss(model, batch).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


#: Per row kind, the strategy keys the prediction models (a row that sets another one is not predicted).
_MODELLED = {
    "ddp": {"_target_"},
    "zero3": {"_target_", "stage", "wrap_policy", "offload", "activation_checkpointing", "coalesce_mb"},
    "fsdp2": {"_target_", "shard_classes"},
}


def _row_kind(strategy: dict[str, Any]) -> tuple[str, Callable[[nn.Module], bool], str, dict[str, Any]] | None:
    """A row's kind for :func:`~lightning_sync.bench.memory_model.predict`, its unit selector (and a key naming
    it) and its options; None where the memory model does not describe the row."""
    from lightning_sync.bench.fsdp2 import resolve_classes
    from lightning_sync.sync.zero.options import resolve_wrap_policy

    target = str(strategy["_target_"]).rsplit(".", 1)[-1]
    kind = {"DDPStrategy": "ddp", "ShardedStrategy": "zero3", "FullyShardStrategy": "fsdp2"}.get(target)
    if kind is None or set(strategy) - _MODELLED[kind] or (kind == "zero3" and strategy.get("stage", 3) != 3):
        return None
    if kind == "ddp":
        return kind, lambda m: False, "", {}
    if kind == "fsdp2":
        classes = resolve_classes(strategy.get("shard_classes", ("torch.nn.Linear",)))
        return kind, lambda m: isinstance(m, classes), repr(classes), {}
    policy = resolve_wrap_policy(strategy.get("wrap_policy"))
    options = {
        "offload": bool(strategy.get("offload")),
        "checkpointing": bool(strategy.get("activation_checkpointing")),
        "coalesce_bytes": int(float(strategy.get("coalesce_mb", DEFAULT_COALESCE_MB)) * 2**20),
    }

    def is_unit(m: nn.Module) -> bool:
        return policy is not None and policy(m, sum(p.numel() for p in m.parameters()))

    return kind, is_unit, repr(strategy.get("wrap_policy")), options


def predict_rows(cfg: Any) -> dict[str, Prediction | None]:
    """Each row's predicted training peak per rank (:mod:`~lightning_sync.bench.memory_model`), from the model
    built here, in this process: its parameters, the units the row wraps, the activations of one training forward
    of a rank's micro-batch and the optimizer's state bytes per parameter byte after one step."""
    from hydra.utils import instantiate

    m, out, described = cfg.memory, {}, {}
    batch = first_batch(instantiate(node(m.model.data)))
    for name, row in m.rows.items():
        found = _row_kind(node(row["strategy"]))
        if found is None:
            out[str(name)] = None
            continue
        kind, is_unit, key, options = found
        if key not in described:
            with torch.random.fork_rng():  # this process's random state (and environment) stay as they were
                torch.manual_seed(0)
                model = built(node(m.model.model))
                optimizer = step_alone(model, batch)
                state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
                params = [p for g in optimizer.param_groups for p in g["params"]]
                factor = storage_bytes(state, set()) / storage_bytes(params, set())
                forward = functools.partial(training_loss, model, batch)
                described[key] = describe(model, forward, is_unit, factor)
        out[str(name)] = predict(described[key], kind, int(m.world_size), **options)
    return out
