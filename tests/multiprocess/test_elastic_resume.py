"""Elastic resume on real gloo ranks: one run of 12 optimizer steps with a global batch of 48 samples, trained
4 steps at world 2 (8 per rank x 2 ranks x accumulate 3), continued from its checkpoint for 4 steps at world 3
(8 x 3 x 2), then for 4 more at world 1 (8 x 1 x 6).

Every global batch must hold exactly the samples of the same step of an uninterrupted world-2 run, and the
final weights must equal the single-process reference of that run (the same global batches, averaged the same
way) within the tolerance below, for bucketed DDP and ZeRO-3, SGD with momentum and AdamW, a per-step LR
schedule, tied and frozen parameters. The world-3 part crosses an epoch boundary (288 samples: 6 steps per
epoch), and the AdamW runs load with two DataLoader workers.

The CLI does the same with ``batch.global_size`` and ``batch.per_device``: the same command, relaunched in the
same run directory with another ``trainer.num_nodes`` and ``ckpt_path=last``, derives the accumulation again
and ends where an uninterrupted run does.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from _lightning_reference import (
    ENV,
    MIN_MOVE,
    _IndexedModule,
    _quiet_rank,
    _rank_batches,
    _reference,
    _state,
    _TiedModule,
    _token_data,
    _trainer,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from support.cli_ranks import run as cli_run
from support.cli_ranks import weights
from torch.utils.data import TensorDataset

from lightning_sync import BucketedDDPStrategy, ShardedStrategy
from lightning_sync.resume import POSITIONS
from lightning_sync.sync.zero.format import LIGHTNING_STATE
from lightning_sync.testing import run_distributed

N, BATCH, GLOBAL = 288, 8, 48
#: (world size, the global step it trains to): each part resumes from the checkpoint the one before wrote.
PARTS = ((2, 4), (3, 8), (1, 12))
#: Final weights against the reference. The same samples per step, but summed in another order (per rank and
#: micro-batch, then across ranks), so float32 rounding differs: measured here 6e-8 (SGD) and 1.2e-7 (AdamW,
#: whose division by sqrt(v) magnifies rounding in the first steps) after 12 steps; the bounds leave room for
#: other CPUs' kernels.
TOL = {"sgd": 2e-5, "adamw": 5e-5}
LOADER = {"sgd": {}, "adamw": {"num_workers": 2}}
STRATEGIES = ("bucketed_ddp", "zero3")


def _make(strategy: str) -> Any:
    if strategy == "bucketed_ddp":
        return BucketedDDPStrategy(bucket_cap_mb=0.001)  # several buckets
    return ShardedStrategy(stage=3, bucket_cap_mb=0.001)


def _recorded(optimizer: str) -> _IndexedModule:
    """The run's module: batches of ``BATCH`` that carry their sample indices, recorded per micro-batch."""
    return _IndexedModule(optimizer, N, BATCH, **LOADER[optimizer])


def _data() -> TensorDataset:
    return _token_data(N)


def _checkpoints(tmpdir: str, strategy: str, optimizer: str, world: int) -> Path:
    return Path(tmpdir) / strategy / optimizer / f"world{world}"


def _part(rank: int, world: int, tmpdir: str, steps: int, previous: tuple[int, int] | None) -> dict[str, Any]:
    """Every strategy and optimizer trains to global step ``steps`` at this world size, from the checkpoint
    the part before wrote (``previous``: its world size and last step; None: from the start). Returns, per
    run, this rank's sample indices of every micro-batch, and on rank 0 the final weights."""
    _quiet_rank()
    out = {}
    if previous is not None and world == 3:
        _refused(tmpdir, previous)
    for strategy in STRATEGIES:
        for optimizer in TOL:
            ckpt = None
            if previous is not None:
                # a resumed ModelCheckpoint writes the resumed step again (its last save is not restored)
                (ckpt,) = _checkpoints(tmpdir, strategy, optimizer, previous[0]).glob(f"*-step={previous[1]}.ckpt")
            saver = ModelCheckpoint(
                dirpath=_checkpoints(tmpdir, strategy, optimizer, world), every_n_train_steps=4, save_top_k=-1
            )
            module = _recorded(optimizer)
            trainer = _trainer(
                world,
                _make(strategy),
                max_steps=steps,
                accumulate_grad_batches=GLOBAL // (BATCH * world),
                callbacks=[saver],
                enable_checkpointing=True,
            )
            trainer.fit(module, ckpt_path=ckpt)
            assert trainer.global_step == steps, (strategy, optimizer, trainer.global_step)
            if rank == 0:
                _check_positions(_checkpoints(tmpdir, strategy, optimizer, world))
            out[f"{strategy}/{optimizer}"] = (module.seen, _state(module) if rank == 0 else None)
    return out


