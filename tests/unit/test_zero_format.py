"""How a ZeRO checkpoint is cut into pieces on save and read back at another world size, in one process: which
saved chunks a rank asks for, which it reads straight into place, and what it buffers. The multi-rank saves and
loads at other world sizes are ``tests/multiprocess/test_zero_engine.py`` and ``test_elastic_resume.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_sync.sync.flat import OwnedSlice
from lightning_sync.sync.zero.format import PIECE, Reads, chunk_index, pieces


def _saved(numel: int, world: int) -> tuple[dict[str, SimpleNamespace], dict[str, torch.Tensor]]:
    """DCP metadata and data of one parameter of ``numel`` values saved by ``world`` ranks in pieces."""
    value = torch.arange(numel, dtype=torch.float32)
    per_rank = -(-numel // world)
    meta, data = {}, {}
    for r in range(world):
        lo, hi = r * per_rank, min(numel, (r + 1) * per_rank)
        for offset, length in pieces(OwnedSlice(0, lo, 0, hi - lo)):
            meta[f"model/w@{offset}"] = SimpleNamespace(size=(length,), properties=SimpleNamespace(dtype=torch.float32))
            data[f"model/w@{offset}"] = value[offset : offset + length].clone()
    return meta, data


def test_a_range_is_saved_in_pieces_cut_at_multiples_of_piece() -> None:
    assert pieces(OwnedSlice(0, 5, 0, 10)) == [(5, 10)]
    assert pieces(OwnedSlice(0, PIECE - 3, 0, PIECE + 10)) == [(PIECE - 3, 3), (PIECE, PIECE), (2 * PIECE, 7)]


@pytest.mark.parametrize(("saved_world", "world"), [(2, 3), (3, 2), (3, 3), (1, 4)])
def test_a_reader_reads_its_range_in_place_and_buffers_at_most_two_pieces(saved_world: int, world: int) -> None:
    numel = 5 * PIECE + 1234  # ranges of the writers and the readers fall inside pieces
    meta, data = _saved(numel, saved_world)
    chunks = chunk_index(meta)
    per_rank = -(-numel // world)
    for r in range(world):
        lo, hi = r * per_rank, min(numel, (r + 1) * per_rank)
        dest = torch.full((per_rank,), -1.0)
        reads = Reads()
        reads.add(dest, "model/w", chunks, meta, OwnedSlice(0, lo, 0, hi - lo))
        storage = dest.untyped_storage().data_ptr()
        direct = {k for k, t in reads.want.items() if t.untyped_storage().data_ptr() == storage}
        buffered = sum(t.numel() for k, t in reads.want.items() if k not in direct)
        # only the pieces cut by this rank's two edges are read beside it
        assert buffered <= 2 * PIECE, (r, buffered)
        assert sum(reads.want[k].numel() for k in direct) + buffered - (hi - lo) <= 2 * PIECE
        for key, tensor in reads.want.items():  # what DCP does: read each entry into the tensor given
            tensor.copy_(data[key])
        reads.finish()
        assert torch.equal(dest[: hi - lo], torch.arange(lo, hi, dtype=torch.float32)), r
        assert reads.want == {}


def test_a_range_the_chunks_do_not_cover_is_refused_naming_the_count() -> None:
    meta, _ = _saved(100, 2)
    chunks = chunk_index({k: v for k, v in meta.items() if not k.endswith("@0")})  # rank 0's piece lost
    with pytest.raises(ValueError, match="checkpoint holds 50 of the 60 elements of model/w this rank needs"):
        Reads().add(torch.empty(60), "model/w", chunks, meta, OwnedSlice(0, 40, 0, 60))
