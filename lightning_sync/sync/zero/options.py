"""What a ZeRO run is configured with, checked once: stage, dtypes, wrap policy; and the memory model.

:func:`zero_memory_bytes` is the per-rank memory model of the ZeRO paper (Rajbhandari et al., SC 2020)
for mixed-precision Adam (2 bytes fp16 parameters, 2 bytes fp16 gradients, K=12 bytes of optimizer
state per parameter: fp32 master copy, momentum and variance): baseline 16Ψ, stage 1 4Ψ + 12Ψ/N,
stage 2 2Ψ + 14Ψ/N, stage 3 16Ψ/N. :func:`storage_bytes` measures what a run really holds, to compare.

The validators live apart from the engine so a strategy can reject a bad argument before it builds
anything (and Hydra configs can name dtypes and classes as strings).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "ZERO_STAGES",
    "check_stage",
    "import_class",
    "resolve_dtype",
    "resolve_wrap_policy",
    "storage_bytes",
    "zero_memory_bytes",
]

ZERO_STAGES = (1, 2, 3)


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
