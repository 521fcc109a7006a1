"""Lightning's own parameter callbacks, and parameters without a gradient, under ZeRO 1/2/3 on 2 gloo ranks.

One spawned group (module-scoped fixture) runs every scenario in sequence:

* **averaging**: ``EMAWeightAveraging`` and ``StochasticWeightAveraging`` in one fit (they compose: EMA swaps
  its average in around each validation, SWA averages at epoch starts and copies its average into the model
  at train end, after EMA's copy), under Lightning's ``ddp`` and under zero1, zero2 and zero3. Each zero fit
  must give what ``ddp`` gave: every validation loss (so EMA's average was in the model while validating),
  both callbacks' averaged models, and the final weights (SWA's average).
* **pruning**: ``ModelPruning`` (global L1 unstructured, half of all weights and biases at the first epoch's
  end, the lottery ticket reset on) under ``ddp`` and zero1/2/3: the same masks, the same ``state_dict`` in the
  middle of fit (``weight_orig`` and ``weight_mask`` keys, through ``full_state_dict`` under ZeRO) and the
  same final, permanently pruned weights; zero3 also saves a sharded checkpoint of the pruned model.
* **resume**: the EMA run and the pruning run resumed from a checkpoint taken at the first epoch's end (zero3:
  a sharded directory, and a full file) into a fresh module, as ``ddp`` resumes from its own file: on the
  same 2 ranks, and (a group of their own) at 1 and at 3 ranks, the directory resharded.
* **engine**: ``summon_full_params`` on a bf16 model at every stage: a hook that only reads leaves every
  rank's fp32 master shard bit-identical; one that writes lands in the owners' shards.
* **refusals and unused parameters**: ``BackboneFinetuning`` is refused naming itself and the alternative; a
  layer that never gets a gradient (zero3), and one that gets it on one rank only (zero2), raise on every rank,
  naming it; with ``find_unused_parameters=True`` training goes on.

Tolerance of the ddp comparisons: torch's DDP averages each gradient bucket with an all-reduce (divide by
K, then sum), ZeRO with a reduce-scatter (sum, then divide): the averaged gradients differ by float32
rounding, ~1e-7 relative. Nine SGD steps (lr 0.1, momentum 0.9) on weights of magnitude <= ~0.5 carry that
into the weights at ~1e-6 at most; EMA and SWA averages are convex combinations of those weights and the
validation losses smooth functions of them, so they differ as little. 1e-5 is far below what a callback
working on the wrong values does: an average of empty or stale parameters, a swap that was lost, or a
pruning mask of other weights changes them by 1e-2 or more (every scenario checks that its callbacks moved
the weights by more than that).
"""

from __future__ import annotations

import os
import re
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _lightning_reference import (
    ENV,
    _assert_section,
    _quiet_rank,
    _Sections,
    _state,
    _TiedModule,
    _token_data,
    _trainer,
)
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    EMAWeightAveraging,
    ModelCheckpoint,
    ModelPruning,
    StochasticWeightAveraging,
)
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_sync import ShardedStrategy, comms
from lightning_sync.consolidate import consolidate_to_file
from lightning_sync.sync.zero import ZeroEngine, full_state_dict, summon_full_params
from lightning_sync.testing import Checks, run_distributed

__all__: list[str] = []

TOL = {"rtol": 0.0, "atol": 1e-5}  # see the module docstring
MIN_MOVE = 1e-2
BATCH = 4  # per rank
N_TRAIN, N_VAL = 24, 16  # 3 training steps an epoch at 2 ranks; 2 validation batches per rank, no padding
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 16)
        self.l3 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x[:, :4].argmax(1))


