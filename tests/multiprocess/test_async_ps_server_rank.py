"""AsyncParameterServerStrategy with the server on the last rank instead of rank 0, for a whole fit over real RPC.

Rank 0 writes checkpoints, so at the end of fit it asks the server for its final state (for a
``trainer.save_checkpoint`` after fit). With the server on another rank that request goes over RPC after every
worker has finished, when the server's rank is already tearing down: the server's rank must keep serving
until it is answered. Each case is one fit at s = 0 with SGD + momentum, a per-step StepLR and norm
clipping, on 2 ranks (server on rank 1) and on 3 (server on rank 2, so rank 1 is a plain worker), checked
against the single-process data-parallel reference:

* ``fit`` returns on every rank (a hang hits ``HARNESS_TIMEOUT_S``; the harness's error then carries each
  stuck rank's stacks);
* every rank ends with the reference's weights within ``EQ_TOL`` (s = 0 is synchronous SGD step for step;
  the two differ only in float32 summation order, see ``_lightning_reference``) after 6 global steps, no
  gradient stale;
* the server is where it was asked to be: its rank's worker calls it in-process and sends no bytes, every
  other rank sends its 6 pushes;
* rank 0's checkpoint after fit holds the server's final state: the reference's weights (``EQ_TOL``) and the
  server's clock, 6 global steps of K pushes each.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from _lightning_reference import (
    ENV,
    EQ_TOL,
    STEPS,
    _check_against,
    _quiet_rank,
    _reference,
    _state,
    _TiedModule,
    _trainer,
)

from lightning_sync import AsyncParameterServerStrategy, comms
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

CLIP = 0.5
# Bytes one push carries: the 2281 trainable float32 values of _TiedNet (it has no buffers).
PUSH_BYTES = 2281 * 4
# A case takes under 10 s on two shared cores (the forkserver's start included); a hang waits far longer.
HARNESS_TIMEOUT_S = 120.0


def _server_on_last_rank(rank: int, world: int, tmpdir: str) -> tuple[list[str], int]:
    _quiet_rank()
    ck = Checks()
    server_rank = world - 1
    tag = f"[server on rank {server_rank} of {world}]"
    module = _TiedModule("sgd", scheduler=True)
    init = _state(module)
    ref = _reference(_TiedModule("sgd", scheduler=True), module.ds, world, steps=STEPS, clip=CLIP)["state"]
    strategy = AsyncParameterServerStrategy(max_staleness=0, server_rank=server_rank)
    trainer = _trainer(world, strategy, max_steps=STEPS, gradient_clip_val=CLIP)
    trainer.fit(module)
    _check_against(ck, tag, module, ref, init, tol=EQ_TOL)
    ck.true(
        f"{tag} {STEPS} global steps, {STEPS} own steps",
        (strategy.global_step, trainer.global_step) == (STEPS, STEPS),
        (strategy.global_step, trainer.global_step),
    )
    ck.true(f"{tag} no gradient was stale", strategy.staleness_histogram == {0: STEPS * world})
    sent = strategy.comm.observer.snapshot().get("rpc_send", comms.OpStats())
    expected = 0 if rank == server_rank else STEPS * PUSH_BYTES
    ck.true(f"{tag} rank {rank} sends {expected} bytes", sent.bytes == expected, sent)
    path = os.path.join(tmpdir, f"after_fit_{world}.ckpt")
    trainer.save_checkpoint(path)  # rank 0 writes the server's state as it was at the end of fit
    if rank == 0:
        saved = torch.load(path, map_location="cpu", weights_only=False)
        for k, v in ref.items():
            ck.close(f"{tag} [ckpt after fit] the final global model: {k}", saved["state_dict"][k], v, **EQ_TOL)
        clock = saved["lightning_sync/async_ps"]
        ck.true(
            f"{tag} [ckpt after fit] the server's final clock",
            (clock["global_step"], clock["pushes"]) == (STEPS, STEPS * world),
            clock,
        )
    return ck.failures, ck.count


@pytest.mark.timeout(2 * HARNESS_TIMEOUT_S)
@pytest.mark.parametrize("world", [2, 3])
def test_a_fit_with_the_server_on_the_last_rank_returns_the_reference_model(world: int, tmp_path: Any) -> None:
    results = run_distributed(
        _server_on_last_rank, world, str(tmp_path), timeout=HARNESS_TIMEOUT_S, env=ENV, process_group=False
    )
    # rank 0 also checks its checkpoint; every rank checks the 10 tensors, the move, clocks, staleness, bytes
    assert_all_ranks_passed(results, min_checks=14, same_count=False)
