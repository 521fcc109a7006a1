"""Lightning's mixed precision under ZeRO 1/2/3 on 2 gloo ranks: fp16 with loss scaling, and bf16.

One spawned group (module-scoped fixture) runs each fit once and checks several things per fit:

* **16-mixed**, at each stage (1: accumulation 2 and norm clipping; 2: clipping; 3: ``wrap_policy=["Linear"]``,
  accumulation 2), with the user's own ``GradScaler`` (init scale 2**17: the first steps overflow and halve it;
  growth every 2 good steps, so it also grows and overflows again). At one step, rank 1 alone writes an inf into
  its master gradient shard (``on_after_backward``, before Lightning unscales) - a one-rank overflow no other
  rank can see in its own shard. Checked: the strategy put in a ``ShardedGradScaler`` with the user's settings;
  that step is skipped on both ranks (their full parameters are bit-identical before and after it) and the scale
  halves on both; the scale after every step equals the reference's (and is the same on both ranks); the final
  parameters equal the reference's and are bit-identical across the ranks.
* **bf16-mixed** (stage 3): no scaler, autocast in bf16, the same equivalence.

The reference (one process) runs the same scaler semantics: each rank's global batch is forwarded under the
same autocast and backpropagated *separately* with the scaled loss (so an fp16 overflow happens exactly where
it happens on that rank), the per-rank gradients are averaged, and then ``unscale_``, norm clipping,
``step`` and ``update`` run as Lightning runs them; at the injected step an inf is written into the averaged
gradient.

Tolerance: both sides compute every micro-batch's forward and backward with the same ops on the same values
in one thread, so the per-rank gradients are bit-identical; they are averaged by a reduce-scatter (float32
sum, then divide) against a float32 sum and divide here, and clipping computes the norm in float64 against
float32: differences of ~1e-7 relative per step, ~1e-6 after 8 SGD steps (lr 0.1, momentum 0.9) on weights
of magnitude <= ~1. 1e-5 (the suite's bound) is far below what a wrong decision does: a step taken on one
rank and not the other, or a scale that differs, changes weights by 1e-2 or more (each fit checks the weights
moved by more than ``MIN_MOVE``). Scales are powers of two and compared exactly.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _lightning_reference import (
    ENV,
    EQ_TOL,
    _assert_section,
    _check_against,
    _quiet_rank,
    _rank_batches,
    _same_on_every_rank,
    _Sections,
    _state,
    _TiedModule,
    _token_data,
    _trainer,
)
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_sync import ShardedStrategy
from lightning_sync.sync.zero import ShardedGradScaler
from lightning_sync.testing import Checks, run_distributed

__all__: list[str] = []

STEPS = 8
INJECT_AT = 5  # the optimizer step (0-based) at which rank 1 alone overflows
SCALER = {"init_scale": 2.0**17, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2}
# stage -> (accumulate_grad_batches, gradient_clip_val)
FP16_FITS = {1: (2, 1.0), 2: (1, 0.5), 3: (2, None)}


def _params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def _amp_reference(
    module: pl.LightningModule,
    world: int,
    accumulate: int,
    clip: float | None,
    dtype: torch.dtype,
    scaler: torch.amp.GradScaler | None,
) -> dict[str, Any]:
    """Train ``module`` here on the ranks' global batches with Lightning's AMP order (see the module docstring)."""
    opt = module.configure_optimizers()
    params = _params(module)
    x, y = module.ds.tensors
    batches = _rank_batches(len(module.ds), world, epoch=0)
    scales: list[float] = []
    skipped = 0
    for step in range(STEPS):
        total = [torch.zeros_like(p) for p in params]
        for r in range(world):
            module.zero_grad(set_to_none=True)
            for a in range(accumulate):
                idx = batches[r][step * accumulate + a]
                with torch.autocast("cpu", dtype=dtype, cache_enabled=False):
                    loss = module.training_step((x[idx], y[idx]), step * accumulate + a)
                loss = loss / accumulate  # Lightning normalizes before the precision plugin scales
                (scaler.scale(loss) if scaler is not None else loss).backward()
            for t, p in zip(total, params):
                t += p.grad
        for t, p in zip(total, params):
            p.grad = t / world
        if scaler is None:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            continue
        if step == INJECT_AT:
            params[0].grad.view(-1)[0] = float("inf")
        scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += int(scaler.get_scale() < before)
        scales.append(scaler.get_scale())
    return {"state": _state(module), "scales": scales, "skipped": skipped}


class _Overflow(pl.Callback):
    """Rank 1 writes an inf into its first master-gradient shard at step ``INJECT_AT``'s last micro-batch;
    records the scale after every step and both ranks' full parameters around the injected step."""

    def __init__(self, accumulate: int) -> None:
        self.accumulate = accumulate
        self.micro = 0
        self.scales: list[float] = []
        self.around: list[dict[str, torch.Tensor]] = []
        self.scale_before = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.micro = batch_idx

    def _boundary(self, trainer: pl.Trainer) -> bool:
        return (self.micro + 1) % self.accumulate == 0

    def on_after_backward(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if not (self._boundary(trainer) and trainer.global_step == INJECT_AT):
            return
        engine = trainer.strategy.engine
        self.around.append(engine.full_params())  # a collective: every rank calls it here
        self.scale_before = trainer.precision_plugin.scaler.get_scale()
        if trainer.global_rank == 1:
            engine.flats[0].master.grad.view(-1)[0] = float("inf")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._boundary(trainer):
            return
        self.scales.append(trainer.precision_plugin.scaler.get_scale())
        if trainer.global_step == INJECT_AT + 1:
            self.around.append(trainer.strategy.engine.full_params())


def _fp16(ck: Checks, world: int) -> None:
    ds = _token_data()
    for stage, (accumulate, clip) in FP16_FITS.items():
        tag = f"[zero{stage} 16-mixed]"
        ref_module = _TiedModule("sgd", ds)
        init = _state(ref_module)
        ref = _amp_reference(ref_module, world, accumulate, clip, torch.float16, torch.amp.GradScaler("cpu", **SCALER))
        ck.true(f"{tag} the reference skipped overflowing steps", ref["skipped"] >= 2, ref["scales"])
        module = _TiedModule("sgd", ds)
        probe = _Overflow(accumulate)
        trainer = _trainer(
            world,
            ShardedStrategy(stage=stage, wrap_policy=["Linear"], bucket_cap_mb=0.001),
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **SCALER))],
            max_steps=STEPS,
            accumulate_grad_batches=accumulate,
            gradient_clip_val=clip,
            callbacks=[probe],
        )
        trainer.fit(module)
        scaler = trainer.precision_plugin.scaler
        ck.true(f"{tag} sharded scaler", isinstance(scaler, ShardedGradScaler), type(scaler))
        ck.true(f"{tag} user's settings kept", scaler.get_growth_interval() == SCALER["growth_interval"])
        ck.true(f"{tag} scale after every step", probe.scales == ref["scales"], (probe.scales, ref["scales"]))
        _same_on_every_rank(ck, f"{tag} scales", {"scales": torch.tensor(probe.scales)})
        ck.true(
            f"{tag} one-rank overflow halves the scale",
            probe.scales[INJECT_AT] == probe.scale_before / 2,
            (probe.scale_before, probe.scales[INJECT_AT]),
        )
        ck.true(f"{tag} parameters recorded around the injected step", len(probe.around) == 2, len(probe.around))
        before, after = probe.around if len(probe.around) == 2 else ({}, {})
        for name, value in before.items():
            ck.close(f"{tag} injected step skipped: {name}", after[name], value, rtol=0.0, atol=0.0)
        _check_against(ck, tag, module, ref["state"], init, EQ_TOL)
        _same_on_every_rank(ck, tag, _state(module))


