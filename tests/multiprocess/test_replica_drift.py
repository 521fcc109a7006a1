"""``ReplicaDriftCheck`` on 2 real gloo ranks (``BucketedDDPStrategy``, then ZeRO-2 and ZeRO-3), all in one spawn:

* no divergence: checked at steps 2, 4, 6, nothing flagged, and training still meets the single-process
  reference (the check only reads);
* ``1e-3`` added to one element of ``net.fc1.weight`` on rank 1 at the end of step 3 (by a callback placed
  *before* the check, so the check of step 3 already sees it): ``action="warn"`` finds step 3, rank 1 and
  ``net.fc1.weight``, warns once (the replicas stay apart: both ranks apply the same averaged update) and
  logs ``replica_drift/diverged`` 1; ``action="raise"`` stops both ranks with an error naming them;
* ZeRO-2 (full parameters re-gathered every step: the nudge is found at step 3 and gone at step 4) and
  ZeRO-3 (only replicated tensors compared: a nudged frozen parameter is found).

Argument validation, refusals and the checksum itself: ``tests/unit/test_replica_drift_unit.py``.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _lightning_reference import ENV, _check_against, _quiet_rank, _reference, _state, _TiedModule, _trainer

from lightning_sync import BucketedDDPStrategy, ShardedStrategy, comms
from lightning_sync.diagnostics import ReplicaDriftCheck
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

# The communication context of this process's checks (a strategy owns one the same way).
CTX = comms.CommContext(observer=comms.CommStats())

STEPS, NUDGE_STEP, NUDGE = 6, 3, 1e-3


class _NudgeAt(pl.Callback):
    """At the end of optimizer step ``step``, add ``NUDGE`` to ``net.<layer>.weight[0, 0]`` on rank ``rank`` only."""

    def __init__(self, rank: int, step: int, layer: str = "fc1") -> None:
        self.rank, self.step, self.layer = rank, step, layer

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            with torch.no_grad():
                getattr(pl_module.net, self.layer).weight[0, 0] += NUDGE


def _worker(rank: int, world: int) -> tuple[list[str], int]:
    _quiet_rank()
    ck = Checks()

    # (a) agreeing replicas. The check only reads the model, so training must still equal the single-process
    # reference to EQ_TOL (atol 1e-5: the all-reduce and the reference sum the per-rank gradients in another
    # float32 order, ~1e-7 relative per value, below ~1e-6 after 6 SGD+momentum steps; a check that wrote to
    # the weights or disturbed a step would move them by ~1e-3 or more; see _lightning_reference.EQ_TOL).
    module, init = _TiedModule("sgd"), _state(_TiedModule("sgd"))
    ref = _reference(_TiedModule("sgd"), module.ds, world, steps=STEPS)["state"]
    quiet = ReplicaDriftCheck(every_n_steps=2, action="raise")
    trainer = _trainer(world, BucketedDDPStrategy(), max_steps=STEPS, callbacks=[quiet])
    trainer.fit(module)
    ck.true("checked at steps 2, 4, 6", quiet.checked_steps == [2, 4, 6], quiet.checked_steps)
    ck.true("every parameter compared (9: the tied one once; no buffers)", quiet.compared == 9, quiet.compared)
    ck.true("no divergence", quiet.first_divergent_step is None and quiet.divergences == [], quiet.divergences)
    ck.true(
        "diverged metric 0", float(trainer.callback_metrics["replica_drift/diverged"]) == 0.0, trainer.callback_metrics
    )
    _check_against(ck, "[with the check]", module, ref, init)

    # (b) rank 1 nudged at the end of step 3, action="warn": found at step 3 and warned once
    warn = ReplicaDriftCheck(every_n_steps=1, action="warn")
    trainer = _trainer(world, BucketedDDPStrategy(), max_steps=STEPS, callbacks=[_NudgeAt(1, NUDGE_STEP), warn])
    nudged = _TiedModule("sgd")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(nudged)
    ours = [str(w.message) for w in caught if "replicas diverged" in str(w.message)]
    ck.true("checked every step", warn.checked_steps == list(range(1, STEPS + 1)), warn.checked_steps)
    ck.true("first divergent step is 3", warn.first_divergent_step == NUDGE_STEP, warn.first_divergent_step)
    ck.true(
        "one divergence: step 3, rank 1, net.fc1.weight",
        warn.divergences == [(NUDGE_STEP, [1], "parameter net.fc1.weight")],
        warn.divergences,
    )
    ck.true(
        "diverged metric 1", float(trainer.callback_metrics["replica_drift/diverged"]) == 1.0, trainer.callback_metrics
    )
    ck.true("one warning, on rank 0 only", len(ours) == (1 if rank == 0 else 0), ours)
    expected = (
        "replicas diverged at global step 3: rank 1 differs from rank 0; first difference: parameter "
        "net.fc1.weight: rank 0 has shape (48, 16), torch.float32, checksum "
    )
    ck.true(
        "the warning names step, rank and parameter", rank != 0 or bool(ours) and ours[0].startswith(expected), ours
    )
    # an independent look: the replicas really differ, in fc1.weight only, and there by about the nudge
    states = CTX.all_gather_object(_state(nudged))
    differing = sorted(k for k in states[0] if not torch.equal(states[0][k], states[1][k]))
    ck.true("only net.fc1.weight differs", differing == ["net.fc1.weight"], differing)
    gap = (states[1]["net.fc1.weight"] - states[0]["net.fc1.weight"]).abs()
    ck.true(
        "by about the nudge, in one element",
        abs(gap[0, 0].item() - NUDGE) < 1e-4 and int((gap > 1e-4).sum()) == 1,
        gap.max(),
    )

    # (c) ZeRO-2: the module's parameters are re-gathered from the master shards after every step, so the
    # nudge of step 3 is gone after step 4 (overwritten, or, if it fell in rank 1's own shard, gathered to
    # rank 0 too): found at step 3 only, and the replicas agree again from step 4 on
    zero2 = ReplicaDriftCheck(every_n_steps=1, action="warn")
    trainer = _trainer(world, ShardedStrategy(stage=2), max_steps=STEPS, callbacks=[_NudgeAt(1, NUDGE_STEP), zero2])
    trainer.fit(_TiedModule("sgd"))
    ck.true(
        "ZeRO-2: checked every step, every parameter",
        zero2.checked_steps == list(range(1, STEPS + 1)) and zero2.compared == 9,
        (zero2.checked_steps, zero2.compared),
    )
    ck.true(
        "ZeRO-2: diverged at step 3 only, in net.fc1.weight",
        zero2.divergences == [(NUDGE_STEP, [1], "parameter net.fc1.weight")]
        and float(trainer.callback_metrics["replica_drift/diverged"]) == 0.0,
        (zero2.divergences, trainer.callback_metrics),
    )

    # (d) ZeRO-3: trainable parameters are one shard per rank (not compared); a replicated frozen parameter is
    zero3 = ReplicaDriftCheck(every_n_steps=1, action="warn")
    trainer = _trainer(
        world, ShardedStrategy(stage=3), max_steps=STEPS, callbacks=[_NudgeAt(1, NUDGE_STEP, "frozen"), zero3]
    )
    trainer.fit(_TiedModule("sgd"))
    ck.true("ZeRO-3: checked every step", zero3.checked_steps == list(range(1, STEPS + 1)), zero3.checked_steps)
    ck.true("ZeRO-3: only the frozen layer's 2 tensors compared", zero3.compared == 2, zero3.compared)
    ck.true(
        "ZeRO-3: the frozen parameter diverged at step 3, and stays apart",
        zero3.divergences == [(NUDGE_STEP, [1], "parameter net.frozen.weight")]
        and float(trainer.callback_metrics["replica_drift/diverged"]) == 1.0,
        (zero3.divergences, trainer.callback_metrics),
    )

    # (e) (b) with action="raise": every rank raises, naming the step, rank 1 and the parameter
    stop = ReplicaDriftCheck(every_n_steps=1)
    ck.raises(
        "a divergence stops every rank",
        lambda: _trainer(world, BucketedDDPStrategy(), max_steps=STEPS, callbacks=[_NudgeAt(1, NUDGE_STEP), stop]).fit(
            _TiedModule("sgd")
        ),
        r"^replicas diverged at global step 3: rank 1 differs from rank 0; first difference: "
        r"parameter net\.fc1\.weight: rank 0 has .*; rank 1 has ",
        exc=RuntimeError,
    )
    ck.true(
        "raise: checked steps 1-3, first divergent step 3",
        stop.checked_steps == [1, 2, 3] and stop.first_divergent_step == NUDGE_STEP,
        (stop.checked_steps, stop.first_divergent_step),
    )
    return ck.result()


@pytest.mark.timeout(240)
def test_drift_is_found_at_the_step_it_happens_named_and_stops_every_rank() -> None:
    assert_all_ranks_passed(run_distributed(_worker, 2, timeout=180, env=ENV), min_checks=25)
