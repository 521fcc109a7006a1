"""AsyncParameterServerStrategy resumed at another world size, on real processes.

**async_ps** (over RPC, no process group). A run at K ranks stops at an epoch's end (a checkpoint of its last
step, ``every_n_train_steps``); it resumes at K' ranks with the server on another rank (the last one, both
times), at ``max_staleness=0``, where the parameter server is synchronous SGD step for step, so the resumed
run is deterministic:

* 3 -> 2 ranks, 4 samples per rank (the epoch grows from 2 to 3 steps): every rank trains the next epoch's
  batches of 2 ranks, from its first batch to its last, and the weights equal a single-process replay of
  those steps from the checkpoint's model, optimizer and scheduler within ``EQ_TOL``;
* 2 -> 3 ranks holding the global batch (6 then 4 samples per rank): the weights equal the uninterrupted
  single-process run's within ``EQ_TOL``, the same global batches being averaged in another grouping.

Both check that the server's version, global clock and staleness histogram continue from the checkpoint's,
its pushes count on at K' per global step, and the pushes per worker start again, said in a log line.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from _lightning_reference import (
    ENV,
    EQ_TOL,
    MIN_MOVE,
    _quiet_rank,
    _rank_batches,
    _reference,
    _state,
    _TiedModule,
    _token_data,
    _trainer,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_sync import AsyncParameterServerStrategy
from lightning_sync.testing import Checks, run_distributed

# --------------------------------------------------------------------------- async_ps

PS_N = 24  # samples: 2 global steps an epoch at a global batch of 12, 3 at one of 8


class _PSModule(_TiedModule):
    """SGD with momentum and a per-step StepLR (on the server's global clock); a per-rank batch of ``batch``;
    records the sample indices of each of its steps."""

    def __init__(self, batch: int) -> None:
        super().__init__("sgd", _token_data(PS_N), scheduler=True)
        ids, y = self.ds.tensors
        self.indexed = TensorDataset(ids, y, torch.arange(len(y)))
        self.batch = batch
        self.seen: list[list[int]] = []

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        ids, y, idx = batch
        self.seen.append(idx.tolist())
        return super().training_step((ids, y), batch_idx)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.indexed, batch_size=self.batch, shuffle=True)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _ps_first(rank: int, world: int, tmpdir: str, batch: int, steps: int) -> None:
    """The run that stops: ``steps`` global steps (one epoch), its checkpoint written at the last one."""
    _quiet_rank()
    every = ModelCheckpoint(dirpath=tmpdir, filename="{step}", every_n_train_steps=steps, save_top_k=-1)
    strategy = AsyncParameterServerStrategy(max_staleness=0, server_rank=world - 1)
    _trainer(world, strategy, max_steps=steps, callbacks=[every], enable_checkpointing=True).fit(_PSModule(batch))


def _ps_resumed(rank: int, world: int, ckpt: str, batch: int, steps: int) -> dict[str, Any]:
    _quiet_rank()
    lines = _Lines()
    logging.getLogger("lightning.pytorch").addHandler(lines)
    logging.getLogger("lightning.pytorch").setLevel(logging.INFO)
    module = _PSModule(batch)
    strategy = AsyncParameterServerStrategy(max_staleness=0, server_rank=world - 1)
    _trainer(world, strategy, max_steps=steps).fit(module, ckpt_path=ckpt)
    final = strategy._final["state"] if strategy._final is not None else None  # rank 0: the server's, at the end
    return {"state": _state(module), "seen": module.seen, "server": final, "lines": lines.lines}


def _replay(ckpt: dict[str, Any], world: int, batch: int, steps: int) -> dict[str, torch.Tensor]:
    """The checkpoint's model, optimizer and scheduler stepped ``steps`` times in this process on the next
    epoch's batches of ``world`` ranks (the mean of their gradients: what the server applies at s = 0)."""
    module = _PSModule(batch)
    module.load_state_dict(ckpt["state_dict"])
    configured = module.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    optimizer.load_state_dict(ckpt["optimizer_states"][0])
    scheduler.load_state_dict(ckpt["lr_schedulers"][0])
    x, y = module.ds.tensors
    batches = _rank_batches(PS_N, world, epoch=1, batch=batch)
    for i in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for r in range(world):
            idx = batches[r][i]
            (module.training_step((x[idx], y[idx], torch.tensor(idx)), i) / world).backward()
        optimizer.step()
        scheduler.step()
    return _state(module)


PS_CASES = {
    # K, per-rank batch at K, K', per-rank batch at K'
    "3->2 ranks, 4 samples per rank": (3, 4, 2, 4),
    "2->3 ranks, global batch 12 held": (2, 6, 3, 4),
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", list(PS_CASES))
def test_async_ps_resumes_at_another_world_size(tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)  # the reference's samplers are seeded as the ranks' are
    k, batch, k2, batch2 = PS_CASES[case]
    saved_steps = PS_N // (k * batch)  # one epoch
    steps_after = PS_N // (k2 * batch2)  # the next epoch
    run_distributed(_ps_first, k, str(tmp_path), batch, saved_steps, timeout=60, env=ENV, process_group=False)
    path = str(tmp_path / f"step={saved_steps}.ckpt")
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    saved = ckpt["lightning_sync/async_ps"]
    total = saved_steps + steps_after
    ranks = run_distributed(_ps_resumed, k2, path, batch2, total, timeout=60, env=ENV, process_group=False)

    ck = Checks()
    expected = _rank_batches(PS_N, k2, epoch=1, batch=batch2)
    for r, out in enumerate(ranks):
        ck.true(f"rank {r} trains the next epoch's batches of {k2} ranks", out["seen"] == expected[r], out["seen"])
    if batch2 * k2 == batch * k:  # the same global batches: the uninterrupted run is the reference
        whole = _TiedModule("sgd", _token_data(PS_N), scheduler=True)
        ref = _reference(whole, whole.ds, k, total, batch=batch)["state"]
    else:
        ref = _replay(ckpt, k2, batch2, steps_after)
    for r, out in enumerate(ranks):  # measured: 0 (3 -> 2, the replay's order), 3e-8 (2 -> 3, another order)
        for name, value in out["state"].items():
            ck.close(f"rank {r}: {name}", value, ref[name], **EQ_TOL)
    moved = max((ref[n] - ckpt["state_dict"][n]).abs().max().item() for n in ref)
    ck.true("the weights moved after the resume", moved > MIN_MOVE, moved)
    server = ranks[0]["server"]
    want = {
        "version": saved["version"] + steps_after,  # s = 0: one version per global step
        "global_step": total,
        "pushes": total * k2,
        "discarded": 0,
        "staleness": {0: saved["staleness"][0] + steps_after * k2},
        "pushes_by_worker": [steps_after] * k2,  # counted again from the resume
        "num_workers": k2,
    }
    ck.true("the server's counters continue", server == want, (server, want))
    said = [line for line in ranks[0]["lines"] if "pushes per worker" in line]
    ck.true("rank 0 says the pushes per worker start again", len(said) == 1 and str(k) in said[0], ranks[0]["lines"])
    assert not ck.failures, f"{len(ck.failures)} of {ck.count} checks failed:\n" + "\n".join(ck.failures)
