"""The parameter server's own update fails (its optimizer raises on the third step, as a non-finite
check would): every worker, on 3 ranks over real RPC, stops with an error that names the server's
exception, type and message, instead of waiting on a step that will never come.

At s = 0 all three pushes of the failing step wait on it (the server's own worker in-process, the
others over RPC); at s = inf the step carries one push, so two workers hear of the failure on their
next request. Either way every rank returns the message it raised with, and the parent checks it.
The harness's hard timeout (``HARNESS_TIMEOUT_S``) is what a hang would hit; the RPC timeout is
shorter, so a worker that gave up waiting would report an RPC timeout, which the check rejects.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from _lightning_reference import ENV, _quiet_rank, _TiedModule, _trainer

from lightning_sync import AsyncParameterServerStrategy
from lightning_sync.testing import run_distributed

FAIL_AT = 3  # the server optimizer's third step raises: the update that would make version 3
SERVER_ERROR = f"FloatingPointError: non-finite update at server step {FAIL_AT}"
EXPECTED = f"parameter server: its update to version {FAIL_AT} failed, so training stopped: {SERVER_ERROR}"
RPC_TIMEOUT_S = 60.0
HARNESS_TIMEOUT_S = 150.0


class _FailingSGD(torch.optim.SGD):
    """SGD whose ``fail_at``-th step raises before touching any parameter."""

    def __init__(self, params: Any, fail_at: int) -> None:
        super().__init__(params, lr=0.1, momentum=0.9)
        self.fail_at, self.calls = fail_at, 0

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.calls += 1
        if self.calls == self.fail_at:
            raise FloatingPointError(f"non-finite update at server step {self.calls}")
        return super().step(closure)


class _ServerFails(_TiedModule):
    def configure_optimizers(self) -> Any:
        return _FailingSGD(self.parameters(), FAIL_AT)  # stepped by the server only


def _server_fails(rank: int, world: int, max_staleness: float) -> str | None:
    _quiet_rank()
    strategy = AsyncParameterServerStrategy(max_staleness=max_staleness, timeout=RPC_TIMEOUT_S)
    try:
        _trainer(world, strategy, max_steps=20).fit(_ServerFails("sgd"))
    except RuntimeError as err:  # the server's failure, relayed to this worker
        return str(err)
    return None  # trained to the end: the failure never reached this worker


@pytest.mark.timeout(2 * HARNESS_TIMEOUT_S)
@pytest.mark.parametrize("max_staleness", [0, math.inf])
def test_a_failing_server_update_stops_every_worker_naming_its_exception(max_staleness: float) -> None:
    messages = run_distributed(_server_fails, 3, max_staleness, timeout=HARNESS_TIMEOUT_S, env=ENV, process_group=False)
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} trained to the end although the server's update failed"
        assert EXPECTED in message, f"rank {rank} stopped with another error:\n{message}"
