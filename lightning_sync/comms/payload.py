"""What every collective shares: validation, devices, byte counts, pickled payloads and padding. No state."""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "ALL_GATHER_SINGLE",
    "DTYPES",
    "MAX_DIMS",
    "REDUCE_OPS",
    "REDUCE_SCATTER_SINGLE",
    "check_even",
    "check_rank",
    "check_reduce",
    "device_of",
    "from_bytes",
    "get_rank",
    "get_world_size",
    "group_ranks",
    "handles_of",
    "is_gloo",
    "nbytes",
    "padded",
    "require_init",
    "shape_row",
    "to_bytes",
]

REDUCE_OPS: dict[str, dist.ReduceOp.RedOpType] = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
MAX_DIMS = 8


def require_init() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "lightning_sync.comms needs a default process group, and none exists. Initialise one "
            "first, e.g. torch.distributed.init_process_group('gloo', rank=RANK, world_size=WORLD) "
            "with MASTER_ADDR/MASTER_PORT set, or run inside a Trainer with a distributed strategy."
        )


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (the default group if None)."""
    require_init()
    return dist.get_rank(group)


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (the default group if None)."""
    require_init()
    return dist.get_world_size(group)


def group_ranks(group: dist.ProcessGroup | None = None) -> list[int]:
    """Global ranks of ``group``, in group-rank order."""
    require_init()
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def check_reduce(op: str, tensor: torch.Tensor) -> dist.ReduceOp.RedOpType:
    """Validate ``op`` for ``tensor`` and return the backend's reduce op."""
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; allowed: {sorted(REDUCE_OPS)}")
    if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(
            f"op='avg' needs a floating-point tensor, got dtype {tensor.dtype}; "
            f"allowed for it: {sorted(set(REDUCE_OPS) - {'avg'})}"
        )
    return REDUCE_OPS[op]


def check_rank(name: str, value: int, group: dist.ProcessGroup | None) -> None:
    ranks = group_ranks(group)
    if not isinstance(value, int) or value not in ranks:
        raise ValueError(f"{name}={value!r} is not a rank of the group; allowed: {ranks}")


def handles_of(handle: Any) -> list[Any]:
    """A backend call's handles: none for a call that ran synchronously (torch returns None)."""
    return [] if handle is None else [handle]


def device_of(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def to_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def from_bytes(t: torch.Tensor) -> Any:
    return pickle.loads(t.cpu().numpy().tobytes())


def shape_row(t: torch.Tensor) -> list[int]:
    if t.dim() > MAX_DIMS:
        raise ValueError(f"tensors with more than {MAX_DIMS} dims are not supported, got shape {tuple(t.shape)}")
    dtype_code = list(DTYPES).index(t.dtype) if t.dtype in DTYPES else -1
    return [dtype_code, t.dim(), *t.shape, *([0] * (MAX_DIMS - t.dim()))]


DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


def padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t.contiguous()
    out = t.new_zeros((rows, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


# torch 2.13 names the flat even collectives *_single and deprecates the *_tensor spellings.
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def check_even(
    fn: str, big_name: str, big: torch.Tensor, small_name: str, small: torch.Tensor, group: dist.ProcessGroup | None
) -> None:
    require_init()
    world = get_world_size(group)
    if big.numel() != world * small.numel():
        raise ValueError(
            f"{fn}: {big_name} has {big.numel()} elements, expected world_size {world} x "
            f"{small_name} {small.numel()} = {world * small.numel()}"
        )


def is_gloo(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "gloo"
