"""Checkpoints our strategies write through Lightning (model, optimizer, loops, ModelCheckpoint state and
the "lightning_sync/..." state: PowerSGD error feedback gathered from every rank, local SGD's schedule,
DiLoCo's outer optimizer, ZeRO shards) resume on 2 gloo ranks with ``trainer.fit(ckpt_path=...)``'s
default, which our strategies read as ``weights_only=True``. A checkpoint carrying a pickle payload is
refused by name in the same ``fit`` call and its payload never runs; ``weights_only=False`` opts in.

The asynchronous parameter server and Hogwild resume from checkpoints in their own tests
(test_async_ps.py, test_hogwild.py), by the same default.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from _lightning_reference import ENV, _quiet_rank, _TiedModule, _trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sync import BucketedDDPStrategy, DiLoCoStrategy, LocalSGDStrategy, ShardedStrategy
from lightning_sync.checkpoint.reading import UntrustedCheckpointError
from lightning_sync.diagnostics.faults import UnpicklePayload
from lightning_sync.sync import consolidate_checkpoint
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

_STRATEGIES = {
    "bucketed_ddp": lambda: BucketedDDPStrategy(compression="powersgd", powersgd_rank=1, powersgd_warmup_steps=0),
    "local_sgd": lambda: LocalSGDStrategy(sync_every=3),
    "diloco": lambda: DiLoCoStrategy(sync_every=1),
    "zero2": lambda: ShardedStrategy(stage=2, state_dict_type="sharded"),  # the shards (one file by default)
}


class Extra:
    """A class of ours in a checkpoint: weights-only loading refuses it; the opt-in loads it."""


def _worker(rank: int, world: int, tmpdir: str) -> tuple[list[str], int]:
    _quiet_rank()
    ck = Checks()
    for name, make in _STRATEGIES.items():
        every2 = ModelCheckpoint(dirpath=tmpdir, filename=name, every_n_train_steps=2, save_top_k=-1)
        _trainer(world, make(), max_steps=2, callbacks=[every2], enable_checkpointing=True).fit(_TiedModule("adamw"))
        path = os.path.join(tmpdir, f"{name}.ckpt")
        if rank == 0:
            if os.path.isdir(path):  # ZeRO: a directory; Lightning's state next to the shards
                torch.load(os.path.join(path, "lightning.pt"), weights_only=True)
                ck.true(f"[{name}] consolidates weights-only", len(consolidate_checkpoint(path)) > 0)
            else:
                saved = torch.load(path, map_location="cpu", weights_only=True)
                ck.true(
                    f"[{name}] our state is in the file",
                    any(k.startswith("lightning_sync/") for k in saved),
                    sorted(saved),
                )
        trainer = _trainer(world, make(), max_steps=3)
        trainer.fit(_TiedModule("adamw"), ckpt_path=path)  # weights_only not given: read as True
        ck.true(f"[{name}] resumed from step 2 to step 3", trainer.global_step == 3, trainer.global_step)

    # a checkpoint with a payload, through trainer.fit: refused by name on every rank, nothing runs
    hostile, marker = os.path.join(tmpdir, "hostile.ckpt"), os.path.join(tmpdir, "MARKER")
    extra = os.path.join(tmpdir, "extra.ckpt")
    if rank == 0:
        good = torch.load(os.path.join(tmpdir, "bucketed_ddp.ckpt"), weights_only=True)
        torch.save({**good, "payload": UnpicklePayload(marker)}, hostile)
        torch.save({**good, "extra": Extra()}, extra)
    torch.distributed.barrier()
    for path, offending in ((hostile, f"{os.system.__module__}.system"), (extra, f"{__name__}.Extra")):
        try:
            _trainer(world, _STRATEGIES["bucketed_ddp"](), max_steps=3).fit(_TiedModule("adamw"), ckpt_path=path)
            ck.true(f"[refuse] {os.path.basename(path)} refused", False, "it loaded")
        except UntrustedCheckpointError as error:
            ck.true(
                f"[refuse] {os.path.basename(path)} refused by name",
                path in str(error) and offending in str(error) and "weights_only=False" in str(error),
                str(error),
            )
    ck.true("[refuse] the payload never ran", not os.path.exists(marker))
    trainer = _trainer(world, _STRATEGIES["bucketed_ddp"](), max_steps=3)
    trainer.fit(_TiedModule("adamw"), ckpt_path=extra, weights_only=False)  # the explicit opt-in
    ck.true("[opt-in] weights_only=False resumes", trainer.global_step == 3, trainer.global_step)
    return ck.failures, ck.count


@pytest.mark.timeout(180)  # the ranks' work takes about 1 s; starting two spawned ranks most of the rest
def test_our_checkpoints_resume_weights_only_and_payloads_are_refused(tmp_path: Path) -> None:
    results = run_distributed(_worker, 2, str(tmp_path), timeout=150, env=ENV)
    assert_all_ranks_passed(results, min_checks=8, same_count=False)  # rank 0 also reads the files itself
