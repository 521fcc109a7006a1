"""One rank of a fault-tolerant training loop in plain torch, started by the fault-tolerance agent in tests.

Least squares on a fixed synthetic dataset, SGD on the mean loss of each global batch of ``GLOBAL`` samples taken
in order from one seeded permutation. Each member of the current membership epoch computes the gradient of its
contiguous slice of the global batch, scaled by ``1 / GLOBAL``, and the members all-reduce (sum) the weight's and
the bias's gradients in two calls; the sum is the global batch's mean gradient whatever the number of members, so
the committed steps equal one process's on the same global batches (up to the order of float additions).

``FT_KILL`` names where a member kills itself with SIGKILL: ``member:step:point[,...]``, ``point`` one of
``before`` (before its first all-reduce), ``between`` (between the two), ``after`` (after both, before voting),
``voted`` (after voting to commit, before reading the decision), and for a replacement ``*:heal`` (while it takes
the training state from a live member); a step ``+N`` counts from the member's first step (a replacement's
start). ``hang`` stops the member (SIGSTOP) between the two all-reduces; ``agent`` kills its node's agent before
its first all-reduce and waits for the signal a rank process gets when its agent dies. ``error`` instead of a
point makes the member's first attempt at that step fail after its all-reduces completed, as if its own
collective had failed where its peers' did not.
``FT_STEPS`` (default ``STEPS``) is the number of steps, and the loop goes on past it until a step is committed
with member ``FT_UNTIL_MEMBER`` (a replacement admitted and healed, however long it took to start);
``FT_STEP_S`` seconds of sleep stand for each attempt's compute. Each epoch of the data is a new seeded
permutation. Each member writes one JSON line per committed step (step, epoch, members, its slice, the time) to
``<out>/<member>.jsonl`` and its final parameters to ``<out>/<member>.pt``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_sync.comms.membership import Membership

SAMPLES, FEATURES, GLOBAL, STEPS, LR = 96, 5, 12, 8, 0.1


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g, dtype=torch.float64)
    y = x @ torch.linspace(-1, 1, FEATURES, dtype=torch.float64) + 0.5 + 0.1 * torch.randn(SAMPLES, generator=g)
    return x, y


def global_batch(step: int) -> torch.Tensor:
    """Step ``step``'s sample indices: its slice of its epoch's seeded permutation (a new one every epoch)."""
    epoch, i = divmod(step, SAMPLES // GLOBAL)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(1000 + epoch))
    return order[i * GLOBAL : (i + 1) * GLOBAL]


def grads(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of sum((x w + b - y)^2) / GLOBAL over the rows given."""
    r = x @ w + b - y
    return 2 * x.T @ r / GLOBAL, (2 * r.sum() / GLOBAL).reshape(1)


def share(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous slice of the global batch (sizes differ by at most one)."""
    return batch.tensor_split(world)[rank]


def reference(steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """One process over the same global batches."""
    x, y = dataset()
    w, b = torch.zeros(FEATURES, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    for step in range(steps):
        idx = global_batch(step)
        gw, gb = grads(w, b, x[idx], y[idx])
        w, b = w - LR * gw, b - LR * gb
    return w, b


def main() -> None:
    out = Path(sys.argv[1])
    steps, step_s = int(os.environ.get("FT_STEPS", STEPS)), float(os.environ.get("FT_STEP_S", 0))
    until = os.environ.get("FT_UNTIL_MEMBER", "")
    kills = {tuple(k.split(":")[:2]): k.split(":")[2] for k in os.environ.get("FT_KILL", "").split(",") if k}
    membership = Membership(timeout=30.0)

    def maybe_die(step: int | str, point: str) -> None:
        mine = (kills.get((membership.member, str(step))), kills.get((membership.member, f"+{step_of(step)}")))
        if point in mine:
            os.kill(os.getpid(), signal.SIGKILL)
        if point == "between" and "hang" in mine:  # hangs inside the step, its peers blocked in a collective with it
            os.kill(os.getpid(), signal.SIGSTOP)
        if point == "before" and "agent" in mine:  # its node's agent is lost: it must die with it
            os.kill(os.getppid(), signal.SIGKILL)
            signal.pause()  # only the parent-death signal ends this

    def step_of(step: int | str) -> int | str:
        return step - membership.start_step if isinstance(step, int) else step

    cast = membership.cast

    def cast_then_maybe_die(step: int, ok: bool, admits: bool = True) -> None:  # votes, dies before the decision
        cast(step, ok, admits)
        if ok:
            maybe_die(step, "voted")

    membership.cast = cast_then_maybe_die  # type: ignore[method-assign]
    x, y = dataset()
    # a replacement starts from zeros too: heal() gives it the members' values
    state = {"w": torch.zeros(FEATURES, dtype=torch.float64), "b": torch.zeros(1, dtype=torch.float64)}

    def heal(source: int) -> None:
        """The training state from rank ``source`` to every member (what a replacement lacks)."""
        maybe_die("*", "heal")  # a replacement lost while it heals
        flat = torch.cat([state["w"], state["b"]])
        dist.broadcast(flat, src=source)
        state["w"], state["b"] = flat[:FEATURES].clone(), flat[FEATURES:].clone()

    membership.heal = heal
    membership.join()
    log = (out / f"{membership.member}.jsonl").open("w")
    step, committed_with = membership.start_step, []
    # at least ``steps`` steps, and on until a step is committed with member ``FT_UNTIL_MEMBER`` (the replacement
    # the test waits for, admitted and healed); every member reads the same committing epoch, so all stop together
    while step < steps or (until and until not in committed_with and step < 50 * steps):
        batch = global_batch(step)
        result: dict[str, Any] = {}

        def attempt(step: int = step, batch: torch.Tensor = batch, result: dict[str, Any] = result) -> None:
            mine = share(batch, membership.rank, membership.world_size)
            maybe_die(step, "before")
            time.sleep(step_s)  # the compute of a real step, so that a replacement can join mid-run
            gw, gb = grads(state["w"], state["b"], x[mine], y[mine])
            dist.all_reduce(gw)
            maybe_die(step, "between")
            dist.all_reduce(gb)
            maybe_die(step, "after")
            if kills.get((membership.member, str(step))) == "error":
                del kills[membership.member, str(step)]  # once: the replay succeeds
                raise RuntimeError("injected: this member's collective failed where its peers' completed")
            result.update(gw=gw, gb=gb, mine=mine, epoch=membership.epoch, members=list(membership.members))

        aborted = membership.run_committed(step, attempt)
        state["w"], state["b"] = state["w"] - LR * result["gw"], state["b"] - LR * result["gb"]
        membership.enter_admitted()  # the step applied: a replacement it admitted heals from this state
        record = {  # the epoch that committed it (an admission then moved every member to the next one)
            "step": step,
            "epoch": result["epoch"],
            "members": result["members"],
            "mine": result["mine"].tolist(),
            "aborted": aborted,
            "time": time.monotonic(),
        }
        log.write(json.dumps(record) + "\n")
        log.flush()
        step, committed_with = step + 1, result["members"]
    torch.save(state, out / f"{membership.member}.pt")
    membership.close()


if __name__ == "__main__":
    main()