class _Module(pl.LightningModule):
    """SGD with momentum; records this rank's validation losses, batch by batch."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(3)
            self.net = _Net()
        self.train_ds, self.val_ds = _data(N_TRAIN, 1), _data(N_VAL, 2)
        self.val_losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # stages 1/2 cast the module's inputs to param_dtype
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_losses.append(float(F.cross_entropy(self(x), y)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_ds, batch_size=BATCH, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_ds, batch_size=BATCH)


def _strategy(name: str, **kw: Any) -> Any:
    """``ddp`` (Lightning's), ``zeroN``, or ``zeroN-bf16`` (parameters gathered and computed in bf16)."""
    if name == "ddp":
        return "ddp"
    stage, _, dtype = name.partition("-")
    kw = {"param_dtype": dtype, **kw} if dtype else kw
    return ShardedStrategy(stage=int(stage[-1]), wrap_policy=["Linear"], bucket_cap_mb=0.001, **kw)


def _net_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The network's tensors of a LightningModule's state_dict (``net.`` keys only, ``module.`` prefix removed)."""
    state = {k.removeprefix("module."): v for k, v in state.items()}
    return {k: v.detach().clone() for k, v in state.items() if k.startswith("net.")}


def _compare(ck: Checks, tag: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    ck.true(f"{tag} same keys", list(got) == list(want), (list(got), list(want)))
    for name in want:
        if name in got:
            ck.close(f"{tag} {name}", got[name], want[name], **TOL)


# --------------------------------------------------------------------------- averaging: EMA and SWA


def _averaging(ck: Checks, world: int) -> None:
    init = _net_state(_Module().state_dict())
    results: dict[str, dict[str, Any]] = {}
    for name in (*STRATEGIES, "zero2-bf16"):
        module = _Module()
        ema = EMAWeightAveraging(decay=0.7)
        swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=1)
        _trainer(world, _strategy(name), max_epochs=3, callbacks=[ema, swa]).fit(module)
        assert ema._average_model is not None and swa._average_model is not None
        results[name] = {
            "val": list(module.val_losses),
            "ema": _net_state(ema._average_model.module.state_dict()),
            "swa": _net_state(swa._average_model.state_dict()),
            "final": _net_state(module.state_dict()),
        }
    ddp = results["ddp"]
    ck.true("[ddp] validated every epoch", len(ddp["val"]) == 3 * N_VAL // (world * BATCH), ddp["val"])
    moved = max(float((ddp["final"][k] - init[k]).abs().max()) for k in init)
    ck.true("[ddp] weights moved", moved > MIN_MOVE, moved)
    apart = max(float((ddp["ema"][k] - ddp["swa"][k]).abs().max()) for k in init)
    ck.true("[ddp] EMA and SWA averages differ (each is checked on its own)", apart > MIN_MOVE, apart)
    ck.true("[ddp] the final weights are SWA's average", all(torch.equal(ddp["final"][k], ddp["swa"][k]) for k in init))
    for name in STRATEGIES[1:]:
        got = results[name]
        ck.close(
            f"[{name}] validation losses (EMA's average swapped in)",
            torch.tensor(got["val"]),
            torch.tensor(ddp["val"]),
            **TOL,
        )
        _compare(ck, f"[{name}] EMA average", got["ema"], ddp["ema"])
        _compare(ck, f"[{name}] SWA average", got["swa"], ddp["swa"])
        _compare(ck, f"[{name}] final weights", got["final"], ddp["final"])
    # Computing in bf16 trains differently from ddp, but the module's full parameters are then bf16 copies and
    # the fp32 masters the weights: SWA's fp32 average must reach the masters whole (its write is not lost to
    # the bf16 copy, nor rounded to bf16 on the way in), so after fit the weights are that average, bit for bit.
    got = results["zero2-bf16"]
    ck.true(
        "[zero2-bf16] the final weights are SWA's average",
        all(torch.equal(got["final"][k], got["swa"][k]) for k in init),
    )
    moved = max(float((got["final"][k] - init[k]).abs().max()) for k in init)
    ck.true("[zero2-bf16] weights moved", moved > MIN_MOVE, moved)


def _ema_resume(ck: Checks, world: int, tmpdir: str) -> None:
    """EMA resumed from a checkpoint: WeightAveraging saves its average as the checkpoint's state_dict and the
    model as current_model_state, and on load puts the latter back into the model, which under zero3 must reach
    the master shards; from a full file and from a sharded directory (which keeps the average WeightAveraging
    writes and hands it the model's state back on load)."""
    results: dict[str, dict[str, torch.Tensor]] = {}
    for name, strategy, form in (("ddp", "ddp", None), ("zero3", "zero3", "full"), ("zero3-dir", "zero3", "sharded")):
        dirpath = os.path.join(tmpdir, f"ema-{name}")
        saving = ModelCheckpoint(dirpath=dirpath, save_last=True)
        kw = {"limit_val_batches": 0, "enable_checkpointing": True}
        first = _strategy(strategy, state_dict_type=form) if name != "ddp" else "ddp"
        _trainer(world, first, max_epochs=1, callbacks=[EMAWeightAveraging(decay=0.7), saving], **kw).fit(_Module())
        ck.true(f"[{name}] saved as {form}", os.path.isdir(os.path.join(dirpath, "last.ckpt")) == (form == "sharded"))
        if form == "sharded" and torch.distributed.get_rank() == 0:
            # consolidated, the directory is the file ddp wrote: the average as state_dict, the model beside it
            plain = consolidate_to_file(os.path.join(dirpath, "last.ckpt"), os.path.join(tmpdir, "ema.ckpt"))
            ddp_file = torch.load(os.path.join(tmpdir, "ema-ddp", "last.ckpt"), weights_only=True)
            for key in ("state_dict", "current_model_state"):
                _compare(ck, f"[{name}] consolidated {key}", _net_state(plain[key]), _net_state(ddp_file[key]))
        module, ema = _Module(), EMAWeightAveraging(decay=0.7)
        second = _strategy(strategy, state_dict_type=form) if name != "ddp" else "ddp"
        trainer = _trainer(world, second, max_epochs=2, limit_val_batches=0, callbacks=[ema])
        trainer.fit(module, ckpt_path=os.path.join(dirpath, "last.ckpt"))
        ck.true(f"[{name}] resumed to the second epoch", trainer.global_step == 2 * N_TRAIN // (world * BATCH))
        assert ema._average_model is not None
        results[name] = {
            **_net_state(module.state_dict()),
            **{f"ema {k}": v for k, v in _net_state(ema._average_model.module.state_dict()).items()},
        }
    _compare(ck, "[zero3 resumed] final weights and EMA average", results["zero3"], results["ddp"])
    _compare(ck, "[zero3 resumed from a directory] final weights and EMA average", results["zero3-dir"], results["ddp"])
    # a module that is not the one saved (a layer frozen since: replicated, no longer sharded) is refused, naming
    # the key, as it is without the callback: the average in the directory's state_dict has the module's keys,
    # but it is not the model, which is in the shards
    frozen = _Module()
    frozen.net.l1.requires_grad_(False)
    ck.raises(
        "[zero3-dir] a module with a layer frozen since is refused",
        lambda: _trainer(
            world, _strategy("zero3"), max_epochs=2, limit_val_batches=0, callbacks=[EMAWeightAveraging(decay=0.7)]
        ).fit(frozen, ckpt_path=os.path.join(tmpdir, "ema-zero3-dir", "last.ckpt")),
        r"first mismatched key 'net\.l1\.weight'",
    )


# --------------------------------------------------------------------------- pruning


class _MidFit(pl.Callback):
    """At the second epoch's start (the first pruning done): the module's state_dict as the strategy has it
    (``full_state_dict`` under ZeRO, a collective; rank 0 holds it); zero3 also saves a checkpoint."""

    def __init__(self, checkpoint: str | None) -> None:
        self.checkpoint = checkpoint
        self.state: dict[str, torch.Tensor] | None = None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch != 1:
            return
        strategy = trainer.strategy
        state = strategy.full_state_dict() if isinstance(strategy, ShardedStrategy) else pl_module.state_dict()
        self.state = _net_state(state) if trainer.global_rank == 0 else None
        if self.checkpoint is not None:
            trainer.save_checkpoint(self.checkpoint)  # ModelPruning.on_save_checkpoint reads every parameter


def _pruning(ck: Checks, world: int, tmpdir: str) -> None:
    init = _net_state(_Module().state_dict())
    results: dict[str, dict[str, Any]] = {}
    for name in (*STRATEGIES, "zero3-file"):  # zero3 writes a directory, zero3-file one full file
        strategy = _strategy("zero3", state_dict_type="full") if name == "zero3-file" else _strategy(name)
        module = _Module()
        prune = ModelPruning("l1_unstructured", amount=lambda epoch: 0.5 if epoch == 0 else 0.0)
        probe = _MidFit(os.path.join(tmpdir, "pruned.ckpt") if name == "zero3" else None)
        # every epoch's end, after the pruning there (Lightning runs checkpoint callbacks last): epoch=0.ckpt is
        # the pruned model mid-fit, at an epoch boundary, so a resume trains a whole epoch at any world size
        saving = ModelCheckpoint(dirpath=os.path.join(tmpdir, f"prune-{name}"), filename="{epoch}", save_top_k=-1)
        callbacks = [prune, probe, saving]
        kw = {"limit_val_batches": 0, "enable_checkpointing": True}
        _trainer(world, strategy, max_epochs=2, callbacks=callbacks, **kw).fit(module)
        results[name] = {"mid": probe.state, "final": _net_state(module.state_dict())}
        if name in ("ddp", "zero3", "zero3-file"):  # resumed into a fresh (unpruned) model from the mid-fit checkpoint
            resumed = _Module()
            again = ModelPruning("l1_unstructured", amount=lambda epoch: 0.5 if epoch == 0 else 0.0)
            trainer = _trainer(world, _strategy(name[:5]), max_epochs=2, limit_val_batches=0, callbacks=[again])
            trainer.fit(resumed, ckpt_path=os.path.join(tmpdir, f"prune-{name}", "epoch=0.ckpt"))
            # a whole epoch trained after the load: the optimizer's state (momentum) taken from the shards counts
            steps = 2 * N_TRAIN // (world * BATCH)
            ck.true(f"[{name}] resumed to the second epoch", trainer.global_step == steps, trainer.global_step)
            results[name]["resumed"] = _net_state(resumed.state_dict())
    ddp = results["ddp"]
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        mid = ddp["mid"] or {}
        ck.true("[ddp] pruned mid-fit", "net.l1.weight_orig" in mid and "net.l1.weight_mask" in mid, list(mid))
    final = ddp["final"]
    ck.true("[ddp] pruning made permanent", list(final) == list(init), list(final))
    zeros = sum(int((v == 0).sum()) for v in final.values())  # global unstructured: half of all 484 values
    ck.true("[ddp] half of the values pruned", zeros == sum(v.numel() for v in final.values()) // 2, zeros)
    moved = max(float((final[k] - init[k]).abs().max()) for k in init)
    ck.true("[ddp] weights moved", moved > MIN_MOVE, moved)
    for name in STRATEGIES[1:]:
        got = results[name]
        if rank0:
            _compare(ck, f"[{name}] state_dict mid-fit", got["mid"] or {}, ddp["mid"] or {})
        _compare(ck, f"[{name}] final weights", got["final"], final)
        ck.true(
            f"[{name}] the same elements pruned",
            all(torch.equal(got["final"][k] == 0, final[k] == 0) for k in final if k in got["final"]),
        )
    # resumed from a directory as ddp from its file: the model as the checkpoint's (permanent) state_dict has it,
    # the optimizer's state from the shards
    ck.true(
        "[zero3] the mid-fit checkpoint is a directory",
        os.path.isdir(os.path.join(tmpdir, "prune-zero3", "epoch=0.ckpt")),
    )
    _compare(ck, "[zero3] resumed from a mid-fit directory", results["zero3"]["resumed"], ddp["resumed"])
    ck.true(
        "[zero3-file] the mid-fit checkpoint is a file",
        os.path.isfile(os.path.join(tmpdir, "prune-zero3-file", "epoch=0.ckpt")),
    )
    _compare(ck, "[zero3-file] resumed from a mid-fit file", results["zero3-file"]["resumed"], ddp["resumed"])
    if rank0:
        meta = os.path.join(tmpdir, "pruned.ckpt", "lightning_sync_meta.json")
        keys = [k for k, _ in __import__("json").load(open(meta))["keys"]] if os.path.exists(meta) else []
        ck.true("[zero3] the sharded checkpoint holds the pruned model's keys", "net.l1.weight_mask" in keys, keys)
        # consolidated, it is the file ddp writes mid-fit: the pruning made permanent (weight = mask * original)
        plain = consolidate_to_file(os.path.join(tmpdir, "pruned.ckpt"), os.path.join(tmpdir, "pruned-plain.ckpt"))
        mid = ddp["mid"] or {}
        permanent = {
            k[: -len("_orig")]: v * mid[k[: -len("_orig")] + "_mask"] for k, v in mid.items() if k.endswith("_orig")
        }
        want = {k: permanent.get(k, mid.get(k)) for k in sorted(init)}  # pruning's own key order aside
        got_plain = _net_state(plain["state_dict"])
        _compare(ck, "[zero3] consolidated mid-fit", {k: got_plain[k] for k in sorted(got_plain)}, want)


# --------------------------------------------------------------------------- resumed at another world size


def _resume_other_world(ck: Checks, world: int, tmpdir: str) -> None:
    """The 2-rank runs' checkpoints (the EMA run's after its first epoch, the pruning run's mid-fit) resumed at
    ``world`` ranks: zero3 from its sharded directories (and the EMA run's full file), resharded, must give
    what ``ddp`` gives from its own files at ``world`` ranks: the same final weights and EMA average."""
    steps = N_TRAIN // (2 * BATCH) + N_TRAIN // (world * BATCH)  # the first epoch at 2 ranks, the second here
    ema_runs = (("ddp", "ema-ddp"), ("zero3", "ema-zero3"), ("zero3-dir", "ema-zero3-dir"))
    prune_runs = (("ddp", "prune-ddp"), ("zero3-dir", "prune-zero3"), ("zero3-file", "prune-zero3-file"))
    results: dict[str, dict[str, torch.Tensor]] = {}
    for name, source in ema_runs:
        module, ema = _Module(), EMAWeightAveraging(decay=0.7)
        trainer = _trainer(world, _strategy(name.split("-")[0]), max_epochs=2, limit_val_batches=0, callbacks=[ema])
        trainer.fit(module, ckpt_path=os.path.join(tmpdir, source, "last.ckpt"))
        ck.true(f"[ema {name}] resumed to the second epoch", trainer.global_step == steps, trainer.global_step)
        assert ema._average_model is not None
        results[f"ema {name}"] = {
            **_net_state(module.state_dict()),
            **{f"ema {k}": v for k, v in _net_state(ema._average_model.module.state_dict()).items()},
        }
    for name, source in prune_runs:
        module = _Module()
        prune = ModelPruning("l1_unstructured", amount=lambda epoch: 0.5 if epoch == 0 else 0.0)
        trainer = _trainer(world, _strategy(name.split("-")[0]), max_epochs=2, limit_val_batches=0, callbacks=[prune])
        trainer.fit(module, ckpt_path=os.path.join(tmpdir, source, "epoch=0.ckpt"))
        ck.true(f"[pruning {name}] resumed to the second epoch", trainer.global_step == steps, trainer.global_step)
        results[f"pruning {name}"] = _net_state(module.state_dict())
    init = _net_state(_Module().state_dict())
    moved = max(float((results["ema ddp"][k] - init[k]).abs().max()) for k in init)
    ck.true("[ema ddp] weights moved", moved > MIN_MOVE, moved)
    for name, _ in ema_runs[1:]:
        _compare(
            ck, f"[ema {name} at {world} ranks] final weights and average", results[f"ema {name}"], results["ema ddp"]
        )
    for name, _ in prune_runs[1:]:
        _compare(
            ck, f"[pruning {name} at {world} ranks] final weights", results[f"pruning {name}"], results["pruning ddp"]
        )


# --------------------------------------------------------------------------- the engine's summon on 2 ranks


class _BfNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(5, 7)  # 42 values: the flat splits across the ranks mid-parameter
        self.l2 = nn.Linear(7, 3)
        self.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))


def _engine(ck: Checks, world: int) -> None:
    rank = torch.distributed.get_rank()
    ctx = comms.CommContext(observer=comms.CommStats())
    for stage in (1, 2, 3):
        tag = f"[engine zero{stage}]"
        model = _BfNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        eng = ZeroEngine(model, opt, ctx, stage=stage, wrap_policy=nn.Linear if stage == 3 else None)
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        opt.step()  # fp32 masters now hold values bf16 cannot represent
        eng.reshard()  # stage 3: drop the step's prefetch, so that summon gathers every flat from the masters
        masters = [f.master.detach().clone() for f in eng.flats]
        ck.true(
            f"{tag} masters beyond bf16",
            any(not torch.equal(m, m.bfloat16().float()) for m in masters),
        )
        before = full_state_dict(eng)
        gathers = ctx.observer.snapshot().get("all_gather")
        with summon_full_params(eng):
            shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
            read = {n: p.detach().clone() for n, p in model.named_parameters()}
        after = ctx.observer.snapshot().get("all_gather")
        calls = (after.calls if after else 0) - (gathers.calls if gathers else 0)
        want = len(eng.flats) if stage == 3 else 0  # stages 1/2 hold the full parameters in their own dtype
        ck.true(f"{tag} all-gathers: one per flat parameter at stage 3, none else", calls == want, (calls, want))
        ck.true(f"{tag} full shapes inside", shapes == {k: tuple(v.shape) for k, v in before.items()}, shapes)
        for n, v in read.items():
            ck.true(f"{tag} {n} read as gathered", torch.equal(v, before[n]))
        for m, b in zip((f.master.detach() for f in eng.flats), masters):
            ck.true(f"{tag} a read leaves the masters bit-identical", torch.equal(m, b))
        with summon_full_params(eng):
            model.l1.weight.data.fill_(0.5)  # every rank the same, as a callback computes it
        written = full_state_dict(eng)
        ck.true(
            f"{tag} every shard of l1.weight written", bool((written["l1.weight"] == 0.5).all()), written["l1.weight"]
        )
        for n in ("l1.bias", "l2.weight", "l2.bias"):
            ck.true(f"{tag} {n} untouched", torch.equal(written[n], before[n]))
        eng.close()


# --------------------------------------------------------------------------- refusals, unused parameters


def _refusals(ck: Checks, world: int) -> None:
    class _WithBackbone(_Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = self.net.l1

    ck.raises(
        "[BackboneFinetuning] refused at setup",
        lambda: _trainer(world, _strategy("zero3"), max_epochs=1, callbacks=[BackboneFinetuning(1)]).fit(
            _WithBackbone()
        ),
        r"cannot run the callback BackboneFinetuning",
        r"requires_grad before trainer\.fit",
        r"strategy='ddp'",
    )
    ds = _token_data()
    sentence = re.escape("It looks like your LightningModule has parameters that were not used")
    for stage, module, named in (
        (
            3,
            _TiedModule("sgd", ds, unused=True),
            [r"'net\.unused\.weight' \(on 2 of 2 ranks\)", r"'net\.unused\.bias'"],
        ),
        (2, _RankZeroOnly(ds), [r"'net\.sometimes\.weight' \(on 1 of 2 ranks\)", r"'net\.sometimes\.bias'"]),
    ):
        ck.raises(
            f"[unused zero{stage} {type(module).__name__}] every rank raises, naming the parameters",
            lambda stage=stage, module=module: _trainer(world, _strategy(f"zero{stage}"), max_steps=6).fit(module),
            "^" + sentence,
            *named,
            r"find_unused_parameters=True",
            exc=RuntimeError,
        )
    module = _TiedModule("sgd", ds, unused=True)
    init = _state(module)
    trainer = _trainer(world, _strategy("zero3", find_unused_parameters=True), max_steps=6)
    trainer.fit(module)
    ck.true("[unused, opted in] trains", trainer.global_step == 6, trainer.global_step)
    for name in ("net.unused.weight", "net.unused.bias"):  # zero gradients, no weight decay: never moves
        ck.close(f"[unused, opted in] {name} untouched", module.state_dict()[name], init[name], rtol=0.0, atol=0.0)


class _RankZeroOnly(_TiedModule):
    """The tied model whose ``sometimes`` layer only rank 0 uses (its forward decides by the first target's
    parity, given the rank here), so the other rank has no gradient for it. Stage 3 cannot run this with
    that layer as a unit of its own: the ranks' all-gathers would not match (a limitation FSDP shares)."""

    def __init__(self, ds: TensorDataset) -> None:
        super().__init__("sgd", ds, sometimes=True)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, y = batch
        return F.cross_entropy(self.net(ids, torch.full_like(y, self.global_rank)), y)


# --------------------------------------------------------------------------- worker and tests


def _worker(rank: int, world: int, tmpdir: str) -> dict[str, Any]:
    _quiet_rank()
    s = _Sections()
    s.run("averaging", _averaging, world)
    s.run("ema resume", _ema_resume, world, tmpdir)
    s.run("pruning", _pruning, world, tmpdir)
    s.run("engine", _engine, world)
    s.run("refusals", _refusals, world)
    return s.result()


def _worker_other(rank: int, world: int, tmpdir: str) -> dict[str, Any]:
    _quiet_rank()
    s = _Sections()
    s.run("resume", _resume_other_world, world, tmpdir)
    return s.result()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Where the 2-rank runs write their checkpoints, which the other world sizes resume from."""
    return str(tmp_path_factory.mktemp("callbacks"))


@pytest.fixture(scope="module")
def two_ranks(checkpoints: str) -> list[dict[str, Any]]:
    return run_distributed(_worker, 2, checkpoints, timeout=240, env=ENV)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [1, 3])
def test_2_rank_ema_and_pruning_checkpoints_resume_at_another_world_size_as_under_ddp(
    world: int, two_ranks: list[dict[str, Any]], checkpoints: str
) -> None:
    results = run_distributed(_worker_other, world, checkpoints, timeout=300, env=ENV)
    _assert_section(results, "resume", min_checks=30)


@pytest.mark.timeout(300)
def test_ema_and_swa_under_zero123_equal_ddp(two_ranks: list[dict[str, Any]]) -> None:
    _assert_section(two_ranks, "averaging", min_checks=50)


@pytest.mark.timeout(300)
def test_ema_resumed_from_a_full_checkpoint_or_a_directory_under_zero3_equals_ddp(
    two_ranks: list[dict[str, Any]],
) -> None:
    _assert_section(two_ranks, "ema resume", min_checks=30, same_count=False)  # rank 0 checks the consolidated file


@pytest.mark.timeout(300)
def test_pruning_under_zero123_equals_ddp(two_ranks: list[dict[str, Any]]) -> None:
    _assert_section(two_ranks, "pruning", min_checks=20, same_count=False)  # rank 0 checks the state_dicts too


@pytest.mark.timeout(300)
def test_summon_reads_bit_identically_and_writes_into_the_owners_shards(two_ranks: list[dict[str, Any]]) -> None:
    _assert_section(two_ranks, "engine", min_checks=30)


@pytest.mark.timeout(300)
def test_finetuning_refused_and_unused_parameters_raise_on_every_rank(two_ranks: list[dict[str, Any]]) -> None:
    _assert_section(two_ranks, "refusals", min_checks=6)
