"""FlatShard layout and the ZeRO memory model, in one process (LoopbackCommunicator)."""

from __future__ import annotations

import pytest
import torch

from lightning_sync.sync import FlatShard, LoopbackCommunicator, zero_memory_bytes

SHAPES = [(3, 5), (7,), (2, 2, 2), (1,)]  # 31 elements: not divisible by 2, 3 or 4


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_layout_pads_to_a_multiple_of_k_and_shards_tile_it(world: int) -> None:
    shards = [FlatShard(SHAPES, world, r) for r in range(world)]
    assert all(s.total == 31 and s.padded % world == 0 and 0 <= s.padding < world for s in shards)
    assert [(s.start, s.end) for s in shards] == [
        (r * shards[0].shard_numel, (r + 1) * shards[0].shard_numel) for r in range(world)
    ]
    assert shards[-1].end == shards[0].padded


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_owned_slices_cover_every_element_exactly_once_and_never_the_padding(world: int) -> None:
    covered = {i: [] for i in range(len(SHAPES))}
    for r in range(world):
        fs = FlatShard(SHAPES, world, r)
        pos = 0
        for sl in fs.owned_slices():
            assert sl.shard_offset >= pos  # in order, no overlap inside the shard
            pos = sl.shard_offset + sl.length
            covered[sl.index].extend(range(sl.param_offset, sl.param_offset + sl.length))
        assert pos <= fs.shard_numel
    for i, shape in enumerate(SHAPES):
        assert sorted(covered[i]) == list(range(torch.Size(shape).numel()))


def test_flatten_views_roundtrip_and_padding_is_zero_and_invisible() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g) for s in SHAPES]
    fs = FlatShard(SHAPES, 4, 0)
    flat = fs.flatten(tensors)
    assert flat.numel() == 32 and flat[31:].eq(0).all()
    for got, want in zip(fs.views(flat), tensors):
        assert torch.equal(got, want)  # exact: pure data movement
    assert sum(v.numel() for v in fs.views(flat)) == 31


def test_owned_slices_read_the_same_numbers_as_the_shard() -> None:
    tensors = [torch.arange(torch.Size(s).numel(), dtype=torch.float32).view(s) + 100 * i for i, s in enumerate(SHAPES)]
    for r in range(3):
        fs = FlatShard(SHAPES, 3, r)
        shard = fs.shard(fs.flatten(tensors))
        for sl in fs.owned_slices():
            want = tensors[sl.index].reshape(-1)[sl.param_offset : sl.param_offset + sl.length]
            assert torch.equal(shard[sl.shard_offset : sl.shard_offset + sl.length], want)


def test_collectives_on_the_loopback_communicator() -> None:
    fs = FlatShard(SHAPES, 3, 1)
    comm = LoopbackCommunicator(world_size=3, rank=1)
    shard = torch.arange(fs.shard_numel, dtype=torch.float32)
    full = comm.all_gather_into(fs.new_buffer(torch.float32), shard)
    assert torch.equal(full, shard.repeat(3))  # every (identical) rank contributed this shard
    flat = torch.arange(fs.padded, dtype=torch.float32)
    got = comm.reduce_scatter_into(torch.empty(fs.shard_numel), flat, op="sum")
    assert torch.equal(got, 3 * flat[fs.start : fs.end])  # K identical ranks summed
    assert torch.equal(comm.reduce_scatter_into(torch.empty(fs.shard_numel), flat, op="avg"), flat[fs.start : fs.end])
    assert comm.calls == [
        ("all_gather_into", fs.shard_numel),
        ("reduce_scatter_into", fs.padded),
        ("reduce_scatter_into", fs.padded),
    ]


def test_bad_input_names_the_value() -> None:
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        FlatShard(SHAPES, 0, 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        FlatShard(SHAPES, 2, 2)
    fs = FlatShard(SHAPES, 2, 0)
    with pytest.raises(ValueError, match="expected a flat buffer of 32 elements"):
        fs.views(torch.zeros(31))
    with pytest.raises(ValueError, match="output has 32 elements, expected 2 x 3"):  # a shard of the wrong size
        LoopbackCommunicator(2).all_gather_into(fs.new_buffer(torch.float32), torch.zeros(3))
    with pytest.raises(ValueError, match=r"tensor of shape \(5, 3\) where \(3, 5\) was planned"):
        fs.flatten([torch.zeros(5, 3), torch.zeros(7), torch.zeros(2, 2, 2), torch.zeros(1)])
    with pytest.raises(ValueError, match=r"stage must be one of \[0, 1, 2, 3\].*got 4"):
        zero_memory_bytes(10, 2, 4)


def test_zero_memory_model_matches_the_paper() -> None:
    # ZeRO paper, Figure 1: Psi = 7.5B, N = 64, K = 12 -> 120 GB, 31.4 GB, 16.6 GB, 1.9 GB
    psi, n = 7.5e9, 64
    got = [zero_memory_bytes(int(psi), n, s) / 1e9 for s in (0, 1, 2, 3)]
    assert got == pytest.approx([120.0, 31.40625, 16.640625, 1.875])
