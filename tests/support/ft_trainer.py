"""A plain Lightning ``Trainer`` script under the fault-tolerance agent, for the live tests.

``python ft_trainer.py OUT`` fits :class:`~lightning_sync.models.digits.DigitsMLP` on scikit-learn's digits with
``BucketedDDPStrategy`` (fault-tolerant because the agent started it; ``FT_STRATEGY`` names another: ``local_sgd``,
``diloco``, or ``zero1``-``zero3`` with a buddy snapshot every ``FT_SNAPSHOT_EVERY`` steps, offloaded with
``FT_OFFLOAD=1``),
``Trainer(devices=FT_DEVICES, num_nodes=FT_NODES)``, a per-rank batch of ``FT_BATCH``, ``FT_ACCUMULATE``
micro-batches a step and ``FT_STEPS`` steps, SGD with momentum (optimizer state that a replacement must heal) and
a step LR schedule (scheduler state too).

``FT_KILL`` names where a member kills itself with SIGKILL: ``member:step:point[,...]``; ``point`` is ``forward``
(in ``training_step``), ``backward`` (in backward, with the first buckets' all-reduce in flight), ``step`` (after
the vote, before the optimizer applies the step), ``save`` (in ``on_save_checkpoint``, with ``FT_CKPT_EVERY``:
a ``ModelCheckpoint`` every that many steps into ``OUT/ckpt``), ``validation`` (in ``validation_step``) or
``hang`` (the member stops itself with SIGSTOP in ``training_step``) or ``agent`` (in ``training_step`` it kills its
node's agent, and so its node: every rank dies with its agent); ``step`` is the global step, counted from
the run's start, or ``+N``: N steps after the member's first (a replacement's first is where it was admitted).

``setup`` (in the module's ``setup`` hook) kills a replacement while it sets itself up, before it joins; ``healed``
(in ``on_fit_start``, after the strategy's setup) kills it after it was admitted and received the state, before its
first step, while its peers wait for it in their window. Their ``step`` is ``any``.

Each member writes ``OUT/<member>.json`` when it finishes (the global step, its rank and the live figures:
failures, replayed steps, members) and ``OUT/<member>.pt``, its final weights.
With ``FT_REFERENCE=1`` the script runs one process on the same global batches (``devices=1``, the per-rank batch
times ``FT_DEVICES x FT_NODES``) and writes ``OUT/reference.pt``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torchmetrics import SumMetric

from lightning_sync.comms.membership_keys import ENV_MEMBER, parse_members
from lightning_sync.models.digits import DigitsDataModule, DigitsMLP
from lightning_sync.strategies import BucketedDDPStrategy, DiLoCoStrategy, LocalSGDStrategy, ShardedStrategy

DEVICES = int(os.environ.get("FT_DEVICES", 3))
NODES = int(os.environ.get("FT_NODES", 1))
BATCH = int(os.environ.get("FT_BATCH", 8))
ACCUMULATE = int(os.environ.get("FT_ACCUMULATE", 1))
STEPS = int(os.environ.get("FT_STEPS", 12))
COMPRESSION = os.environ.get("FT_COMPRESSION") or None  # bucketed_ddp's compression (powersgd: rank 1, warm-up 2)
CKPT_EVERY = int(os.environ.get("FT_CKPT_EVERY", 0))  # a ModelCheckpoint every this many steps into OUT/ckpt
STEP_S = float(os.environ.get("FT_STEP_S", 0))  # seconds of sleep in each training_step: a replacement joins mid-run
# the member the run waits for (a replacement): until it is in the membership, each step sleeps FT_STEP_S, and from
# half the steps on waits for every replacement the agent started to be up, so that it joins however long it takes
# to start on a loaded machine
UNTIL = os.environ.get("FT_UNTIL_MEMBER", "")
STRATEGY = os.environ.get("FT_STRATEGY", "bucketed_ddp")  # or local_sgd, diloco (FT_SYNC_EVERY, FT_WARMUP), zero1-3
SNAPSHOT_EVERY = int(os.environ.get("FT_SNAPSHOT_EVERY", 3))  # zero1-3: steps between two buddy snapshots
SYNC_EVERY = int(os.environ.get("FT_SYNC_EVERY", 4))
WARMUP = int(os.environ.get("FT_WARMUP", 0))  # local_sgd's warm-up steps
ACCELERATOR = os.environ.get("FT_ACCELERATOR", "cpu")  # "cuda": one GPU a rank, NCCL
LR_INTERVAL = os.environ.get("FT_LR_INTERVAL", "epoch")  # the step LR schedule's interval: "epoch" or "step"
KILLS = {tuple(k.split(":")[:2]): k.split(":")[2] for k in os.environ.get("FT_KILL", "").split(",") if k}


FIRST: list[int] = []  # the global step this process trained first (a replacement's is its admission's)
DRAWS: dict[str, float] = {}  # global step -> the last torch.rand draw of training_step in it
MEMBERS: dict[str, list[str]] = {}  # global step -> the members that committed it (a period's: its last step's)
# step (of the first epoch) -> the members when its micro-batches were last trained: a replay's, which is the
# committed training of a window (ZeRO's windows, whose earlier steps MEMBERS records before a loss)
TRAINED: dict[str, list[str]] = {}


def maybe_die(trainer: pl.Trainer, point: str) -> None:
    member = os.environ.get(ENV_MEMBER, "")
    since = trainer.global_step - FIRST[0] if FIRST else -1
    mine = (KILLS.get((member, str(trainer.global_step))), KILLS.get((member, "any")), KILLS.get((member, f"+{since}")))
    if point in mine:
        os.kill(os.getpid(), signal.SIGKILL)
    if point == "forward" and "hang" in mine:  # stopped, not dead: its sockets stay open, its heartbeat stops
        os.kill(os.getpid(), signal.SIGSTOP)
    if point == "forward" and "agent" in mine:  # its node's agent is lost: the node's ranks die with it
        os.kill(os.getppid(), signal.SIGKILL)
        signal.pause()  # only the parent-death signal ends this


def wait_for_replacements(membership: Any, timeout: float = 120.0) -> None:
    """Hold this step while a replacement the agent started is not up yet (then the vote that ends the step admits
    it). A replacement's start is all imports; the steps must not run out before it, or its planned kill never
    comes; past ``timeout`` the run goes on, and the test's own checks say what went wrong."""
    store, keys = membership.store, membership.keys
    deadline = time.monotonic() + timeout

    def starting() -> list[str]:
        waiting = parse_members(store.get(keys.waiting)) if store.check([keys.waiting]) else []
        return [m for m in waiting if not store.check([keys.ready(m)])]

    while starting() and time.monotonic() < deadline:
        time.sleep(0.05)


