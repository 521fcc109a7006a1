"""ZeRO's CPU offload and activation checkpointing on 2 real gloo ranks, against one process and against the
same run without them.

One spawn of 2 ranks runs every scenario in sequence (engine-level runs of a few steps, then three Lightning
fits) and returns raw results; the tests below only assert on them. The model (``support/block_net.py``) has
two residual blocks with dropout, a root-level parameter and odd-sized flat buffers (padded at 2 ranks).

* **Offload** on a CPU-only machine moves nothing between memories, so a run with it must be *bit-identical*
  to the run without (same operations in the same order: the copies are exact), with norm clipping and
  gradient accumulation, at stages 1, 2 and 3 (and bf16 compute, whose device shard is cast on the host);
  its memory report must put no master, gradient-shard or optimizer byte on the device; its checkpoints must
  be the same checkpoints (same metadata and keys, same consolidated values) and load across the two.
* **Activation checkpointing** recomputes each checkpointed forward in backward with the random state of the
  first run, so dropout draws the same masks and the gradients, hence the weights, are *bit-identical* to the
  run without it (CPU kernels are deterministic); it issues exactly as many all-gathers per step (the count
  the strategy's docstring states), runs each block's forward twice, and leaves stage 3's recorded forward
  order unchanged. Stage 3 with blocks and their Linears both wrapped nests checkpointed units.

Every scenario is also compared with the single-process reference (``reference`` in ``block_net.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _lightning_reference import ENV, EQ_TOL, STEPS, _quiet_rank, _reference, _state, _token_data, _trainer
from support.block_net import Block, BlockNet, batches, make_net, reference, sharded_steps, state
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_sync import ShardedStrategy, comms
from lightning_sync.checkpoint.reading import read_dcp_metadata
from lightning_sync.sync.zero import ZeroEngine, consolidate_checkpoint, full_state_dict, load_sharded, save_sharded
from lightning_sync.sync.zero.checkpoint import load_full_state_dict
from lightning_sync.sync.zero.format import read_meta
from lightning_sync.sync.zero.full_checkpoint import full_model_state, full_optimizer_state, load_full_optimizer_state
from lightning_sync.testing import run_distributed

__all__: list[str] = []

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized"),
    pytest.mark.usefixtures("one_thread"),  # the in-process references' tiny tensors
]

CTX = comms.CommContext(observer=comms.CommStats())  # this rank's engine-level context
WORLD = 2
ACCUM, N_STEPS, CLIP = 2, 3, 0.5  # optimizer steps of 2 micro-steps; the global norm is clipped to 0.5 (checked)
SPAWN_TIMEOUT = 240.0

# Against the reference: the ranks average per-rank mean gradients in a float32 reduce-scatter (sum, then a
# divide), the reference sums loss/(W*A) gradients: the same values in another rounding order, ~1e-7 relative
# per gradient value; 3 AdamW steps of lr 0.01 (a normalised update) carry that into the weights at ~1e-7.
# 1e-5 is the project's bound, far below what a bug does: a lost, doubled or stale gradient shard, a step on
# the old master or a dropout mask drawn afresh in the recomputation moves weights by ~1e-3 (lr 0.01 per step).
# bf16 compute (with SGD, lr 0.5, momentum 0.9, clipped): the gathered weights and the forward/backward are bf16
# (relative rounding 2^-9 ~ 2e-3) while fp32 masters take the updates; each update carries the bf16 gradient's
# ~1% relative error, ~2e-3 of the 0.17 the weights move in 3 steps. 5e-3 bounds it (observed: 6.4e-4), and
# the move is checked to exceed 5x that (AdamW would not do here: its normalised update turns the sign noise
# of a tiny bf16 gradient into a whole learning-rate step).
BF16_TOL = {"rtol": 0.0, "atol": 5e-3}
MIN_MOVE = 1e-2


def _opt(model: nn.Module, kind: str = "adamw") -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _engine(
    stage: int, policy: Any, seed: int = 0, dropout: float = 0.1, optimizer: str = "adamw", **kw: Any
) -> tuple[BlockNet, Any, ZeroEngine]:
    model = make_net(seed, dropout=dropout)
    opt = _opt(model, optimizer)
    return model, opt, ZeroEngine(model, opt, CTX, stage=stage, wrap_policy=policy, **kw)


def _gathers() -> int:
    stats = CTX.observer.snapshot().get("all_gather")
    return stats.calls if stats is not None else 0


# ====================================================================== scenarios run inside the ranks
# (name, stage, wrap policy, engine kwargs)
OFFLOAD = [
    ("s1", 1, None, {}),
    ("s2-buckets", 2, None, {"bucket_cap_mb": 0.001}),  # ~1 KiB buckets: several flats
    ("s3", 3, [Block], {}),
    ("s3-nested-bf16", 3, [Block, nn.Linear], {"param_dtype": torch.bfloat16, "optimizer": "sgd"}),
]


def _offload(rank: int, world: int) -> dict[str, Any]:
    data, out = batches(N_STEPS * ACCUM), {}
    for name, stage, policy, kw in OFFLOAD:
        runs = {}
        for offload in (False, True):
            model, opt, eng = _engine(stage, policy, offload=offload, **kw)
            norms = sharded_steps(eng, model, opt, data, rank, world, ACCUM, CLIP)
            runs[offload] = {
                "sd": full_state_dict(eng),
                "norms": norms,
                "memory": eng.memory_report(),  # after the last step: gradients, state and masters all exist
                "shard_numel": sum(f.layout.shard_numel for f in eng.flats),
                "padded": sum(f.layout.padded for f in eng.flats),
                "flats": len(eng.flats),
                "compute_bytes": eng.flats[0].compute_dtype.itemsize,
                "master_devices": sorted({str(f.master.device) for f in eng.flats}),
            }
        out[name] = runs
    return out


CKPT = [(2, None), (3, [Block])]


def _checkpoints(rank: int, world: int, root: str) -> dict[str, Any]:
    """Per stage: 2 steps, save both forms (a sharded directory; the full model and optimizer state, as rank 0
    writes them in one file), 2 more, with and without offload; then each checkpoint loads into an engine of the
    other kind (other initial weights: the load must win) and trains the same 2 steps. No dropout: the resumed
    half's seeds would differ from the uninterrupted run's otherwise."""
    data, out = batches(4, seed=3), {}
    for stage, policy in CKPT:
        runs: dict[str, Any] = {}
        for offload in (False, True):
            model, opt, eng = _engine(stage, policy, dropout=0.0, offload=offload)
            sharded_steps(eng, model, opt, data[:2], rank, world)
            path = f"{root}/s{stage}-offload{offload}"
            save_sharded(eng, path)
            full = [full_model_state(eng), full_optimizer_state(eng)]  # rank 0's, as the file holds them
            torch.distributed.broadcast_object_list(full, src=0)  # every rank reads the whole file
            sd2 = full_state_dict(eng)
            sharded_steps(eng, model, opt, data[2:], rank, world)
            runs[f"saved{offload}"] = {"dir": path, "full": full, "sd2": sd2, "sd4": full_state_dict(eng)}
        for saved in (False, True):  # loaded by the other kind
            for form in ("sharded", "full"):
                model, opt, eng = _engine(stage, policy, seed=123, dropout=0.0, offload=not saved)
                if form == "sharded":
                    load_sharded(eng, runs[f"saved{saved}"]["dir"])
                else:
                    model_state, optimizer_state = runs[f"saved{saved}"]["full"]
                    load_full_state_dict(eng, model_state)
                    load_full_optimizer_state(eng, optimizer_state)
                loaded = full_state_dict(eng)
                sharded_steps(eng, model, opt, data[2:], rank, world)
                runs[f"loaded{saved}-{form}"] = {"loaded": loaded, "resumed": full_state_dict(eng)}
        for key in ("savedFalse", "savedTrue"):
            runs[key]["full"] = runs[key]["full"] if rank == 0 else None
        out[stage] = runs
    return out


# stage 3 gathers one unit a call (coalesce_mb=0) where the test counts gathers per unit; s3-grouped gathers the
# nested units in the engine's default groups
RECOMPUTE = [
    ("s1", 1, [Block], {}),
    ("s2", 2, [Block], {}),
    ("s3", 3, [Block], {"coalesce_mb": 0}),
    ("s3-nested", 3, [Block, nn.Linear], {"coalesce_mb": 0}),  # blocks' Linears are units (and checkpointed)
    ("s3-offload", 3, [Block], {"offload": True, "coalesce_mb": 0}),
    ("s3-grouped", 3, [Block, nn.Linear], {}),
]


def _recompute(rank: int, world: int) -> dict[str, Any]:
    """With and without activation checkpointing: weights, all-gathers and block forwards per step."""
    data, out = batches(N_STEPS * ACCUM, seed=4), {}
    for name, stage, policy, kw in RECOMPUTE:
        runs = {}
        for ac in (False, True):
            model, opt, eng = _engine(stage, policy, activation_checkpointing=ac, **kw)
            gathers, forwards = [], []
            for step in range(N_STEPS):
                before, calls = _gathers(), sum(b.calls for b in model.blocks)
                chunk = data[step * ACCUM : (step + 1) * ACCUM]
                sharded_steps(eng, model, opt, chunk, rank, world, ACCUM, CLIP, first_step=step)
                gathers.append(_gathers() - before)
                forwards.append(sum(b.calls for b in model.blocks) - calls)
            runs[ac] = {
                "sd": full_state_dict(eng),
                "gathers": gathers,
                "forwards": forwards,
                "units": [u.name for u in eng.units],
                "forward_order": eng._forward_order,
            }
            eng.unshard()
            runs[ac]["own_forward_back"] = all("forward" not in m.__dict__ for m in model.modules())
        out[name] = runs
    return out


# ---------------------------------------------------------------------- Lightning fits
VOCAB_L = 40  # _lightning_reference's token data


class _BlockModule(pl.LightningModule):
    """BlockNet (no dropout: Lightning's ranks draw from their own seeds) on the reference's token data."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            self.net = make_net(1234, vocab=VOCAB_L, dropout=0.0)
        self.ds = _token_data()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, y = batch
        return F.cross_entropy(self.net(ids), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.ds, batch_size=4, shuffle=True)


class _Placement(pl.Callback):
    """At every optimizer step: the engine's memory report, and where its masters and their state live."""

    def __init__(self) -> None:
        self.reports: list[dict[str, dict[str, int]]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.reports.append(trainer.strategy.engine.memory_report())  # type: ignore[attr-defined]


FITS = {  # name -> (strategy kwargs, gradient clip)
    "zero3-offload-ac": ({"stage": 3, "offload": True, "activation_checkpointing": True}, CLIP),
    "zero3": ({"stage": 3}, CLIP),
    "zero1-offload": ({"stage": 1, "offload": True, "activation_checkpointing": True}, CLIP),
}


def _fits(rank: int, world: int) -> dict[str, Any]:
    """The three fits, and the single-process reference (here: it walks the batches of Lightning's sampler,
    seeded by the ranks' PL_GLOBAL_SEED)."""
    reference_module = _BlockModule()
    out: dict[str, Any] = {"init": _state(reference_module)}
    out["reference"] = _reference(reference_module, reference_module.ds, world, STEPS, accumulate=2, clip=CLIP)["state"]
    for name, (kw, clip) in FITS.items():
        module, probe = _BlockModule(), _Placement()
        strategy = ShardedStrategy(wrap_policy=[Block], **kw)
        kw = {"accumulate_grad_batches": 2, "gradient_clip_val": clip, "callbacks": [probe]}
        _trainer(world, strategy, max_steps=STEPS, **kw).fit(module)
        out[name] = {"sd": _state(module), "reports": probe.reports, "calls": [b.calls for b in module.net.blocks]}
    return out


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    _quiet_rank()
    return {
        "offload": _offload(rank, world),
        "ckpt": _checkpoints(rank, world, root),
        "recompute": _recompute(rank, world),
        "fits": _fits(rank, world),
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("zero_offload"))


@pytest.fixture(scope="module")
def ranks(root: str) -> list[dict[str, Any]]:
    return run_distributed(_job, WORLD, root, timeout=SPAWN_TIMEOUT, env=ENV)


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, **tol: float) -> None:
    assert list(got) == list(want), f"{what}: keys {list(got)} != {list(want)}"
    for k in want:
        torch.testing.assert_close(
            got[k], want[k], **(tol or {"rtol": 0, "atol": 0}), msg=lambda m, k=k: f"{what}: {k}: {m}"
        )


def _one_process(
    kw: dict[str, Any], data: list[Any], clip: float | None = CLIP, accum: int = ACCUM, optimizer: str = "adamw"
) -> tuple[dict[str, torch.Tensor], list[float], dict[str, torch.Tensor]]:
    """The reference run of ``block_net`` from the same initial weights: (final state, pre-clip norms, initial)."""
    model = make_net(0, **kw)
    init = state(model)
    norms = reference(model, _opt(model, optimizer), data, WORLD, accum, clip)
    return state(model), norms, init


def _max_move(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# ====================================================================== offload
@pytest.mark.timeout(300)
def test_offload_is_bit_identical_and_equals_one_process(ranks: list[dict[str, Any]]) -> None:
    refs = {kind: _one_process({}, batches(N_STEPS * ACCUM), optimizer=kind) for kind in ("adamw", "sgd")}
    for kind, (ref, ref_norms, init) in refs.items():  # it trained (bf16's SGD run far beyond its tolerance)
        assert _max_move(ref, init) > (MIN_MOVE if kind == "adamw" else 5 * BF16_TOL["atol"]), kind
        assert min(ref_norms) > CLIP  # and clipping clipped
    for rank, r in enumerate(ranks):
        for name, _, _, kw in OFFLOAD:
            plain, offloaded = r["offload"][name][False], r["offload"][name][True]
            assert_equal(offloaded["sd"], plain["sd"], f"rank {rank} {name}: offload vs none")
            assert offloaded["norms"] == plain["norms"], (name, offloaded["norms"], plain["norms"])
            ref, ref_norms, _ = refs[kw.get("optimizer", "adamw")]
            tol = BF16_TOL if "param_dtype" in kw else EQ_TOL
            assert_equal(plain["sd"], ref, f"rank {rank} {name} vs one process", **tol)
            if "param_dtype" not in kw:
                assert plain["norms"] == pytest.approx(ref_norms, rel=1e-5)  # the global norm, before clipping
        assert_equal(r["offload"]["s3"][True]["sd"], ranks[0]["offload"]["s3"][True]["sd"], f"rank {rank} vs 0")


@pytest.mark.timeout(300)
def test_offload_puts_no_master_gradient_or_optimizer_byte_on_the_device(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        for name, stage, _, kw in OFFLOAD:
            plain, offloaded = r["offload"][name][False], r["offload"][name][True]
            dev, host = offloaded["memory"]["device"], offloaded["memory"]["host"]
            shard, padded = 4 * offloaded["shard_numel"], 4 * offloaded["padded"]  # fp32 bytes
            # AdamW: exp_avg and exp_avg_sq per master element, a 4-byte step count per flat; SGD: the momentum
            state_bytes = shard if kw.get("optimizer") == "sgd" else 2 * shard + 4 * offloaded["flats"]
            assert dev["optimizer"] == 0 and host["optimizer"] == state_bytes, (name, offloaded["memory"])
            device_shards = offloaded["compute_bytes"] * offloaded["shard_numel"]
            staging = device_shards  # the host-to-device copies read a staging copy in the compute dtype
            assert host["params"] == shard + staging and host["grads"] == shard, (name, offloaded["memory"])
            # the device keeps what is computed: stage 1/2 the full parameters (stage 1 also the full gradient),
            # stage 3 nothing between steps; and every rank's shard in the compute dtype, the all-gather source
            assert dev["params"] == (padded if stage < 3 else 0) + device_shards, (name, offloaded["memory"])
            assert dev["grads"] == (padded if stage == 1 else 0), (name, offloaded["memory"])
            assert plain["memory"]["host"] == {"params": 0, "grads": 0, "optimizer": 0}
            assert plain["memory"]["device"]["optimizer"] == state_bytes
            assert offloaded["master_devices"] == ["cpu"]


@pytest.mark.timeout(300)
def test_offload_checkpoints_are_the_same_checkpoints(ranks: list[dict[str, Any]]) -> None:
    data = batches(4, seed=3)
    ref2, _, init = _one_process({"dropout": 0.0}, data[:2], clip=None, accum=1)
    ref4, _, _ = _one_process({"dropout": 0.0}, data, clip=None, accum=1)
    assert _max_move(ref4, init) > MIN_MOVE
    for rank, r in enumerate(ranks):
        for stage, _ in CKPT:
            c = r["ckpt"][stage]
            plain, offloaded = c["savedFalse"], c["savedTrue"]
            assert_equal(plain["sd2"], ref2, f"stage {stage} after 2 steps", **EQ_TOL)
            assert_equal(plain["sd4"], ref4, f"stage {stage} after 4 steps", **EQ_TOL)
            assert_equal(offloaded["sd4"], plain["sd4"], f"rank {rank} stage {stage} offload")
            for saved in (False, True):  # loading is data movement, resuming the same float operations
                for form in ("sharded", "full"):
                    got = c[f"loaded{saved}-{form}"]
                    kind = "with" if saved else "without"
                    what = f"rank {rank} stage {stage}: {form}, saved {kind} offload, loaded by the other"
                    assert_equal(got["loaded"], plain["sd2"], f"{what}: loaded")
                    assert_equal(got["resumed"], plain["sd4"], f"{what}: resumed")
    # the full form is the same file with and without offload: model and optimizer state, bit for bit
    for stage, _ in CKPT:
        plain, offloaded = (ranks[0]["ckpt"][stage][f"saved{o}"]["full"] for o in (False, True))
        assert_equal(offloaded[0], plain[0], f"stage {stage} full model state")
        assert offloaded[1]["param_groups"] == plain[1]["param_groups"]
        assert sorted(offloaded[1]["state"]) == sorted(plain[1]["state"]) and plain[1]["state"]
        for number, entry in plain[1]["state"].items():
            assert_equal(offloaded[1]["state"][number], entry, f"stage {stage} full optimizer state {number}")
    for stage, _ in CKPT:
        a, b = (Path(ranks[0]["ckpt"][stage][f"saved{o}"]["dir"]) for o in (False, True))
        assert json.loads(json.dumps(read_meta(a))) == json.loads(json.dumps(read_meta(b)))  # the same meta file
        meta_a, meta_b = (read_dcp_metadata(p, True).state_dict_metadata for p in (a, b))
        assert sorted(meta_a) == sorted(meta_b) and len(meta_a) > 0  # the same entries, element ranges and all
        for key in meta_a:
            assert type(meta_a[key]) is type(meta_b[key]), key
        assert_equal(consolidate_checkpoint(b), consolidate_checkpoint(a), f"stage {stage} consolidated")


# ====================================================================== activation checkpointing
def _stage3_gathers(units: list[str]) -> list[int]:
    """All-gathers per stage-3 step with reshard_after_forward (what ShardedStrategy's docstring states): the root
    unit once, every other unit twice (its forward, its backward) per micro-step, except, once the first backward
    has recorded the forward order, the last two units in it (kept from their forward to their backward: the
    last one's comes first and prefetches the other's); the first step adds the check that every rank ran the
    units in the same order (an all-gather of objects). Each optimizer step issues, in one call, the next
    micro-step's first gathers (the root, the first unit and the one it prefetches), which that micro-step then
    does not issue."""
    first, later = 1 + 2 * (len(units) - 1), 1 + 2 * (len(units) - 1) - min(2, len(units) - 1)
    taken = 1 + min(2, len(units) - 1)  # the gathers a step's prefetch issues for the next micro-step
    return [first + 1 + (ACCUM - 1) * later + 1] + [ACCUM * later - taken + 1] * (N_STEPS - 1)


@pytest.mark.timeout(300)
def test_activation_checkpointing_is_bit_identical_and_equals_one_process(ranks: list[dict[str, Any]]) -> None:
    ref, ref_norms, init = _one_process({}, batches(N_STEPS * ACCUM, seed=4))
    assert _max_move(ref, init) > MIN_MOVE and min(ref_norms) > CLIP
    for rank, r in enumerate(ranks):
        for name, *_ in RECOMPUTE:
            plain, ac = r["recompute"][name][False], r["recompute"][name][True]
            assert_equal(plain["sd"], ref, f"rank {rank} {name} vs one process", **EQ_TOL)
            assert_equal(ac["sd"], plain["sd"], f"rank {rank} {name}: checkpointed vs not")


@pytest.mark.timeout(300)
def test_activation_checkpointing_recomputes_and_adds_no_all_gather(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        for name, stage, _, _ in RECOMPUTE:
            plain, ac = r["recompute"][name][False], r["recompute"][name][True]
            blocks = 2
            assert plain["forwards"] == [ACCUM * blocks] * N_STEPS, (name, plain["forwards"])
            assert ac["forwards"] == [2 * ACCUM * blocks] * N_STEPS, (name, ac["forwards"])  # forward + recompute
            assert ac["gathers"] == plain["gathers"], (name, ac["gathers"], plain["gathers"])
            if name == "s3-grouped":  # fewer calls than one a unit, the same with checkpointing
                nested = r["recompute"]["s3-nested"][True]["gathers"]
                assert all(g < n for g, n in zip(ac["gathers"][1:], nested[1:])), (ac["gathers"], nested)
            elif stage == 3:
                assert ac["gathers"] == _stage3_gathers(ac["units"]), (name, ac["gathers"], ac["units"])
                assert ac["forward_order"] == plain["forward_order"] is not None
            else:  # stages 1/2: the post-step all-gather of the updated shards, one per flat
                assert ac["gathers"] == [plain["gathers"][0]] * N_STEPS and plain["gathers"][0] >= 1
            assert ac["own_forward_back"], name  # unshard() gave every module its own forward back
    units = ranks[0]["recompute"]["s3-nested"][True]["units"]
    assert units == ["", "blocks.0", "blocks.0.fc1", "blocks.0.fc2", "blocks.1", "blocks.1.fc1", "blocks.1.fc2", "head"]


# ====================================================================== through Lightning
@pytest.mark.timeout(300)
def test_sharded_strategy_with_offload_and_activation_checkpointing(ranks: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(ranks):
        fits, ref = r["fits"], r["fits"]["reference"]
        assert _max_move(ref, r["fits"]["init"]) > MIN_MOVE
        for name in FITS:
            assert_equal(fits[name]["sd"], ref, f"rank {rank} {name} vs one process", **EQ_TOL)
        # bit-identical to the same fit without offload and checkpointing
        assert_equal(fits["zero3-offload-ac"]["sd"], fits["zero3"]["sd"], f"rank {rank} zero3 offload+AC vs plain")
        for name in ("zero3-offload-ac", "zero1-offload"):
            reports = fits[name]["reports"]
            assert len(reports) == STEPS
            assert all(rep["device"]["optimizer"] == 0 for rep in reports), reports
            assert all(rep["host"]["optimizer"] > 0 for rep in reports[1:]), reports  # after the first step
        # 2 blocks, 2 micro-steps a step: every forward recomputed once (zero1 too: the same policy's modules)
        assert fits["zero3-offload-ac"]["calls"] == fits["zero1-offload"]["calls"] == [2 * 2 * STEPS] * 2
        assert fits["zero3"]["calls"] == [2 * STEPS] * 2
