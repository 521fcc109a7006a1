"""ParameterServer in one process when its own update raises: every waiting request (pushes of the
failed step, pushes held by the bound, finishes) and every later one fails with an error naming the
exception; the half-stepped model is never checkpointed; and the server knows when every worker has
stopped (so the rank that hosts it keeps answering until each one has heard why).

``tests/multiprocess/test_async_ps_server_failure.py`` runs the same failure over real RPC."""

from __future__ import annotations

import math
import re
import threading

import pytest
import torch
from torch import nn

from lightning_sync.sync.ps.server import ParameterServer

SERVER_ERROR = "FloatingPointError: non-finite update"


class _FailingSGD(torch.optim.SGD):
    """SGD whose ``fail_at``-th step raises."""

    def __init__(self, params: list[nn.Parameter], fail_at: int) -> None:
        super().__init__(params, lr=0.1)
        self.fail_at, self.calls = fail_at, 0

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        self.calls += 1
        if self.calls == self.fail_at:
            raise FloatingPointError("non-finite update")
        return super().step(closure)


def _server(k: int, s: float, fail_at: int) -> ParameterServer:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    params = list(model.parameters())
    return ParameterServer(params, [], _FailingSGD(params, fail_at), k, s)


def _push(server: ParameterServer, worker: int) -> torch.futures.Future:
    grads = server.layout.flatten([torch.ones_like(p) for p in server.params])
    return server.push(worker, server._read[worker], grads, [True] * len(server.params), [], None)


def _error_of(future: torch.futures.Future) -> str:
    with pytest.raises(RuntimeError) as err:
        future.wait()
    return str(err.value)


def test_every_push_of_the_failed_step_fails_naming_the_exception() -> None:
    """s = 0, K = 3: the third push triggers the step that raises; all three pushes waited on it."""
    server = _server(3, 0, fail_at=1)
    futures = [_push(server, w) for w in range(3)]
    want = f"parameter server: its update to version 1 failed, so training stopped: {SERVER_ERROR}"
    for w, future in enumerate(futures):
        assert future.done(), f"worker {w}'s push still waits on a step that failed"
        assert want in _error_of(future)
    for call in (lambda: server.pull(0), lambda: _push(server, 1), lambda: server.finish(2)):
        with pytest.raises(RuntimeError, match=re.escape(want)):
            call()
    assert server.version == 0


def test_held_pushes_and_finishes_fail_too_and_the_model_is_not_checkpointed() -> None:
    """s = 1, K = 3: worker 0's second push waits for the others (bound), worker 2 is finishing, and
    worker 1's push makes the step that raises. Every one of them fails; a snapshot refuses."""
    server = _server(3, 1, fail_at=2)
    assert _push(server, 0).done()  # version 0 -> 1
    held = _push(server, 0)  # would put worker 1 two versions behind: waits
    finishing = server.finish(2)
    assert not held.done() and not finishing.done()
    failing = _push(server, 1)  # applied together with the held push: the optimizer's second step raises
    want = f"its update to version 2 failed, so training stopped: {SERVER_ERROR}"
    for name, future in (("held push", held), ("finish", finishing), ("failing push", failing)):
        assert future.done(), f"the {name} still waits"
        assert want in _error_of(future)
    with pytest.raises(RuntimeError, match="cannot be checkpointed.*" + re.escape(want)):
        server.snapshot()


def test_the_server_knows_when_every_worker_has_stopped() -> None:
    """After a failure, each worker that heard of it reports back (abort); the server's rank waits for
    that before it stops serving. Bounded: a worker that never reports makes the wait time out."""
    server = _server(2, math.inf, fail_at=1)
    _error_of(_push(server, 0))
    assert not server.wait_stopped(timeout=0.0)  # nobody reported yet
    server.abort(0, "RuntimeError: heard it")
    assert not server.wait_stopped(timeout=0.0)  # worker 1 has not
    reporter = threading.Thread(target=server.abort, args=(1, "RuntimeError: heard it"))
    reporter.start()
    assert server.wait_stopped(timeout=60.0)  # returns once worker 1 reported (60 s only bounds a bug)
    reporter.join()
    assert "its update to version 1 failed" in str(server.error)  # the first error is kept, not the reports


def test_a_server_that_finished_normally_has_nobody_to_wait_for() -> None:
    server = _server(2, math.inf, fail_at=99)
    _push(server, 0).wait()
    server.finish(0)
    server.finish(1).wait()
    assert server.error is None and server.wait_stopped(timeout=0.0)


def test_a_worker_silent_for_the_timeout_fails_whoever_waits_for_it_naming_it() -> None:
    """K = 3, s = 0: workers 0 and 2 push and wait for worker 1 (the bound holds version 1 back until it pushes).
    Worker 1 never does: once it has sent nothing for the timeout, every waiting and later request fails naming it,
    and it alone (0 and 2 wait on the server, they are not silent)."""
    server = _server(3, 0, fail_at=99)
    server._heard = [0.0, 0.0, 0.0]  # as if every worker's last request were long ago
    assert server.expire(5.0) is False  # nobody waits: nothing to give up on
    held = [_push(server, 0), _push(server, 2)]
    assert not any(f.done() for f in held)
    assert server.expire(1e9) is False  # not silent for that long
    assert server.expire(5.0) is True
    want = "parameter server: worker 1 sent nothing for 5 s while the others waited for it (its process lost?)"
    for future in held:
        assert _error_of(future).startswith(want)
    with pytest.raises(RuntimeError, match=re.escape(want)):
        server.pull(0)
    assert server.expire(5.0) is False  # once


def test_a_local_request_gives_up_on_a_silent_worker_after_the_timeout() -> None:
    """What the server's own rank does while its worker waits: the link asks the server to expire silent workers
    every second, so a worker lost without a word cannot hold it for ever."""
    from lightning_sync.sync.ps.worker import LocalLink

    server = _server(2, 0, fail_at=99)
    link = LocalLink(server, timeout=0.5)
    grads = server.layout.flatten([torch.ones_like(p) for p in server.params])
    with pytest.raises(RuntimeError, match=r"parameter server: worker 1 sent nothing for 0\.5 s"):
        link.push(0, 0, grads, [True] * len(server.params), [], None)  # held by worker 1, which never pushes
