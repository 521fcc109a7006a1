"""AsyncParameterServerStrategy and HogwildStrategy resumed at another world size, on real processes.

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

**hogwild** (forked processes sharing one model). Process r of K' touches only its own rows of a sparse
embedding, weighted by its samples, so no two processes write the same element and every value is a short
dyadic fraction, exact in float32: the resumed run is deterministic. A run of K processes stops mid-epoch at
step 3, holding the global batch of 6 samples; it resumes at K' to the epoch's end (step 6). The documented
mapping: process r < min(K, K') continues its own optimizer state, a process the checkpoint had none for
starts with a fresh one at the checkpoint's learning rate, and the states of processes K'..K-1 are dropped.
Checked in each process at the start (the saved model, that momentum, that learning rate), and at the end
against a single-process replay (tolerance 0) of each process's rows from that start on the samples it
trained; the epoch's samples are each trained once across the two runs, and every live process's rows moved.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _lightning_reference import (
    ENV,
    EQ_TOL,
    MIN_MOVE,
    _IndexedModule,
    _LogLines,
    _quiet_rank,
    _rank_batches,
    _reference,
    _state,
    _TiedModule,
    _token_data,
    _trainer,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sync import AsyncParameterServerStrategy, HogwildStrategy
from lightning_sync.testing import Checks, run_distributed

# --------------------------------------------------------------------------- async_ps

PS_N = 24  # samples: 2 global steps an epoch at a global batch of 12, 3 at one of 8


def _ps_module(batch: int) -> _IndexedModule:
    """SGD with momentum and a per-step StepLR (on the server's global clock); a per-rank batch of ``batch``;
    records the sample indices of each of its steps."""
    return _IndexedModule("sgd", PS_N, batch)


def _ps_first(rank: int, world: int, tmpdir: str, batch: int, steps: int) -> None:
    """The run that stops: ``steps`` global steps (one epoch), its checkpoint written at the last one."""
    _quiet_rank()
    every = ModelCheckpoint(dirpath=tmpdir, filename="{step}", every_n_train_steps=steps, save_top_k=-1)
    strategy = AsyncParameterServerStrategy(max_staleness=0, server_rank=world - 1)
    _trainer(world, strategy, max_steps=steps, callbacks=[every], enable_checkpointing=True).fit(_ps_module(batch))


def _ps_resumed(rank: int, world: int, ckpt: str, batch: int, steps: int) -> dict[str, Any]:
    _quiet_rank()
    lines = _LogLines()
    logging.getLogger("lightning.pytorch").addHandler(lines)
    logging.getLogger("lightning.pytorch").setLevel(logging.INFO)
    module = _ps_module(batch)
    strategy = AsyncParameterServerStrategy(max_staleness=0, server_rank=world - 1)
    _trainer(world, strategy, max_steps=steps).fit(module, ckpt_path=ckpt)
    final = strategy._final["state"] if strategy._final is not None else None  # rank 0: the server's, at the end
    return {"state": _state(module), "seen": module.seen, "server": final, "lines": lines.lines}


def _replay(ckpt: dict[str, Any], world: int, batch: int, steps: int) -> dict[str, torch.Tensor]:
    """The checkpoint's model, optimizer and scheduler stepped ``steps`` times in this process on the next
    epoch's batches of ``world`` ranks (the mean of their gradients: what the server applies at s = 0)."""
    module = _ps_module(batch)
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


# --------------------------------------------------------------------------- hogwild

MAX_PROC, ROWS, DIM, LR, MOMENTUM = 3, 3, 4, 0.5, 0.5
HW_N, HW_GLOBAL, HW_STOP, HW_STEPS = 36, 6, 3, 6  # 6 steps an epoch; stopped mid-epoch
LR_STEP, LR_GAMMA = 2, 0.5  # a per-step StepLR: 0.5, 0.5, 0.25, 0.25, 0.125, 0.125 (dyadic)
HW_SEED = 7
LATE_S = 1.0  # the last process loads the checkpoint, and starts, this late: the others must wait for it


def _initial() -> torch.Tensor:
    return torch.arange(MAX_PROC * ROWS * DIM, dtype=torch.float32).view(MAX_PROC * ROWS, DIM)


def _weight(sample: int) -> float:
    return float(sample % 4 + 1)


def _rows(process: int) -> slice:
    return slice(process * ROWS, (process + 1) * ROWS)


class _OwnRows(pl.LightningModule):
    """Process r's loss is ``sum_s w(s) * sum(rows of r)`` over its batch; each process reports its samples,
    and its model, momentum and learning rate at the start and the end of training."""

    def __init__(self, tmpdir: str, tag: str, batch: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(MAX_PROC * ROWS, DIM, sparse=True)
        with torch.no_grad():
            self.emb.weight.copy_(_initial())
        self.tmpdir, self.tag, self.batch = tmpdir, tag, batch
        self.seen: list[list[int]] = []
        self.start: dict[str, Any] = {}

    def _now(self) -> dict[str, Any]:
        optimizer = self.trainer.optimizers[0]
        buf = optimizer.state.get(self.emb.weight, {}).get("momentum_buffer")
        return {
            "model": self.emb.weight.detach().reshape(-1).tolist(),
            "momentum": None if buf is None else buf.to_dense().reshape(-1).tolist(),
            "lr": optimizer.param_groups[0]["lr"],
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # the shared model is loaded by every process: one that loads late must not overwrite updates the
        # others made meanwhile (the strategy holds them until all have loaded)
        self._late()

    def on_train_start(self) -> None:
        # what a process sees at the start of training is the loaded model, whatever its peers' pace
        self._late()
        self.start = self._now()

    def _late(self) -> None:
        if self.global_rank == self.trainer.world_size - 1:
            time.sleep(LATE_S)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (samples,) = batch
        self.seen.append(samples.tolist())
        weight = sum(_weight(int(s)) for s in samples)
        return weight * self.emb(torch.arange(ROWS) + self.global_rank * ROWS).sum()

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=LR_STEP, gamma=LR_GAMMA)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.arange(HW_N)), batch_size=self.batch, shuffle=True)

    def on_train_end(self) -> None:
        self.trainer.strategy.barrier()  # every process's last update has landed in the shared model
        report = {"seen": self.seen, "start": self.start, "end": self._now()}
        with open(os.path.join(self.tmpdir, f"{self.tag}-rank{self.global_rank}.json"), "w") as f:
            json.dump(report, f)