class Model(DigitsMLP):
    def __init__(self) -> None:
        super().__init__()
        self.seen = SumMetric(sync_on_compute=False)  # this member's own count

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if not FIRST:  # its first step: for a replacement the state it healed from says which
            FIRST.append(self.trainer.global_step)
        # one draw of torch's generator per micro-batch, recorded by step: a replacement's stream goes on from the
        # one it healed from (every rank starts from the same seed, but the replacement starts later)
        DRAWS[str(self.trainer.global_step)] = float(torch.rand(1))
        maybe_die(self.trainer, "forward")
        live = getattr(self.trainer.strategy, "live", None)
        if UNTIL and live is not None and UNTIL not in live.membership.members:
            if self.trainer.global_step < STEPS // 2:
                time.sleep(STEP_S)
            else:  # however long a replacement takes to start on a loaded machine, it is admitted before the end
                wait_for_replacements(live.membership)
        # what this member trained, counted twice over: by a torchmetrics metric and by Lightning's own epoch
        # accumulation; a replay must count each sample once in both
        self.seen.update(float(len(batch[1])))
        if live is not None:
            TRAINED[str(batch_idx // ACCUMULATE)] = list(live.membership.members)
        self.log("seen", float(len(batch[1])), on_step=False, on_epoch=True, reduce_fx="sum")
        loss = super().training_step(batch, batch_idx)
        if KILLS:
            loss.register_hook(lambda g: maybe_die(self.trainer, "backward"))
        return loss

    def setup(self, stage: str) -> None:
        maybe_die(self.trainer, "setup")

    def on_fit_start(self) -> None:
        maybe_die(self.trainer, "healed")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        maybe_die(self.trainer, "step")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        live = getattr(self.trainer.strategy, "live", None)
        step = str(self.trainer.global_step - 1)  # the step this batch ended, if it ended one
        if live is not None and self.trainer.global_step > (FIRST[0] if FIRST else 0) and step not in MEMBERS:
            MEMBERS[step] = list(live.membership.members)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        maybe_die(self.trainer, "save")

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        maybe_die(self.trainer, "validation")
        return super().validation_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        schedule = {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 5, 0.5), "interval": LR_INTERVAL}
        return {"optimizer": optimizer, "lr_scheduler": schedule}


def make_strategy() -> Any:
    """The strategy under test (fault-tolerant because the agent started the process)."""
    if STRATEGY == "local_sgd":
        return LocalSGDStrategy(sync_every=SYNC_EVERY, warmup_steps=WARMUP, timeout=60.0)
    if STRATEGY == "diloco":
        return DiLoCoStrategy(sync_every=SYNC_EVERY, timeout=60.0)
    if STRATEGY.startswith("zero"):  # ZeRO: the survivors go back to the last buddy snapshot (FT_SNAPSHOT_EVERY)
        offload = os.environ.get("FT_OFFLOAD") == "1"  # the master shards and optimizer state in host memory
        sync = os.environ.get("FT_SNAPSHOT_ASYNC") == "0"  # each snapshot waited for in the step that takes it
        return ShardedStrategy(
            stage=int(STRATEGY[-1]),
            snapshot_every=SNAPSHOT_EVERY,
            snapshot_async=not sync,
            offload=offload,
            timeout=60.0,
        )
    return BucketedDDPStrategy(timeout=60.0, compression=COMPRESSION, powersgd_rank=1, powersgd_warmup_steps=2)


def main() -> None:
    out = Path(sys.argv[1])
    reference = os.environ.get("FT_REFERENCE") == "1"
    pl.seed_everything(0, workers=True)
    model = Model()
    data = DigitsDataModule(batch_size=BATCH * DEVICES * NODES if reference else BATCH)
    trainer = pl.Trainer(
        accelerator=ACCELERATOR,
        devices=1 if reference else DEVICES,
        num_nodes=1 if reference else NODES,
        strategy="ddp" if reference else make_strategy(),
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        limit_val_batches=2,
        val_check_interval=5 * ACCUMULATE,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=bool(CKPT_EVERY) and not reference,
        callbacks=[
            ModelCheckpoint(out / "ckpt", every_n_train_steps=CKPT_EVERY, save_top_k=-1)
            for _ in range(1 if CKPT_EVERY and not reference else 0)
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(model, datamodule=data)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    if reference:
        torch.save(state, out / "reference.pt")
        return
    strategy = trainer.strategy
    figures = strategy.live.gauges() if strategy.live is not None else {}
    member = os.environ.get(ENV_MEMBER, "solo")
    record = {"global_step": trainer.global_step, "rank": trainer.global_rank, "draws": DRAWS, **figures}
    record["members"], record["trained_by"] = MEMBERS, TRAINED
    # the members at the fit's end: a window the fit ended inside is committed by them (at on_train_end, after the
    # module's hooks), so its steps' entries above may still name the members before a loss
    record["final_members"] = list(strategy.live.membership.members) if strategy.live is not None else []
    record["seen_metric"] = float(model.seen.compute())
    record["seen_logged"] = float(trainer.callback_metrics["seen"]) if "seen" in trainer.callback_metrics else 0.0
    record["aborts"] = strategy.live.membership.aborts if strategy.live is not None else 0
    (out / f"{member}.json").write_text(json.dumps(record))
    torch.save(state, out / f"{member}.pt")


if __name__ == "__main__":
    main()


def samples_trained(
    member: str, committed: dict[str, list[str]], batch: int, accumulate: int, nominal: int, since: int = 0
) -> int:
    """How many samples ``member`` trained in the committed windows from step ``since`` on: each micro-batch's
    ``batch x nominal`` entries shared strided over the members that committed its step (``committed``: step ->
    members, a period's steps mapped to the members of its last)."""
    total = 0
    for step, members in committed.items():
        if int(step) >= since and member in members:
            total += accumulate * len(range(members.index(member), batch * nominal, len(members)))
    return total
