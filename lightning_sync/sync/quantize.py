"""Outer-gradient codecs for DiLoCo's outer all-reduce: fp32, bf16, and int8 / int4 with error feedback.

A codec averages one flat pseudo-gradient over the ranks in two halves, :meth:`start` (issue the communication)
and a handle's ``wait()`` (its average), so that the strategy can hide the communication behind inner steps.

* ``fp32``: an all-reduce-average of the tensor as it is (DiLoCo's own; the tensor's dtype is kept).
* ``bf16``: divided by K in fp32, cast, summed in bf16 by the all-reduce, cast back: half the bytes.
* ``int8`` / ``int4``: symmetric round-to-nearest codes with one fp32 scale per chunk of :data:`CHUNK` values
  (``absmax / 127`` or ``absmax / 7``; int4 codes are packed two to a byte). Codes of different scales cannot
  be summed as they travel, so the average is a reduce-scatter and an all-gather written out:

  1. every rank encodes its vector and sends segment j to rank j (an all-to-all of codes and scales);
  2. rank j decodes the K segments it received, sums them in rank order in fp32 and divides by K, encodes
     that mean segment, and sends it to every rank (an all-gather of codes and scales);
  3. every rank decodes the same bytes, so every replica gets the same average, bit for bit.

  The wire carries codes and scales only: per value 1 byte (int8) or half a byte (int4), plus 4 bytes per chunk,
  on each of the two halves. Error feedback (Seide et al. 2014; Karimireddy et al. 2019; DeepSpeed's 1-bit
  Adam keeps the same two buffers): what a rank's encoding lost is added to its next vector (the *worker*
  error, one per rank), and what the mean segment's encoding lost is added to the next mean (the *server* error,
  held by the segment's owner). Nothing is dropped for good: the sum of the averages sent over many rounds
  differs from the sum of the true averages by the errors still held, which stay bounded by one chunk's
  quantization step.

Encoding and decoding are recorded as codec time (``comm.record``), as the gradient compressors' are.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from lightning_sync.sync.communicator import Communicator, WorkLike
from lightning_sync.sync.compression import CODEC_OP

__all__ = [
    "CHUNK",
    "OUTER_DTYPES",
    "OuterCodec",
    "check_outer_dtype",
    "decode",
    "encode",
    "encoded_bytes",
    "segment_of",
]

OUTER_DTYPES = ("fp32", "bf16", "int8", "int4")
CHUNK = 128
"""Values per scale: the scales cost 4 bytes per 128 values (3 % of int8's bytes, 6 % of int4's)."""

_LEVELS = {"int8": 127, "int4": 7}


def check_outer_dtype(dtype: Any) -> None:
    """A ValueError naming ``dtype`` and the codecs there are, unless it is one of them."""
    if dtype not in OUTER_DTYPES:
        raise ValueError(f"outer_dtype must be one of {list(OUTER_DTYPES)}, got {dtype!r}")


def segment_of(numel: int, world: int) -> int:
    """Values of each rank's segment of a vector of ``numel`` values: whole chunks, padded so world segments hold
    it all."""
    return -(-numel // (world * CHUNK)) * CHUNK


def encoded_bytes(numel: int, dtype: str) -> int:
    """Bytes of ``numel`` values (a multiple of :data:`CHUNK`) encoded as ``dtype``: codes, then fp32 scales."""
    codes = numel if dtype == "int8" else numel // 2
    return codes + 4 * (numel // CHUNK)


def encode(x: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (fp32, a multiple of :data:`CHUNK` values) as one uint8 buffer of codes and scales, and what
    decoding it gives back (``x`` minus the encoding's error)."""
    levels = _LEVELS[dtype]
    chunks = x.view(-1, CHUNK)
    scale = chunks.abs().amax(dim=1, keepdim=True) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(chunks / safe).clamp_(-levels, levels).to(torch.int8)
    decoded = (codes.to(torch.float32) * scale).view(-1)
    if dtype == "int4":  # -7..7 as 1..15, two to a byte
        nibbles = (codes + 8).to(torch.uint8).view(-1, 2)
        packed = nibbles[:, 0] | (nibbles[:, 1] << 4)
    else:
        packed = codes.view(torch.uint8).view(-1)
    return torch.cat([packed.view(-1), scale.view(-1).view(torch.uint8)]), decoded


def decode(buffer: torch.Tensor, numel: int, dtype: str) -> torch.Tensor:
    """The fp32 values of an :func:`encode` buffer of ``numel`` values."""
    n_codes = encoded_bytes(numel, dtype) - 4 * (numel // CHUNK)
    packed, scales = buffer[:n_codes], buffer[n_codes:].clone().view(torch.float32)
    if dtype == "int4":
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=1).view(-1).to(torch.int8) - 8
    else:
        codes = packed.view(torch.int8)
    return (codes.to(torch.float32).view(-1, CHUNK) * scales.view(-1, 1)).view(-1)