def _hw_fit(rank: int, world: int, tmpdir: str, tag: str, processes: int, resume: bool) -> list[dict[str, Any]]:
    """One Hogwild fit in this driver (the processes rendezvous through the harness's store: one fit each)."""
    ckpt = Path(tmpdir) / "checkpoints" / f"epoch=0-step={HW_STOP}.ckpt"
    callbacks = [] if resume else [ModelCheckpoint(dirpath=ckpt.parent, every_n_train_steps=HW_STOP, save_top_k=-1)]
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=HogwildStrategy(num_processes=processes, oversubscribe=True),  # 3 processes on 2 cores
        max_steps=HW_STEPS if resume else HW_STOP,
        callbacks=callbacks,
        default_root_dir=tmpdir,
        enable_checkpointing=not resume,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_OwnRows(tmpdir, tag, HW_GLOBAL // processes), ckpt_path=ckpt if resume else None)
    reports = []
    for r in range(processes):
        with open(os.path.join(tmpdir, f"{tag}-rank{r}.json")) as f:
            reports.append(json.load(f))
    return reports


def _lr(step: int) -> float:
    return LR * LR_GAMMA ** (step // LR_STEP)


def _hw_replay(start: torch.Tensor, momenta: list[torch.Tensor | None], seen: list[list[list[int]]]) -> torch.Tensor:
    """Each process's rows stepped by SGD with momentum from ``momenta[r]`` (None: fresh) on its samples, steps
    ``HW_STOP`` to ``HW_STEPS``: the processes write disjoint rows, so their order does not matter."""
    weight = start.clone()
    for r, (momentum, batches) in enumerate(zip(momenta, seen)):
        rows = _rows(r)
        buf = None if momentum is None else momentum[rows].clone()
        for step, samples in enumerate(batches, start=HW_STOP):
            grad = torch.full((ROWS, DIM), sum(_weight(s) for s in samples))
            buf = grad if buf is None else MOMENTUM * buf + grad
            weight[rows] -= _lr(step) * buf
    return weight


def _as_weight(values: list[float]) -> torch.Tensor:
    return torch.tensor(values).view(MAX_PROC * ROWS, DIM)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 2)])
def test_hogwild_resumes_at_another_number_of_processes(tmp_path: Path, before: int, after: int) -> None:
    env = {"PL_GLOBAL_SEED": str(HW_SEED)}
    first, resumed = (
        run_distributed(_hw_fit, 1, str(tmp_path), tag, n, tag == "resumed", timeout=60, process_group=False, env=env)[
            0
        ]
        for tag, n in (("first", before), ("resumed", after))
    )
    saved = torch.load(
        tmp_path / "checkpoints" / f"epoch=0-step={HW_STOP}.ckpt", map_location="cpu", weights_only=True
    )["state_dict"]["emb.weight"]
    # tolerance 0 throughout: disjoint rows, dyadic values exact in fp32
    assert saved.reshape(-1).tolist() == first[0]["end"]["model"], "the checkpoint holds the shared model"
    momenta: list[torch.Tensor | None] = []
    for r, report in enumerate(resumed):
        start = report["start"]
        assert start["model"] == first[0]["end"]["model"], f"process {r} resumes from the saved model"
        assert start["lr"] == _lr(HW_STOP), f"process {r} resumes at the scheduled learning rate"
        if r < before:
            assert first[r]["end"]["momentum"] is not None
            assert start["momentum"] == first[r]["end"]["momentum"], f"process {r} continues its own momentum"
        else:
            assert start["momentum"] is None, f"process {r}, new, starts with a fresh optimizer state"
        momenta.append(None if start["momentum"] is None else _as_weight(start["momentum"]))
    trained = sorted(s for report in first + resumed for batch in report["seen"] for s in batch)
    assert trained == list(range(HW_N)), "the epoch's samples are each trained once across the two runs"
    assert all(len(report["seen"]) == HW_STEPS - HW_STOP for report in resumed)
    end = _as_weight(resumed[0]["end"]["model"])
    assert torch.equal(end, _hw_replay(saved, momenta, [report["seen"] for report in resumed])), (
        "each process's rows moved as SGD from its mapped state on its samples (and a dropped process's stayed)"
    )
    for r in range(after):
        assert (end[_rows(r)] - saved[_rows(r)]).abs().min() > 0, f"process {r}'s rows moved"