def _refused(tmpdir: str, previous: tuple[int, int]) -> None:
    """A resume that would change the global batch (48 -> 8 x 3 x 1 = 24) is refused before any step,
    naming both shapes and the accumulation that keeps 48."""
    (ckpt,) = _checkpoints(tmpdir, "bucketed_ddp", "sgd", previous[0]).glob(f"*-step={previous[1]}.ckpt")
    module = _recorded("sgd")
    trainer = _trainer(3, _make("bucketed_ddp"), max_steps=previous[1] + 1, accumulate_grad_batches=1)
    with pytest.raises(ValueError) as refusal:
        trainer.fit(module, ckpt_path=ckpt)
    message = str(refusal.value)
    for said in ("world 2 x batch 8 (global batch 48)", "world 3 x batch 8 (global batch 24)", "accumulate 2"):
        assert said in message, (said, message)
    assert module.seen == [], "a step ran before the refusal"


def _check_positions(directory: Path) -> None:
    """Every checkpoint's data position is its last optimizer step's: whole global batches into its epoch.
    Resumed with accumulation, Lightning's ModelCheckpoint saves again at the resumed step after the first
    micro-batch (it does not restore its last saved step); that window's gradients are not in the file, so
    its samples must not count as trained."""
    saved = sorted(directory.glob("*.ckpt"))
    assert saved, directory
    for path in saved:
        file = path / LIGHTNING_STATE if path.is_dir() else path  # ZeRO's sharded directory: Lightning's part
        ckpt = torch.load(file, map_location="cpu", weights_only=True)
        (state,) = ckpt[POSITIONS]
        into_epoch = ckpt["global_step"] - state["epoch"] * (N // GLOBAL)
        assert state["position"] == into_epoch * GLOBAL, (path.name, state, ckpt["global_step"])


def _global_batches(seen: list[list[list[int]]], world: int) -> list[list[int]]:
    """Each optimizer step's samples over all ranks and micro-batches (``seen[rank][micro-batch]``), sorted."""
    accumulate = GLOBAL // (BATCH * world)
    steps = len(seen[0]) // accumulate
    return [
        sorted(i for ranks in seen for micro in ranks[s * accumulate : (s + 1) * accumulate] for i in micro)
        for s in range(steps)
    ]


def _reference_batches(steps: int) -> list[list[int]]:
    """The uninterrupted world-2 run's global batches (8 per rank x 2 x accumulate 3), from Lightning's own
    DistributedSampler order (an epoch is 36 batches per rank: 12 steps cover two epochs of 6 steps)."""
    out: list[list[int]] = []
    for epoch in range(2):
        ranks = _rank_batches(N, 2, epoch, BATCH)
        for s in range(len(ranks[0]) // 3):
            out.append(sorted(i for r in ranks for micro in r[3 * s : 3 * s + 3] for i in micro))
    return out[:steps]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_at_another_world_size_keeps_the_global_batches_and_ends_with_the_same_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches: dict[str, list[list[int]]] = {}
    final: dict[str, dict[str, torch.Tensor]] = {}
    previous = None
    for world, steps in PARTS:
        results = _run_part(world, str(tmp_path), steps, previous)
        for key in results[0]:
            seen = [r[key][0] for r in results]
            batches.setdefault(key, []).extend(_global_batches(seen, world))
            final[key] = results[0][key][1]
        previous = (world, steps)
    monkeypatch.setenv("PL_GLOBAL_SEED", ENV["PL_GLOBAL_SEED"])  # the ranks' seed, for the reference's sampler
    expected = _reference_batches(12)
    ds = _data()
    for optimizer, tol in TOL.items():
        init = _state(_TiedModule(optimizer, ds, scheduler=True))
        module = _TiedModule(optimizer, ds, scheduler=True)
        ref = _reference(module, ds, world=2, steps=12, accumulate=3, batch=BATCH)["state"]
        moved = max((ref[k] - init[k]).abs().max().item() for k in ref)
        assert moved > MIN_MOVE, f"the reference did not train: max |ref - init| = {moved}"
        for strategy in STRATEGIES:
            key = f"{strategy}/{optimizer}"
            assert batches[key] == expected, f"{key}: the global batches differ from an uninterrupted run's"
            for name, value in final[key].items():
                err = (value - ref[name]).abs().max().item()
                assert err <= tol, f"{key} {name}: max |resized - reference| = {err:.3g} > {tol}"


def _run_part(world: int, tmpdir: str, steps: int, previous: tuple[int, int] | None) -> list[dict[str, Any]]:
    return run_distributed(_part, world, tmpdir, steps, previous, timeout=240, env=ENV)


#: The CLI's runs: the digits MLP with Adam (its default), a global batch of 48 = 8 per rank x world x the
#: accumulation that ``batch.global_size`` and ``batch.per_device`` derive at each launch.
CLI = [
    "batch.global_size=48",
    "batch.per_device=8",
    "checkpoint.every_n_train_steps=4",
    "checkpoint.every_n_epochs=null",
    "+checkpoint.save_top_k=-1",  # keep every step's: the uninterrupted run's step 4 shows the later steps train
]
#: Final weights of the resized CLI run against the uninterrupted one: the same samples per step summed in
#: another order (Adam on a 2-layer MLP, 12 steps); measured 6e-8 here, bound as the Trainer test's AdamW.
CLI_TOL = 5e-5


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_cli_resumes_at_another_device_count_deriving_the_accumulation(tmp_path: Path) -> None:
    """``lightning-sync train ... ckpt_path=last`` in the same run directory, on 2, then 3, then 1 ranks."""
    resized = tmp_path / "resized"
    for world, steps, accumulate in ((2, 4, 3), (3, 8, 2), (1, 12, 6)):
        resume = [] if steps == 4 else ["ckpt_path=last"]
        out = cli_run(world, resized, [*CLI, f"trainer.max_steps={steps}", *resume], timeout=240)
        plan = f"global batch 48 = per_device 8 x world {world} x accumulate {accumulate}"
        assert plan in out[0], f"world {world} did not derive {plan!r}:\n{out[0][-3000:]}"
        if resume:
            where = f"resume: epoch 0 continues at sample {(steps - 4) * 48} of its global order"
            assert where in out[0], f"world {world} did not resume mid-epoch:\n{out[0][-3000:]}"
    straight = tmp_path / "uninterrupted"
    cli_run(2, straight, [*CLI, "trainer.max_steps=12"], timeout=240)
    got, want = weights(resized / "final.ckpt"), weights(straight / "final.ckpt")
    assert got.keys() == want.keys()
    moved = max(
        (want[k] - weights(straight / "checkpoints" / "epoch=0-step=4.ckpt")[k]).abs().max().item() for k in want
    )
    assert moved > MIN_MOVE, f"steps 5-12 did not train: {moved}"
    for name in want:
        err = (got[name] - want[name]).abs().max().item()
        assert err <= CLI_TOL, f"{name}: max |resized - uninterrupted| = {err:.3g} > {CLI_TOL}"


def _epoch_part(rank: int, world: int, tmpdir: str, steps: int, ckpt: str | None) -> list[list[int]]:
    """bucketed_ddp with SGD to global step ``steps`` at this world size, checkpointing every 6 steps (an
    epoch's end), from ``ckpt``; this rank's sample indices of every micro-batch."""
    _quiet_rank()
    saver = ModelCheckpoint(dirpath=Path(tmpdir) / f"world{world}", every_n_train_steps=6, save_top_k=-1)
    module = _recorded("sgd")
    accumulate = GLOBAL // (BATCH * world)
    trainer = _trainer(
        world,
        _make("bucketed_ddp"),
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=[saver],
        enable_checkpointing=True,
    )
    trainer.fit(module, ckpt_path=ckpt)
    return module.seen


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_epoch_end_and_an_epoch_start_resume_at_another_world_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An epoch-end checkpoint of world 2 (18 batches an epoch) resumed at world 1 (36): Lightning must count
    the epoch as finished, not as a place halfway through the longer one, which trained on into the next epoch
    and then started it over. The run at world 1 re-saves its resumed step after the next epoch's first
    micro-batch (ModelCheckpoint); that file, position 0 inside an accumulation window, resumed at world 3
    must train the window again rather than count its first micro-batch."""
    run = functools.partial(run_distributed, _epoch_part, timeout=200, env=ENV)
    first = run(2, str(tmp_path), 6, None)
    (epoch_end,) = (tmp_path / "world2").glob("*-step=6.ckpt")
    second = run(1, str(tmp_path), 12, str(epoch_end))
    resaved = tmp_path / "world1" / "epoch=1-step=6.ckpt"
    (state,) = torch.load(resaved, map_location="cpu", weights_only=True)[POSITIONS]
    assert (state["epoch"], state["position"], state["epoch_done"]) == (1, 0, False), state
    third = run(3, str(tmp_path), 12, str(resaved))
    monkeypatch.setenv("PL_GLOBAL_SEED", ENV["PL_GLOBAL_SEED"])  # the ranks' seed, for the reference's sampler
    expected = _reference_batches(12)
    assert _global_batches(first, 2) + _global_batches(second, 1) == expected, "epoch end, world 2 -> 1"
    assert _global_batches(third, 3) == expected[6:], "epoch start inside a window, world 1 -> 3"
