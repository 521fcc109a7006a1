"""The sharding baseline of the benchmark: torch's FSDP2 ``fully_shard`` under Lightning's ModelParallelStrategy,
which needs a ``configure_model`` hook that a plain module lacks. Per step a rank sends ``3(K-1)/K * S`` bytes
(Zhao et al., "PyTorch FSDP", VLDB 2023; ``2(K-1)/K`` without resharding).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from typing_extensions import override

from lightning_sync.sync.zero import import_class

__all__ = ["FullyShardStrategy", "resolve_classes"]


def resolve_classes(names: Sequence[str | type]) -> tuple[type[nn.Module], ...]:
    """Dotted class names (``"torch.nn.Linear"``) or classes as ``nn.Module`` subclasses, else ``ValueError``."""
    if isinstance(names, (str, type)) or not isinstance(names, Sequence):
        raise ValueError(f"shard_classes must be a list of dotted class names, got {names!r}")
    out = []
    for name in names:
        try:
            cls: Any = import_class(name, "shard_classes") if isinstance(name, str) else name
        except ValueError:
            cls = None
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(
                f"shard_classes entries must name nn.Module subclasses (e.g. 'torch.nn.Linear'), got {name!r}"
            )
        out.append(cls)
    return tuple(out)


class FullyShardStrategy(ModelParallelStrategy):
    """FSDP2 (``fully_shard``) on every module of ``shard_classes`` (dotted names or classes) plus the root, over
    ``data_parallel_size`` ranks (None: all). ``reshard_after_forward`` frees each unit's gathered parameters after
    its forward and gathers them again for backward (ZeRO-3). Other keywords go to ModelParallelStrategy.

    A module whose own ``configure_model()`` builds its layers (and shards nothing) is built deferred, FSDP2's
    meta-device route as Lightning's ModelParallelStrategy takes it: that hook runs on the meta device, the units
    are sharded there, and :meth:`setup` gives each rank storage for its shards only and initializes them with
    every module's ``reset_parameters()``. A layer built before ``fit`` keeps its storage and values."""

    def __init__(
        self,
        shard_classes: Sequence[str | type] = ("torch.nn.Linear",),
        reshard_after_forward: bool = True,
        data_parallel_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        if (tp := kwargs.pop("tensor_parallel_size", 1)) not in (1, "auto"):
            raise ValueError(f"tensor_parallel_size must be 1 (this strategy only shards data-parallel), got {tp!r}")
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward must be True or False, got {reshard_after_forward!r}")
        super().__init__(data_parallel_size=data_parallel_size or "auto", tensor_parallel_size=1, **kwargs)
        self._dp_from_world = data_parallel_size is None
        self._shard_classes = resolve_classes(shard_classes)
        self._reshard_after_forward = reshard_after_forward
        self._installed_on: pl.LightningModule | None = None
        self._own_hook: Callable[[pl.LightningModule], None] | None = None

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        # the module's own hook builds its layers (and must not shard them: that is this strategy's part)
        self._own_hook = type(model).configure_model if is_overridden("configure_model", model) else None
        model.configure_model = self._configure_model  # type: ignore[method-assign]
        self._installed_on = model

    @override
    def setup_environment(self) -> None:
        if self._dp_from_world:
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def _configure_model(self) -> None:
        """The ``configure_model`` hook given to the module (removed at teardown): a unit per matching module in
        post-order, bar one holding a parameter tied outside it (FSDP2 refuses a parameter in two), then the root."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        root = self.lightning_module
        assert root is not None
        if isinstance(root, FSDPModule):  # configure_model runs again in a later fit/validate
            return
        if self._own_hook is not None:
            with torch.device("meta"):  # deferred: setup gives each rank storage for its shards only
                self._own_hook(root)
            if any(isinstance(m, FSDPModule) for m in root.modules()):
                raise ValueError(
                    f"{type(root).__name__}.configure_model() applies fully_shard itself; use lightning's "
                    f"ModelParallelStrategy, or build only the layers there and let {type(self).__name__} shard "
                    f"{[c.__name__ for c in self._shard_classes]} modules"
                )
        mesh = self.device_mesh["data_parallel"]
        owners: dict[int, list[nn.Module]] = {}
        for mod in root.modules():
            for p in mod.parameters(recurse=False):  # a tied parameter is listed by every module holding it
                owners.setdefault(id(p), []).append(mod)

        def tied_outside(unit: nn.Module) -> bool:
            inside = {id(m) for m in unit.modules()}
            return any(id(o) not in inside for p in unit.parameters() for o in owners[id(p)])

        units = [m for m in root.modules() if m is not root and isinstance(m, self._shard_classes)]
        units = [m for m in units if not tied_outside(m)]
        for module in reversed(units):  # post-order: children before their parents
            fully_shard(module, mesh=mesh, reshard_after_forward=self._reshard_after_forward)
        fully_shard(root, mesh=mesh, reshard_after_forward=self._reshard_after_forward)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Lightning's setup; a model built on the meta device is materialized first, as Lightning would (each
        rank's shards get storage, then every module's ``reset_parameters()``), but with its torchmetrics metrics
        taken out: ``to_empty`` on the root also empties their states and the defaults ``reset()`` restores."""
        from lightning.fabric.utilities.init import _materialize_distributed_module
        from torchmetrics import Metric

        assert self.model is not None
        if any(t.is_meta for t in (*self.model.parameters(), *self.model.buffers())):
            metrics = [
                (parent, name, m)
                for parent in self.model.modules()
                for name, m in parent._modules.items()
                if isinstance(m, Metric)
            ]
            for parent, name, _ in metrics:
                parent._modules[name] = None  # module operations skip a None child
            try:
                _materialize_distributed_module(self.model, self.root_device)
            finally:
                for parent, name, m in metrics:
                    parent._modules[name] = m
        super().setup(trainer)

    @override
    def teardown(self) -> None:
        if self._installed_on is not None:
            self._installed_on.__dict__.pop("configure_model", None)
            self._installed_on = None
        super().teardown()
