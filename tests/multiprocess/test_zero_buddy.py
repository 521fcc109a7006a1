"""Buddy snapshots of a ZeroEngine (:mod:`lightning_sync.sync.zero.buddy`) on real gloo ranks, without Lightning.

Three ranks train a tied-embedding model with AdamW for two steps, take a snapshot (each rank's copy sent to the
rank after it), and train one step more. Then, at every stage:

* rank 0 is lost: ranks 1 and 2, in a group of their own, put the snapshot back sharded over two; rank 0's slices
  come from rank 1, which held its copy;
* rank 2 is replaced by a process with a fresh engine (other weights, no optimizer state, nothing of the snapshot):
  the three put the snapshot back over three, the replacement's slices (held by rank 0) reaching it.

Either way the full parameters and the unsharded optimizer state afterwards are the snapshot's, exactly: the
resharding sums one rank's values with zeros, so nothing may differ. The states moved on after the snapshot, so a
relayout that kept the current values instead cannot pass.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_zero_engine import CTX, batches, make_model, sharded_steps
from torch import nn

from lightning_sync.sync.zero import ZeroEngine
from lightning_sync.sync.zero.buddy import BuddySnapshot, relayout, take_snapshot
from lightning_sync.sync.zero.full_checkpoint import full_optimizer_state
from lightning_sync.testing import run_distributed

MEMBERS = ["n0s0i0", "n0s1i0", "n0s2i0"]

pytestmark = [pytest.mark.timeout(240)]


def _engine(stage: int, seed: int = 0, broadcast: bool = True) -> tuple[ZeroEngine, nn.Module, Any]:
    model = make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    policy = [nn.Linear] if stage == 3 else None
    return ZeroEngine(model, opt, CTX, stage=stage, wrap_policy=policy, broadcast=broadcast), model, opt


def _state(engine: ZeroEngine) -> dict[str, Any] | None:
    """The full parameters and the unsharded optimizer state, on the group's rank 0 (a collective)."""
    params = engine.full_params()
    optimizer = full_optimizer_state(engine)
    return {"params": params, "optimizer": optimizer} if engine.comm.rank == 0 else None


def _use(engine: ZeroEngine, comm: Any) -> None:
    engine.comm = comm
    for f in engine.flats:
        f.comm = comm


def _job(rank: int, world: int) -> list[tuple[int, str, Any, Any]]:
    out = []
    data = batches(3)
    for stage in (1, 2, 3):
        for case in ("rank 0 lost", "rank 2 replaced"):
            engine, model, opt = _engine(stage)
            sharded_steps(engine, model, opt, None, "adamw", data[:2], rank, world)
            snapshot = take_snapshot(engine, CTX, MEMBERS, ["0"] * 3).wait()
            assert snapshot.shift == 1 and snapshot.held is not None  # rank r holds rank r - 1's copy
            want = _state(engine)
            if want is not None:
                out.append((stage, case, want, None))
            sharded_steps(engine, model, opt, None, "adamw", data[2:], rank, world)  # the state moves on
            engine.reshard()  # the step's prefetch (stage 3) is in flight on this very group: it lands first
            if case == "rank 0 lost":
                survivors = dist.new_group([1, 2])  # every rank creates it; rank 0 leaves
                if rank == 0:
                    engine.close()
                    continue
                _use(engine, CTX.bound(group=survivors))
                relayout(engine, snapshot, MEMBERS[rank], MEMBERS[1:])
            else:
                now = [*MEMBERS[:2], "n0s2i1"]
                if rank == 2:  # a new process: other initial weights, no optimizer state, no snapshot
                    engine.close()
                    engine, model, opt = _engine(stage, seed=7, broadcast=False)
                    snapshot = BuddySnapshot.empty(MEMBERS, 1)
                relayout(engine, snapshot, now[rank], now)
            got = _state(engine)
            if got is not None:
                out.append((stage, case, None, got))
            engine.close()
    return out


def test_a_snapshot_comes_back_exactly_after_a_loss_and_to_a_replacement() -> None:
    results = run_distributed(_job, 3, timeout=200)
    wants = {(stage, case): want for stage, case, want, _ in results[0] if want is not None}
    gots = {(stage, case): got for r in results for stage, case, _, got in r if got is not None}
    assert sorted(gots) == sorted(wants) and len(gots) == 6, sorted(gots)
    for key, got in gots.items():
        want = wants[key]
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=0, atol=0, msg=f"{key} {name}")
        assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"], key
        assert got["optimizer"]["state"].keys() == want["optimizer"]["state"].keys(), key
        for index, state in want["optimizer"]["state"].items():
            for k, v in state.items():
                torch.testing.assert_close(got["optimizer"]["state"][index][k], v, rtol=0, atol=0, msg=f"{key} {k}")
