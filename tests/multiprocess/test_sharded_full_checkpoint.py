"""Full checkpoint files of ShardedStrategy (``state_dict_type="full"``, the default at stages 1/2) on 2 and 1
real gloo ranks: the file is what Lightning's ``ddp`` writes, it resumes exactly at any world size and stage,
plain Lightning ``ddp`` and our strategy resume from each other's files, and a save replaces a checkpoint of the
other kind (a file where a sharded directory is, and the other way round).

One spawned group of 2 ranks runs every 2-rank scenario in sequence (:class:`_Sections`), one of 1 rank the
resumes at another world size. The model is ``_lightning_reference.py``'s (an embedding tied to the output head,
a frozen layer, a 0-d parameter; AdamW); ``wrap_policy=["Linear"]`` makes several stage-3 units and ~1 KiB
buckets several stage-1 flat parameters. 24 samples at 2 ranks x batch 6 and 1 rank x batch 12 are the same 2
global batches per epoch (see test_sharded_strategy.py), so a 1-rank run resumed from a 2-rank checkpoint must
continue the 2-rank run. Checkpoints are taken at step 2, an epoch's end: Lightning's own ``ddp`` restarts a
mid-epoch resume at the epoch's first batch (its loader is not stateful), ours does not, and only at an epoch's
end do both continue alike.

Tolerances (reasoned in ``_lightning_reference.py``): a run against the single-process reference, and a ``ddp``
run against ours, ``EQ_TOL`` (1e-5; float32 rounding order of the gradient average). A resume at the same stage
and world size repeats the same float operations on the same values: bitwise. At another stage or world size
the per-rank partial sums differ by rounding only: ``EQ_TOL`` again. A lost or misplaced optimizer-state element
moves the weights by ~1e-3 (the learning rate alone is 1e-2 a step).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _lightning_reference import (
    ENV,
    EQ_TOL,
    _assert_section,
    _check_against,
    _quiet_rank,
    _reference,
    _Sections,
    _state,
    _TiedModule,
    _token_data,
    _trainer,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_sync import ShardedStrategy
from lightning_sync.resume import RANK_STATES
from lightning_sync.sync.zero import consolidate_checkpoint
from lightning_sync.testing import Checks, run_distributed

SAMPLES, K, N = 24, 2, 4  # 2 steps an epoch; checkpoints at step K (an epoch's end) and N
BATCH = {1: 12, 2: 6}  # per rank: the same global batches at both world sizes
WRAP = ["Linear"]
TINY_MB = 0.001


class _Logged(_TiedModule):
    """The tied model (AdamW) with its arguments saved (``load_from_checkpoint`` rebuilds it from them) and its
    loss logged for ModelCheckpoint's ``monitor`` (synced: every rank agrees on the best checkpoint)."""

    def __init__(self, batch: int = BATCH[2]) -> None:
        super().__init__("adamw", _token_data(SAMPLES))
        self.batch = batch
        self.save_hyperparameters()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.ds, batch_size=self.batch, shuffle=True)


def _zero(stage: int, **kw: Any) -> ShardedStrategy:
    """Stage 1 writes full files by default; stage 3 is asked to."""
    full = {} if stage < 3 else {"state_dict_type": "full"}
    return ShardedStrategy(stage=stage, wrap_policy=WRAP, bucket_cap_mb=TINY_MB, **{**full, **kw})


def _saver(dirpath: str | Path) -> ModelCheckpoint:
    return ModelCheckpoint(
        dirpath=dirpath, filename="{step}", every_n_train_steps=K, save_top_k=-1, monitor="train_loss"
    )


def _fit(world: int, strategy: Any, max_steps: int = N, ckpt: Any = None, saver: Any = None) -> tuple[Any, _Logged]:
    module = _Logged(BATCH[world])
    callbacks = [saver] if saver is not None else []
    trainer = _trainer(world, strategy, max_steps=max_steps, callbacks=callbacks, enable_checkpointing=bool(callbacks))
    trainer.fit(module, ckpt_path=ckpt)
    return trainer, module


