"""Per-rank states as bytes without pickling: a JSON header for the structure, one flat buffer for the tensors.

A checkpoint carries every rank's RNG states and the strategy's own per-rank state, gathered on the rank that
writes it. Pickled, each tensor in them would go through ``torch.save`` on every rank (a tensor's storage
pickles itself that way), and the writing rank would unpickle what its peers sent: a checkpoint would call
``torch.save`` on ranks that write nothing, which Lightning's own tests count, and a peer's bytes would be
code to run. Here a state is flattened into

* a **header**, JSON: the nesting of dicts, lists and tuples, the scalars themselves (``None``, bools, ints,
  floats, strings; JSON keeps every int and float exactly, NaN and infinities included), and for each tensor
  its dtype, shape, device and where its bytes lie in (a sparse COO tensor: its indices' and values')
* **one flat uint8 buffer** holding every tensor's bytes, one after the other.

:func:`pack` joins both into one uint8 tensor (8 bytes of header length, the header, the buffer) that any
tensor collective carries, so a gather of states to one rank is one uneven tensor gather
(:func:`gather_states`); :func:`unpack` rebuilds the state, every tensor a compact copy of its own, on the
device it came from where this process has that device (else on the CPU). Anything else (a NumPy scalar, a
set, a dict subclass, a sparse CSR or quantized tensor, an arbitrary object) is refused with a ``TypeError``
naming where it sits and its type, rather than pickled.

Imports nothing from Lightning.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from lightning_sync import comms
from lightning_sync.comms.payload import device_of

__all__ = ["gather_states", "pack", "unpack"]

_FORMAT = 1  # version of the header's layout; unpack refuses any other
_LENGTH_BYTES = 8  # the header's length, little-endian, at the start of a packed state
_SCALARS = (type(None), bool, int, float, str)


class _Packer:
    """Walks one state: returns its JSON-able header node and collects its tensors' bytes in order."""

    def __init__(self) -> None:
        self.chunks: list[torch.Tensor] = []
        self.size = 0  # bytes collected so far: the offset of the next tensor

    def node(self, value: Any, where: str) -> Any:
        kind = type(value)
        if kind in _SCALARS:
            return value
        if kind is list:
            return [self.node(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if kind is tuple:
            return {"tuple": [self.node(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if kind is dict:
            return {"dict": [[self.key(k, where), self.node(v, f"{where}[{k!r}]")] for k, v in value.items()]}
        if kind is torch.Tensor and value.layout is torch.sparse_coo:  # sparse gradients' momentum (Hogwild)
            return {"sparse_coo": self.sparse(value, where)}
        if kind is torch.Tensor:
            return {"tensor": self.tensor(value, where)}
        raise TypeError(
            f"the per-rank state's entry {where} is a {kind.__module__}.{kind.__qualname__}; a checkpoint's per-rank "
            f"states travel as JSON and tensors, so they may hold only None, bool, int, float, str, list, tuple, "
            f"dict and plain torch.Tensor values, dense or sparse COO (convert it, e.g. with float() or "
            f"torch.as_tensor())"
        )

    def key(self, key: Any, where: str) -> Any:
        if type(key) in _SCALARS or type(key) is tuple:
            return self.node(key, f"{where} key {key!r}")
        raise TypeError(
            f"the per-rank state's entry {where} has a key of type {type(key).__qualname__} ({key!r}); dict keys "
            f"may be None, bool, int, float, str or tuples of them"
        )

    def sparse(self, t: torch.Tensor, where: str) -> dict[str, Any]:
        """A COO tensor as its indices and values (dense tensors), its shape and whether it is coalesced."""
        plain = t.detach()
        meta = {
            "indices": self.tensor(plain._indices(), where),
            "values": self.tensor(plain._values(), where),
            "shape": list(t.shape),
            "coalesced": t.is_coalesced(),
        }
        if t.requires_grad:
            meta["requires_grad"] = True
        return meta

    def tensor(self, t: torch.Tensor, where: str) -> dict[str, Any]:
        if t.layout is not torch.strided or t.is_quantized or t.is_meta:
            raise TypeError(
                f"the per-rank state's entry {where} is a {t.layout} tensor{' (quantized)' if t.is_quantized else ''}"
                f"{' on the meta device' if t.is_meta else ''}; only dense (strided) and sparse COO tensors with "
                f"data travel"
            )
        data = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
        meta = {
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "device": str(t.device),
            "offset": self.size,
            "nbytes": data.numel(),
        }
        if t.requires_grad:
            meta["requires_grad"] = True
        self.chunks.append(data.cpu())
        self.size += data.numel()
        return meta


def pack(state: Any) -> torch.Tensor:
    """``state`` as one uint8 CPU tensor: header length, JSON header, tensor bytes (module docstring).
    Raises ``TypeError`` naming the entry for a value that is neither a JSON scalar, a list, tuple or dict of
    such values, nor a dense or sparse COO tensor."""
    packer = _Packer()
    header = json.dumps({"format": _FORMAT, "tree": packer.node(state, "state")}, separators=(",", ":"))
    head = header.encode("utf-8")
    prefix = torch.frombuffer(bytearray(len(head).to_bytes(_LENGTH_BYTES, "little") + head), dtype=torch.uint8)
    return torch.cat([prefix, *packer.chunks])


def unpack(packed: torch.Tensor) -> Any:
    """The state :func:`pack` packed; every tensor a copy with storage of its own."""
    packed = packed.reshape(-1).cpu()
    if packed.dtype != torch.uint8 or packed.numel() < _LENGTH_BYTES:
        raise ValueError(f"a packed state is a uint8 tensor of at least {_LENGTH_BYTES} bytes, got {packed.dtype}")
    length = int.from_bytes(bytes(packed[:_LENGTH_BYTES].tolist()), "little")
    end = _LENGTH_BYTES + length
    if end > packed.numel():
        raise ValueError(f"a packed state's header claims {length} bytes but only {packed.numel()} bytes arrived")
    header = json.loads(packed[_LENGTH_BYTES:end].numpy().tobytes().decode("utf-8"))
    if header.get("format") != _FORMAT:
        raise ValueError(f"packed state format {header.get('format')!r} is not supported; allowed: [{_FORMAT}]")
    return _rebuild(header["tree"], packed[end:])


def _rebuild(node: Any, data: torch.Tensor) -> Any:
    if isinstance(node, list):
        return [_rebuild(v, data) for v in node]
    if not isinstance(node, dict):
        return node  # a scalar
    if "tuple" in node:
        return tuple(_rebuild(v, data) for v in node["tuple"])
    if "dict" in node:
        return {_rebuild(k, data): _rebuild(v, data) for k, v in node["dict"]}
    if "sparse_coo" in node:
        meta = node["sparse_coo"]
        indices, values = _tensor(meta["indices"], data), _tensor(meta["values"], data)
        t = torch.sparse_coo_tensor(
            indices, values, meta["shape"], is_coalesced=meta["coalesced"], check_invariants=True
        )
        return t.requires_grad_() if meta.get("requires_grad") else t
    return _tensor(node["tensor"], data)


def _tensor(meta: dict[str, Any], data: torch.Tensor) -> torch.Tensor:
    start, nbytes = int(meta["offset"]), int(meta["nbytes"])
    # a copy, not a view of the received buffer: torch.save would otherwise write the whole buffer per tensor
    t = data[start : start + nbytes].clone().view(getattr(torch, meta["dtype"])).reshape(meta["shape"])
    t = _placed(t, torch.device(meta["device"]))
    return t.requires_grad_() if meta.get("requires_grad") else t


def _placed(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` where this process has it, as unpickling would put it; else on the CPU (a rank of
    another node may have sent a device index this one lacks)."""
    if device.type == "cpu":
        return t
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        return t
    return t.to(device)


def gather_states(comm: comms.CommContext, state: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's ``state``, in rank order, on ``dst`` (None elsewhere): each rank packs its own and one
    uneven tensor gather through ``comm`` carries them; nothing is pickled or unpickled. Every rank of the
    default group must call it. Without a process group, this process's state alone, packed and unpacked
    (so the same values are refused, and the result is a copy, as it is with peers)."""
    packed = pack(state)
    if not (dist.is_available() and dist.is_initialized()):
        return [unpack(packed)]
    parts = comm.gather(packed.to(device_of(None)), dst=dst)
    return None if parts is None else [unpack(p) for p in parts]
