"""Global batch accounting: ``global = per_device x world x accumulate``, derived from any two of the three.

In synchronous data-parallel training every optimizer step averages the gradients of
``per_device`` samples on each of ``world`` ranks over ``accumulate`` micro-batches, so the
global (effective) batch is their product. :func:`derive_batch` takes any two of
``global_size``, ``per_device`` and ``accumulate`` plus the world size (devices x nodes),
derives the third, and refuses a combination that does not multiply out, naming every number,
as DeepSpeed does for ``train_batch_size`` / ``train_micro_batch_size_per_gpu`` /
``gradient_accumulation_steps``. The train app (``lightning-sync train batch.global_size=...``)
applies the result to ``data.batch_size`` and ``trainer.accumulate_grad_batches``.

:func:`large_batch_warning` says when a global batch is large enough (above :data:`LARGE_BATCH`)
that plain SGD or Adam tends to lose generalization and a layer-wise adaptive optimizer (LARS,
LAMB) is the usual answer.

Imports nothing from Lightning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_sync._checks import check_int

__all__ = ["LARGE_BATCH", "LARGE_BATCH_OPTIMIZERS", "BatchPlan", "derive_batch", "large_batch_warning", "world_size_of"]

#: Global batch above which :func:`large_batch_warning` warns unless the optimizer is LARS or LAMB.
LARGE_BATCH = 32768
#: Optimizer names (matched case-insensitively within the name's last dotted part) that count as
#: layer-wise adaptive, large-batch optimizers.
LARGE_BATCH_OPTIMIZERS: tuple[str, ...] = ("lars", "larc", "lamb")

_KEYS = ("global_size", "per_device", "accumulate")


@dataclass(frozen=True)
class BatchPlan:
    """One consistent batch configuration: ``global_size == per_device * world_size * accumulate``."""

    #: Samples per optimizer step, over all ranks and micro-batches.
    global_size: int
    #: Samples per micro-batch on each rank: the DataLoader's ``batch_size``.
    per_device: int
    #: Micro-batches per optimizer step: the Trainer's ``accumulate_grad_batches``.
    accumulate: int
    #: Ranks taking part in each step: devices per node x nodes.
    world_size: int

    def __post_init__(self) -> None:
        for name in ("world_size", *_KEYS):
            check_int(name, getattr(self, name), 1)
        product = self.per_device * self.world_size * self.accumulate
        if product != self.global_size:
            raise ValueError(
                f"inconsistent batch: global {self.global_size} != per_device {self.per_device} x "
                f"world {self.world_size} x accumulate {self.accumulate} (= {product})"
            )

    def describe(self) -> str:
        """One line, e.g. ``global batch 256 = per_device 32 x world 2 x accumulate 4``."""
        return (
            f"global batch {self.global_size} = per_device {self.per_device} x world {self.world_size} "
            f"x accumulate {self.accumulate}"
        )


def derive_batch(
    world_size: int, global_size: int | None = None, per_device: int | None = None, accumulate: int | None = None
) -> BatchPlan:
    """The :class:`BatchPlan` of ``world_size`` ranks and at least two of the three batch numbers.

    Given two, the third is derived; given all three, they must multiply out. Raises ``ValueError``
    naming every number when fewer than two are given, when a value is not an int >= 1 (bools too),
    when ``global_size`` is not divisible by the product of the other two given numbers, or when
    the three given numbers are inconsistent.
    """
    check_int("world_size", world_size, 1)
    given = {k: v for k, v in zip(_KEYS, (global_size, per_device, accumulate)) if v is not None}
    for name, value in given.items():
        check_int(name, value, 1)
    if len(given) < 2:
        got = ", ".join(f"{k}={v}" for k, v in given.items()) or "none"
        raise ValueError(
            f"batch: give at least two of {', '.join(_KEYS)} (the third is derived with world {world_size}); got {got}"
        )
    if per_device is not None and accumulate is not None:  # global derived, or given and checked
        product = per_device * world_size * accumulate
        return BatchPlan(product if global_size is None else global_size, per_device, accumulate, world_size)
    assert global_size is not None
    if per_device is not None:
        divisor, what = per_device * world_size, f"per_device {per_device} x world {world_size}"
    else:
        assert accumulate is not None
        divisor, what = world_size * accumulate, f"world {world_size} x accumulate {accumulate}"
    if global_size % divisor:
        fixed = divisor // world_size  # per_device or accumulate: what does not scale with the world size
        holding = _worlds_holding(global_size, fixed, world_size)
        raise ValueError(f"global {global_size} is not divisible by {what} (= {divisor}); {holding}")
    derived = global_size // divisor
    if per_device is not None:
        return BatchPlan(global_size, per_device, derived, world_size)
    return BatchPlan(global_size, derived, accumulate, world_size)


def _worlds_holding(global_size: int, fixed: int, world_size: int) -> str:
    """Which world sizes near ``world_size`` would hold ``global_size`` with the other given number
    (``fixed``), for a refusal: a run resized to one of them derives the rest."""
    if global_size % fixed:
        return f"no world size does: {global_size} is not a multiple of {fixed}"
    quotient = global_size // fixed
    below = max((w for w in range(1, world_size) if quotient % w == 0), default=None)
    above = next((w for w in range(world_size + 1, quotient + 1) if quotient % w == 0), None)
    near = [str(w) for w in (below, above) if w is not None]
    return f"the nearest world sizes that hold it: {' and '.join(near)}"


def world_size_of(devices: object, num_nodes: object = 1) -> int:
    """Ranks of a run: ``devices`` (processes per node) x ``num_nodes``.

    ``devices`` is an int >= 1, a string of digits, or a sequence of device indices (its length);
    ``"auto"``, ``-1`` and other forms that leave the count to the machine are refused, because the
    batch arithmetic needs the number before the Trainer exists.
    """
    count: object = devices
    if isinstance(devices, str):
        count = int(devices) if devices.strip().isdigit() else devices
    elif isinstance(devices, Sequence) and not isinstance(devices, bytes):
        count = len(devices) or devices
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(
            f"devices={devices!r}: the batch arithmetic needs the number of processes per node, "
            f"an int >= 1 (or a list of device indices); 'auto' and -1 are not allowed here"
        )
    return count * check_int("num_nodes", num_nodes, 1)


def large_batch_warning(global_size: int, optimizer: str | None) -> str | None:
    """The warning text when ``global_size`` > :data:`LARGE_BATCH` and ``optimizer`` is not LARS/LAMB, else None.

    ``optimizer``: a name or a class path (``"adam"``, ``"pytorch_optimizer.LAMB"``); None when unknown,
    which warns too.
    """
    if global_size <= LARGE_BATCH:
        return None
    if optimizer is not None:
        last = str(optimizer).rsplit(".", 1)[-1].lower()
        if any(name in last for name in LARGE_BATCH_OPTIMIZERS):
            return None
    which = f"optimizer {optimizer!r}" if optimizer is not None else "an optimizer the config does not name"
    return (
        f"global batch {global_size} > {LARGE_BATCH} with {which}: very large batches tend to generalize "
        f"worse (the generalization gap: Keskar et al. 2017, 'On Large-Batch Training for Deep Learning'), "
        f"and plain SGD/Adam lose accuracy at this size even with linear LR scaling and warmup; a layer-wise "
        f"adaptive optimizer such as LARS (You et al. 2017) or LAMB (You et al. 2020) is the usual answer."
    )
