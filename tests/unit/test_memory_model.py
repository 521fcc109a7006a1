"""The memory model (``lightning_sync/bench/memory_model.py``) on a tiny model whose bytes are counted by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_sync.bench.memory_model import ModelMemory, Prediction, describe, predict

__all__: list[str] = []

B, D = 2, 4  # batch, width: one (B, D) float32 activation is 32 bytes
ACT = B * D * 4


class _Unit(nn.Module):
    """Linear(D, 4D) -> tanh -> Linear(4D, D) -> tanh, no biases: 8 D^2 = 128 parameters, 512 bytes.

    Saved for backward: the input (first matmul), the first tanh's output (its own backward, and the second
    matmul's input: one storage), the second tanh's output: 1 + 4 + 1 activations of (B, D)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 4 * D, bias=False)
        self.down = nn.Linear(4 * D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.down(torch.tanh(self.up(x))))


class _Tiny(nn.Module):
    """Two units and a head of D parameters outside them, registered twice (a tied weight counts once)."""

    def __init__(self) -> None:
        super().__init__()
        self.units = nn.ModuleList([_Unit(), _Unit()])
        self.head = nn.Linear(D, 1, bias=False)
        self.same_head = self.head
        self.frozen = nn.Linear(D, D, bias=False).requires_grad_(False)  # not trainable: not counted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.units:
            x = unit(x)
        return self.head(x).sum()  # the head saves the second unit's output (already counted); sum saves nothing


def _described() -> ModelMemory:
    torch.manual_seed(0)
    model, x = _Tiny(), torch.randn(B, D)
    return describe(model, lambda: model(x), lambda m: isinstance(m, _Unit), optimizer_factor=2.0)


def test_describe_counts_parameters_units_and_saved_activations_by_hand() -> None:
    m = _described()
    assert m.param_bytes == 2 * 512 + 4 * 4  # two units and the head, once; the frozen layer not at all
    assert m.unit_bytes == (512, 512) and m.largest_unit == 512 and m.root_bytes == 16
    # unit 0 saves its input x, the 4-wide tanh and its output (6 ACT); unit 1 its 4-wide tanh and its output
    # (its input is unit 0's output, saved already: 5 ACT); the head's input is unit 1's output (0)
    assert m.activation_bytes == 11 * ACT
    # checkpointed: each unit keeps its input (2 ACT) and one unit's own activations are recomputed at a time
    # (the larger, 6 ACT)
    assert m.checkpointed_bytes == 8 * ACT


def test_predict_each_row_by_hand() -> None:
    m = _described()
    p, u, r, a = 1040, 512, 16, 11 * ACT
    assert predict(m, "ddp", 2) == Prediction(params=p, grads=p, optimizer=2 * p, gathered=0, activations=a)
    zero3 = predict(m, "zero3", 2)
    assert zero3 == Prediction(params=p / 2, grads=u, optimizer=p, gathered=2 * u + r, activations=a)
    assert zero3.total == 520 + 512 + 1040 + 1040 + a
    assert predict(m, "fsdp2", 2) == zero3
    offload = predict(m, "zero3", 2, offload=True)
    assert (offload.params, offload.grads) == (3 * p / 2, p / 2 + u) and offload.optimizer == p
    assert predict(m, "zero3", 2, checkpointing=True).activations == 8 * ACT
    assert predict(m, "zero3", 4).params == p / 4  # the shards scale with the ranks, the gathered units do not
    assert predict(m, "zero3", 4).gathered == zero3.gathered
    # the two 512-byte units fit one 1024-byte group: gathered together, so that is the size gathered twice
    grouped = predict(m, "zero3", 2, coalesce_bytes=1024)
    assert (grouped.grads, grouped.gathered) == (2 * u, 4 * u + r)
    assert predict(m, "zero3", 2, coalesce_bytes=1023) == zero3  # one byte short: each unit alone


def test_predict_rejects_bad_arguments() -> None:
    m = _described()
    with pytest.raises(ValueError, match=r"kind must be one of \('ddp', 'zero3', 'fsdp2'\), got 'zero2'"):
        predict(m, "zero2", 2)
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        predict(m, "ddp", 0)
    with pytest.raises(ValueError, match="ZeRO-3 options, got them for kind 'fsdp2'"):
        predict(m, "fsdp2", 2, offload=True)