def _is_root() -> bool:
    return torch.distributed.get_rank() == 0


def _same_optimizer_state(ck: Checks, tag: str, got: dict[str, Any], want: dict[str, Any], **tol: float) -> None:
    """Two plain ``optimizer.state_dict()``: the same hyperparameters, numbering and keys; values within ``tol``."""
    ck.true(f"{tag} param groups", got["param_groups"] == want["param_groups"], (got["param_groups"], want))
    ck.true(f"{tag} parameters with state", list(got["state"]) == list(want["state"]), (got["state"].keys(), want))
    for index, entry in want["state"].items():
        mine = got["state"].get(index, {})
        ck.true(f"{tag} {index} keys", list(mine) == list(entry), (list(mine), list(entry)))
        for key in entry.keys() & mine.keys():
            ck.close(f"{tag} {index} {key}", mine[key], entry[key], **tol)


# --------------------------------------------------------------------------- 2-rank scenarios


def _source(ck: Checks, world: int, tmpdir: str, out: dict[str, Any], trainers: dict[str, Any]) -> None:
    """zero1 with the default state_dict_type: full files at steps 2 and 4, written by rank 0 alone, that plain
    torch and Lightning read, holding the module's state and the unsharded AdamW's state of the reference."""
    ds, dirpath = _token_data(SAMPLES), os.path.join(tmpdir, "zero1")
    init = _state(_Logged(BATCH[world]))
    ref = _reference(_Logged(BATCH[world]), ds, world, N, batch=BATCH[world])
    saver = _saver(dirpath)
    trainers["source"], module = _fit(world, _zero(1), saver=saver)
    final = _state(module)
    out["source"] = {"dir": dirpath, "final": final}
    _check_against(ck, "[source]", module, ref["state"], init)
    names = sorted(os.listdir(dirpath))
    ck.true(
        "[source] two files and nothing else",
        names == ["step=2.ckpt", "step=4.ckpt"] and all(Path(dirpath, n).is_file() for n in names),
        names,
    )
    ck.true("[source] best_model_path is one of them", Path(saver.best_model_path).parent == Path(dirpath))
    if not _is_root():
        return
    saved = torch.load(Path(dirpath, "step=4.ckpt"), weights_only=True)  # plain torch: tensors and plain data
    ck.true("[file] the module's keys, in order", list(saved["state_dict"]) == list(final), list(saved["state_dict"]))
    for name, value in final.items():  # exact: copies of the fp32 masters
        ck.close(f"[file] {name}", saved["state_dict"][name], value)
        ck.true(f"[file] {name} dtype", saved["state_dict"][name].dtype == value.dtype)
    tied = saved["state_dict"]["net.head.weight"].data_ptr() == saved["state_dict"]["net.embed.weight"].data_ptr()
    ck.true("[file] the tied weight is one tensor under both names", tied)
    ck.true(
        "[file] what Lightning and our exact resume keep",
        {"loops", "callbacks", "lr_schedulers", "epoch", "global_step", RANK_STATES} <= set(saved),
        sorted(saved),
    )
    plain = saved["optimizer_states"][0]
    _same_optimizer_state(
        ck, "[file] optimizer state = the reference's", plain, ref["optimizer"].state_dict(), **EQ_TOL
    )
    best = saver.best_model_path
    torch.load(best, weights_only=True)
    model = _Logged.load_from_checkpoint(best)
    ck.true("[best] load_from_checkpoint rebuilds from the hyperparameters", model.batch == BATCH[world])
    for name, value in torch.load(best, weights_only=True)["state_dict"].items():
        ck.close(f"[best] load_from_checkpoint {name}", model.state_dict()[name], value)