class OuterCodec:
    """Averages flat pseudo-gradients over the ranks as ``dtype`` (see the module docstring).

    Each flat tensor has a ``key`` (the strategy's fragment and dtype group), under which the error-feedback
    buffers of ``int8`` / ``int4`` are kept; they are this rank's own (:meth:`rank_state`)."""

    def __init__(self, dtype: str = "fp32") -> None:
        check_outer_dtype(dtype)
        self.dtype = dtype
        self.worker_errors: dict[str, torch.Tensor] = {}  # key -> this rank's vector's carried error
        self.server_errors: dict[str, torch.Tensor] = {}  # key -> the carried error of the segment it owns

    @property
    def lossy_with_memory(self) -> bool:
        return self.dtype in _LEVELS

    def start(self, key: str, flat: torch.Tensor, comm: Communicator) -> Any:
        """Issue the average of ``flat`` (left untouched); the handle's ``advance()`` issues its second half where
        there is one, and ``wait()`` returns the average."""
        if self.dtype == "fp32":
            work = comm.all_reduce(flat, op="avg", async_op=True)
            return _Single(work, lambda: flat)
        if self.dtype == "bf16":
            started = time.perf_counter()
            low = flat.float().div(comm.world_size).to(torch.bfloat16)
            comm.record(CODEC_OP, 0, time.perf_counter() - started, calls=1)
            work = comm.all_reduce(low, op="sum", async_op=True)
            return _Single(work, lambda: low.to(flat.dtype))
        return _Quantized(self, key, flat, comm)

    def rank_state(self) -> dict[str, Any]:
        """This rank's error-feedback buffers."""
        return {
            "worker": {k: v.clone() for k, v in self.worker_errors.items()},
            "server": {k: v.clone() for k, v in self.server_errors.items()},
        }

    def load_rank_state(self, state: dict[str, Any]) -> None:
        self.worker_errors = {k: v.clone() for k, v in state.get("worker", {}).items()}
        self.server_errors = {k: v.clone() for k, v in state.get("server", {}).items()}

    @staticmethod
    def regrouped(states: list[dict[str, Any]], world: int, rank: int) -> dict[str, Any]:
        """This rank's error-feedback buffers at ``world`` ranks from the ``states`` of another number of ranks,
        keeping what they carry: a rank's vector is averaged, so every new rank carries the mean worker error
        (the average then carries the same total); the server errors, segments of one vector in rank order,
        are put together and cut into this rank's segment of the new layout."""
        out: dict[str, Any] = {"worker": {}, "server": {}}
        if not all(s.get("worker") for s in states):
            return out  # saved before any sync: nothing carried yet
        for key in states[0]["worker"]:
            workers = [s["worker"][key] for s in states]
            numel = workers[0].numel()
            out["worker"][key] = torch.stack([w.double() for w in workers]).mean(0).to(workers[0].dtype)
            servers = [s["server"].get(key) for s in states]
            if any(part is None for part in servers):
                continue  # a launch whose second half never ran: no server error yet
            whole = torch.cat(servers)[:numel]
            segment = segment_of(numel, world)
            mine = whole.new_zeros(segment)
            piece = whole[rank * segment : (rank + 1) * segment]
            mine[: piece.numel()] = piece
            out["server"][key] = mine
        return out


class _Single:
    """One all-reduce in flight; ``finish`` turns its buffer into the average."""

    def __init__(self, work: WorkLike, finish: Any) -> None:
        self._work, self._finish, self._result = work, finish, None

    def advance(self) -> None:
        pass

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._work.wait()
            self._result = self._finish()
        return self._result


class _Quantized:
    """The two halves of an int8 / int4 average of one flat vector (module docstring, steps 1 to 3)."""

    def __init__(self, codec: OuterCodec, key: str, flat: torch.Tensor, comm: Communicator) -> None:
        self.codec, self.key, self.comm, self.dtype = codec, key, comm, codec.dtype
        self.numel, self.like = flat.numel(), flat
        self.world = world = comm.world_size
        self.segment = segment_of(self.numel, world)
        self.per = encoded_bytes(self.segment, self.dtype)  # bytes of one encoded segment
        started = time.perf_counter()
        vector = flat.new_zeros(world * self.segment, dtype=torch.float32)
        vector[: self.numel] = flat.reshape(-1)
        error = codec.worker_errors.get(key)
        if error is not None and error.numel() == self.numel:
            vector[: self.numel] += error.to(vector.device)  # from a checkpoint: on the CPU
        pieces = [encode(part, self.dtype) for part in vector.view(world, self.segment)]
        # the padding is zeros and decodes to zeros: its error is nil
        codec.worker_errors[key] = (vector - torch.cat([decoded for _, decoded in pieces]))[: self.numel]
        sent = torch.cat([buffer for buffer, _ in pieces])
        comm.record(CODEC_OP, 0, time.perf_counter() - started, calls=1)
        self._received = torch.empty_like(sent)
        self._first: WorkLike | None = comm.all_to_all_into(self._received, sent, async_op=True)
        self._second: WorkLike | None = None
        self._gathered: torch.Tensor | None = None
        self._result: torch.Tensor | None = None

    def advance(self) -> None:
        """Wait for the segments this rank owns, average them, and issue the all-gather of the mean."""
        if self._first is None:
            return
        self._first.wait()
        self._first = None
        started = time.perf_counter()
        received = self._received.view(self.world, self.per)
        mean = decode(received[0], self.segment, self.dtype)
        for r in range(1, self.world):  # rank order: the same sum on any run
            mean += decode(received[r], self.segment, self.dtype)
        mean /= self.world
        error = self.codec.server_errors.get(self.key)
        if error is not None and error.numel() == mean.numel():
            mean += error.to(mean.device)
        mine, decoded = encode(mean, self.dtype)
        self.codec.server_errors[self.key] = mean - decoded
        self.comm.record(CODEC_OP, 0, time.perf_counter() - started, calls=1)
        self._gathered = mine.new_empty(self.world * self.per)
        self._second = self.comm.all_gather_into(self._gathered, mine, async_op=True)

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self.advance()
            assert self._second is not None and self._gathered is not None
            self._second.wait()
            started = time.perf_counter()
            parts = self._gathered.view(self.world, self.per)
            average = torch.cat([decode(part, self.segment, self.dtype) for part in parts])
            self._result = average[: self.numel].view_as(self.like).to(self.like.dtype)
            self.comm.record(CODEC_OP, 0, time.perf_counter() - started, calls=1)
        return self._result
