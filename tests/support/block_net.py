"""A model of residual blocks with dropout, and the steps the ZeRO offload and activation-checkpointing tests
train it for (one process, gloo ranks and CUDA alike), with the single-process reference that draws the same
dropout masks.

Each micro-step, rank r seeds the global random generator with :func:`dropout_seed` (step, micro-step, r) before
its forward on its rows of the global batch; the reference, one process, seeds the same way before each rank's
rows in turn, so every dropout mask is the one that rank drew, and backpropagates each rank's mean loss divided
by the ranks and the accumulation (the mean of the ranks' mean gradients, which the engine's averaging
reduce-scatter computes).

:class:`BlockLM` and :class:`TokenData` are the model and data for a Lightning fit (the bench's memory table's
tests build them by their dotted names; the model holds no torchmetrics states).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

__all__ = [
    "BATCH",
    "Block",
    "BlockLM",
    "BlockNet",
    "TokenData",
    "batches",
    "dropout_seed",
    "make_net",
    "reference",
    "rows",
    "sharded_steps",
    "state",
]

VOCAB, DIM, HIDDEN, SEQ = 23, 11, 20, 6
BATCH = 8  # global batch: 2 or 4 ranks take equal rows


class Block(nn.Module):
    """Pre-norm residual MLP block with dropout; counts the times its forward runs (recomputations too)."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN, dropout: float = 0.1) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.fc2(self.drop(F.gelu(self.fc1(self.ln(x)))))


class BlockNet(nn.Module):
    """Embedding, ``depth`` blocks, mean over the sequence, a head, and a root-level scale (a parameter no
    wrapped submodule owns). Logits per sequence: ``(batch, vocab)``."""

    def __init__(
        self, vocab: int = VOCAB, dim: int = DIM, hidden: int = HIDDEN, depth: int = 2, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden, dropout) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)
        self.scale = nn.Parameter(torch.ones(()))

    def reset_parameters(self) -> None:
        """Its own parameter (the layers reset theirs): what deferred initialization calls."""
        nn.init.ones_(self.scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(1)) * self.scale


def make_net(seed: int = 0, **kw: Any) -> BlockNet:
    torch.manual_seed(seed)
    return BlockNet(**kw)


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def batches(n: int, seed: int = 1, vocab: int = VOCAB) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, vocab, (BATCH, SEQ), generator=g), torch.randint(0, vocab, (BATCH,), generator=g))
        for _ in range(n)
    ]


def rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per : (rank + 1) * per]


def dropout_seed(step: int, micro: int, rank: int) -> int:
    return 1000 + 100 * step + 10 * micro + rank


def sharded_steps(
    engine: Any,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    rank: int,
    world: int,
    accum: int = 1,
    clip: float | None = None,
    device: torch.device | str = "cpu",
    first_step: int = 0,
) -> list[float]:
    """Train on this rank's rows: ``accum`` micro-steps per step (all but the last under ``no_sync``), each
    backpropagating its mean loss / accum; global-norm clipping to ``clip``; the dropout seeds of steps
    ``first_step, first_step + 1, ...``. Returns the pre-clip norms."""
    norms = []
    for step, start in enumerate(range(0, len(data), accum), start=first_step):
        opt.zero_grad()
        for micro in range(accum):
            x, y = (rows(t, rank, world).to(device) for t in data[start + micro])
            torch.manual_seed(dropout_seed(step, micro, rank))
            with engine.no_sync() if micro < accum - 1 else nullcontext():
                (F.cross_entropy(model(x), y) / accum).backward()
        if clip is not None:
            norms.append(float(engine.clip_grad_norm_(clip)))
        opt.step()
    return norms


def reference(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    world: int,
    accum: int = 1,
    clip: float | None = None,
    device: torch.device | str = "cpu",
) -> list[float]:
    """The same steps in one process (see the module docstring); returns the pre-clip norms."""
    norms = []
    for step, start in enumerate(range(0, len(data), accum)):
        opt.zero_grad()
        for micro in range(accum):
            for rank in range(world):
                x, y = (rows(t, rank, world).to(device) for t in data[start + micro])
                torch.manual_seed(dropout_seed(step, micro, rank))
                (F.cross_entropy(model(x), y) / (accum * world)).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return norms


class BlockLM(pl.LightningModule):
    """:class:`BlockNet` as a LightningModule: cross-entropy of the sequence's label, AdamW."""

    def __init__(self, **kw: Any) -> None:
        super().__init__()
        self.net = BlockNet(**kw)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, y = batch
        return F.cross_entropy(self.net(ids), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class TokenData(pl.LightningDataModule):
    """``n`` random token sequences and labels of :data:`VOCAB` symbols, ``batch_size`` a rank."""

    def __init__(self, n: int = 64, batch_size: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ds = TensorDataset(
            torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n,), generator=g)
        )
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.ds, batch_size=self.batch_size, shuffle=True)