def _resume(ck: Checks, world: int, tmpdir: str, out: dict[str, Any]) -> None:
    """From the step-2 file at stage 1 (bitwise: the same operations on the same values) and at stage 3
    (EQ_TOL), which also writes its own step-4 file: the zero1 file's, within EQ_TOL."""
    source = out["source"]
    for stage in (1, 3):
        tag = f"[resume zero{stage}]"
        saver = _saver(os.path.join(tmpdir, f"resumed{stage}"))
        trainer, module = _fit(world, _zero(stage), ckpt=os.path.join(source["dir"], "step=2.ckpt"), saver=saver)
        ck.true(f"{tag} to step {N}", trainer.global_step == N, trainer.global_step)
        tol = {} if stage == 1 else EQ_TOL
        for name, value in _state(module).items():
            ck.close(f"{tag} {name}", value, source["final"][name], **tol)
        if stage == 3 and _is_root():
            mine = torch.load(Path(saver.dirpath, "step=4.ckpt"), weights_only=True)
            theirs = torch.load(Path(source["dir"], "step=4.ckpt"), weights_only=True)
            ck.true("[zero3 file] keys", list(mine["state_dict"]) == list(theirs["state_dict"]))
            for name, value in theirs["state_dict"].items():
                ck.close(f"[zero3 file] {name}", mine["state_dict"][name], value, **EQ_TOL)
            _same_optimizer_state(
                ck, "[zero3 file]", mine["optimizer_states"][0], theirs["optimizer_states"][0], **EQ_TOL
            )


def _ddp(ck: Checks, world: int, tmpdir: str, out: dict[str, Any]) -> None:
    """Lightning's own ddp resumes from our file and continues our run; we resume from its file and continue its."""
    ddp_dir = os.path.join(tmpdir, "ddp")
    _, ddp_module = _fit(world, "ddp", saver=_saver(ddp_dir))
    out["ddp"] = {"dir": ddp_dir, "final": _state(ddp_module)}
    trainer, plain = _fit(world, "ddp", ckpt=os.path.join(out["source"]["dir"], "step=2.ckpt"))
    ck.true("[ddp from ours] to step 4", trainer.global_step == N, trainer.global_step)
    for name, value in _state(plain).items():
        ck.close(f"[ddp from ours] {name}", value, out["source"]["final"][name], **EQ_TOL)
    trainer, zero = _fit(world, _zero(1), ckpt=os.path.join(ddp_dir, "step=2.ckpt"))
    ck.true("[ours from ddp] to step 4", trainer.global_step == N, trainer.global_step)
    for name, value in _state(zero).items():
        ck.close(f"[ours from ddp] {name}", value, out["ddp"]["final"][name], **EQ_TOL)


def _replace(ck: Checks, world: int, tmpdir: str, out: dict[str, Any], trainers: dict[str, Any]) -> None:
    """After fit, trainer.save_checkpoint onto the name of the sharded directory ModelCheckpoint wrote (it raised
    IsADirectoryError), a full file onto it, and a sharded directory onto a file: each replaced, nothing left."""
    dirpath = Path(tmpdir, "sharded")
    trainer, module = _fit(world, ShardedStrategy(stage=3, wrap_policy=WRAP), max_steps=K, saver=_saver(dirpath))
    path, trained = dirpath / "step=2.ckpt", _state(module)
    ck.true("[replace] zero3 wrote a sharded directory", (path / "COMPLETE").is_file(), path)
    trainer.save_checkpoint(path)
    ck.true("[replace] directory by directory", (path / "COMPLETE").is_file() and os.listdir(dirpath) == [path.name])
    for name, value in consolidate_checkpoint(path).items():
        ck.close(f"[replace] directory by directory: {name}", value, trained[name])

    trainers["source"].save_checkpoint(path)  # the zero1 run, after its fit: a full file
    ck.true("[replace] directory by file", path.is_file() and os.listdir(dirpath) == [path.name], os.listdir(dirpath))
    if _is_root():
        saved = torch.load(path, weights_only=True)
        at_end = torch.load(Path(out["source"]["dir"], "step=4.ckpt"), weights_only=True)
        for name, value in out["source"]["final"].items():
            ck.close(f"[replace] the file after fit: {name}", saved["state_dict"][name], value)
        _same_optimizer_state(
            ck, "[replace] after fit, the optimizer state of the shards", saved["optimizer_states"][0],
            at_end["optimizer_states"][0],
        )  # fmt: skip

    trainer.save_checkpoint(path)  # the zero3 run again: a sharded directory where the file is
    ck.true("[replace] file by directory", (path / "COMPLETE").is_file() and os.listdir(dirpath) == [path.name])
    for name, value in consolidate_checkpoint(path).items():
        ck.close(f"[replace] file by directory: {name}", value, trained[name])


