"""The same job as a Slurm test's, on local ranks started from the harness's preloaded forkserver."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from support.cli_ranks import run, weights


@dataclass(frozen=True)
class LocalRun:
    text: str  # rank 0's output
    weights: dict[str, torch.Tensor]  # the final weights (saved before the final validation)


class LocalRuns:
    """``lightning-sync train <overrides>`` on N local ranks, each distinct run once per session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[tuple[int, tuple[str, ...]], LocalRun] = {}

    def run(self, ranks: int, overrides: Sequence[str]) -> LocalRun:
        key = (ranks, tuple(overrides))
        if key not in self._done:
            run_dir = self.root / f"local{len(self._done)}"
            texts = run(ranks, run_dir, [*overrides, "final_validate=true"])
            self._done[key] = LocalRun(texts[0], weights(run_dir / "final.ckpt"))
        return self._done[key]