def _bf16(ck: Checks, world: int) -> None:
    ds = _token_data()
    tag = "[zero3 bf16-mixed]"
    ref_module = _TiedModule("sgd", ds)
    init = _state(ref_module)
    ref = _amp_reference(ref_module, world, 1, 1.0, torch.bfloat16, None)
    module = _TiedModule("sgd", ds)
    trainer = _trainer(
        world,
        ShardedStrategy(stage=3, wrap_policy=["Linear"]),
        precision="bf16-mixed",
        max_steps=STEPS,
        gradient_clip_val=1.0,
    )
    trainer.fit(module)
    ck.true(f"{tag} no scaler", getattr(trainer.precision_plugin, "scaler", None) is None)
    _check_against(ck, tag, module, ref["state"], init, EQ_TOL)
    _same_on_every_rank(ck, tag, _state(module))


def _worker(rank: int, world: int) -> dict[str, Any]:
    _quiet_rank()
    s = _Sections()
    s.run("fp16", _fp16, world)
    s.run("bf16", _bf16, world)
    return s.result()


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(_worker, 2, timeout=240, pg_timeout=60, env=ENV)  # a disagreement hangs a collective


@pytest.mark.timeout(300)
def test_fp16_loss_scaling_skips_a_one_rank_overflow_everywhere_and_matches_one_process(
    two_ranks: list[dict[str, Any]],
) -> None:
    _assert_section(two_ranks, "fp16", min_checks=3 * 20)


@pytest.mark.timeout(300)
def test_bf16_autocast_matches_one_process(two_ranks: list[dict[str, Any]]) -> None:
    _assert_section(two_ranks, "bf16", min_checks=10)