def _worker2(rank: int, world: int, tmpdir: str) -> dict[str, Any]:
    _quiet_rank()
    s, trainers = _Sections(), {}
    s.run("source", _source, world, tmpdir, s.extra, trainers)
    if "source" in s.extra:
        s.run("resume", _resume, world, tmpdir, s.extra)
        s.run("ddp", _ddp, world, tmpdir, s.extra)
        s.run("replace", _replace, world, tmpdir, s.extra, trainers)
    return s.result()


# --------------------------------------------------------------------------- 1 rank


def _other_world(ck: Checks, world: int, source: dict[str, Any], ddp: dict[str, Any]) -> None:
    """The 2-rank files at 1 rank: ours at stages 1 and 3, ddp's at stage 3, each continuing its 2-rank run."""
    runs = [(1, source), (3, source), (3, ddp)]
    for stage, run in runs:
        tag = f"[W={world} zero{stage} from the 2-rank {'ddp' if run is ddp else 'zero1'} file]"
        trainer, module = _fit(world, _zero(stage), ckpt=os.path.join(run["dir"], "step=2.ckpt"))
        ck.true(f"{tag} to step {N}", trainer.global_step == N, trainer.global_step)
        for name, value in _state(module).items():
            ck.close(f"{tag} {name}", value, run["final"][name], **EQ_TOL)


def _worker1(rank: int, world: int, source: dict[str, Any], ddp: dict[str, Any]) -> dict[str, Any]:
    _quiet_rank()
    s = _Sections()
    s.run("other world", _other_world, world, source, ddp)
    return s.result()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_worker2, 2, str(tmp_path_factory.mktemp("full")), timeout=240, env=ENV)


@pytest.mark.timeout(300)
def test_a_full_file_is_what_ddp_writes_and_torch_and_lightning_read_it(two_ranks: list[dict[str, Any]]) -> None:
    _assert_section(two_ranks, "source", min_checks=12, same_count=False)  # rank 0 reads the files


@pytest.mark.timeout(300)
def test_a_full_file_resumes_exactly_at_stage_1_and_3(two_ranks: list[dict[str, Any]]) -> None:
    _assert_section(two_ranks, "resume", min_checks=20, same_count=False)


@pytest.mark.timeout(300)
def test_lightning_ddp_and_zero_resume_from_each_others_files(two_ranks: list[dict[str, Any]]) -> None:
    _assert_section(two_ranks, "ddp", min_checks=20)


@pytest.mark.timeout(300)
def test_a_save_after_fit_replaces_a_checkpoint_of_either_kind(two_ranks: list[dict[str, Any]]) -> None:
    _assert_section(two_ranks, "replace", min_checks=20, same_count=False)


@pytest.mark.timeout(300)
def test_2_rank_files_resume_at_1_rank(two_ranks: list[dict[str, Any]]) -> None:
    extra = two_ranks[0]
    assert "source" in extra and "ddp" in extra, "the 2-rank runs failed"
    results = run_distributed(_worker1, 1, extra["source"], extra["ddp"], timeout=180, env=ENV)
    _assert_section(results, "other world", min_checks=30)
