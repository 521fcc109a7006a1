"""ParameterServer in one process: the staleness bound, the synchronous case, the budget, clipping,
checkpoint counters and a restore that holds early pushes, driven step by step (each push's future
shows whether it was applied yet).

The multi-process tests (``tests/multiprocess/test_async_ps.py``) run the same server over real RPC."""

from __future__ import annotations

import copy
import math
import re
import threading
from typing import Any

import pytest
import torch
from torch import nn

from lightning_sync import AsyncParameterServerStrategy
from lightning_sync.sync.ps.server import FlatLayout, ParameterServer, check_lr_scaling, check_staleness
from lightning_sync.sync.ps.worker import LOOKAHEAD_EMA, LocalLink, PSWorker, check_compensation

LR = 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _server(k: int, s: float, budget: int | None = None, momentum: float = 0.0) -> tuple[ParameterServer, nn.Module]:
    model = _model()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR, momentum=momentum)
    return ParameterServer(params, list(model.buffers()), opt, k, s, budget), model


def _grads(server: ParameterServer, seed: int) -> tuple[list[torch.Tensor], list[bool]]:
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=g) for p in server.params]
    return server.layout.flatten(grads), [True] * len(grads)


def _push(server: ParameterServer, worker: int, seed: int, clip: Any = None) -> torch.futures.Future:
    grads, present = _grads(server, seed)
    version = server._read[worker]
    return server.push(worker, version, grads, present, server.buffer_layout.flatten(server.buffers), clip)


def test_staleness_zero_is_synchronous_sgd() -> None:
    """s = 0: no step until every worker pushed; then one step with the average (SGD with momentum,
    3 steps, against the same steps taken by hand). Sums of 3 fp32 values in another order: 1e-6."""
    k = 3
    server, model = _server(k, 0, momentum=0.9)
    ref = [p.detach().clone() for p in model.parameters()]
    ref_opt = torch.optim.SGD([nn.Parameter(r) for r in ref], lr=LR, momentum=0.9)
    for step in range(3):
        futures = []
        for w in (2, 0, 1):  # arrival order differs from worker order
            futures.append(_push(server, w, seed=10 * step + w))
            assert all(not f.done() for f in futures) == (len(futures) < k), f"step {step}: applied before all {k}"
        assert all(f.done() for f in futures) and server.version == step + 1
        grads = [_grads(server, 10 * step + w)[0] for w in range(k)]
        mean = [sum(g[i] for g in grads) / k for i in range(len(grads[0]))]
        for p, g in zip(ref_opt.param_groups[0]["params"], FlatLayout(ref).views(mean)):
            p.grad = g.clone()
        ref_opt.step()
    for got, want in zip(server.params, ref_opt.param_groups[0]["params"]):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=0, atol=1e-6)
    assert server.staleness == {0: 9} and server.global_step == 3


def test_bound_two_holds_the_fast_worker_back_and_nothing_is_staler() -> None:
    """s = 2, worker 1 never pushes in between: worker 0's first two pushes apply at once, the third
    waits for worker 1 and is applied together with it."""
    server, _ = _server(2, 2)
    assert _push(server, 0, 1).done() and _push(server, 0, 2).done()
    third = _push(server, 0, 3)
    assert not third.done() and server.version == 2
    slow = _push(server, 1, 4)  # read version 0, applied at version 2: staleness 2
    assert third.done() and slow.done() and server.version == 3
    assert max(server.staleness) == 2 and server.staleness == {0: 3, 2: 1}
    assert server.pushes_by_worker == [3, 1]


def test_unbounded_applies_every_push_at_once() -> None:
    server, _ = _server(2, math.inf)
    for i in range(5):
        assert _push(server, 0, i).done()
    assert server.version == 5 and server.global_step == 2  # 5 pushes of K=2: two global steps
    assert _push(server, 1, 9).done() and server.staleness == {0: 5, 5: 1}


def test_finished_worker_no_longer_holds_others_back() -> None:
    server, _ = _server(2, 0)
    pending = _push(server, 0, 1)
    assert not pending.done()
    final = server.finish(1)
    assert pending.done() and not final.done()  # worker 0 still runs
    assert server.finish(0).done() and final.done()
    torch.testing.assert_close(final.wait().params[0], server.layout.flatten(server.params)[0], rtol=0, atol=0)


def test_budget_discards_pushes_past_it_and_says_stop() -> None:
    server, _ = _server(2, math.inf, budget=1)  # one global step = two pushes
    assert not _push(server, 0, 1).wait().stop
    reply = _push(server, 1, 2).wait()
    assert reply.stop and reply.applied and server.pushes == 2
    late = _push(server, 0, 3).wait()
    assert late.stop and not late.applied and server.discarded == 1 and server.version == 2


def test_missing_gradients_leave_parameters_alone_and_a_step_carries_its_share() -> None:
    """A parameter no push touched is not stepped (weight decay would otherwise move it). One of two
    pushes carries half the global batch: its gradient (the mean of one) is clipped to norm 1.0 and
    applied, with the weight decay, at half the learning rate."""
    model = _model()
    params = [p for p in model.parameters() if p.requires_grad]
    server = ParameterServer(
        params, list(model.buffers()), torch.optim.SGD(params, lr=1.0, weight_decay=0.5), 2, math.inf
    )
    before = [p.detach().clone() for p in server.params]
    grads, present = _grads(server, 3)
    present[0] = False
    views = server.layout.views(grads)
    views[0].zero_()
    server.push(0, 0, grads, present, server.buffer_layout.flatten(server.buffers), ("norm", 1.0)).wait()
    assert torch.equal(server.params[0].detach(), before[0])
    moved = torch.cat([(b - p.detach()).reshape(-1) for p, b in zip(server.params[1:], before[1:])])
    decay = torch.cat([0.5 * 0.5 * b.reshape(-1) for b in before[1:]])  # lr 1 x share 1/2 x weight decay 0.5
    assert math.isclose((moved - decay).norm().item(), 0.5, rel_tol=1e-5)  # lr x share x the clipped gradient


def test_workers_take_the_global_model_and_counters_survive_a_checkpoint() -> None:
    server, model = _server(2, 1)
    replicas = [_model(), _model()]
    workers = []
    for w, replica in enumerate(replicas):
        with torch.no_grad():
            for p in replica.parameters():
                p.add_(1.0)  # start different: the first pull must overwrite them
        params = [p for p in replica.parameters() if p.requires_grad]
        workers.append(PSWorker(w, params, list(replica.buffers()), LocalLink(server)))
    for worker, replica in zip(workers, replicas):
        worker.pull()
        replica(torch.randn(5, 3)).sum().backward()
    workers[0].push()
    for a, b in zip(replicas[0].parameters(), server.params):
        assert torch.equal(a.detach(), b.detach())
    snap = server.snapshot()
    fresh, _ = _server(2, 1)
    fresh.load_state_dict(snap["state"])
    assert fresh.version == server.version == 1 and fresh.staleness == server.staleness
    assert fresh._read == [1, 1]


@pytest.mark.parametrize("bad", [-1, 2.5, "2", True, None])
def test_bad_staleness_is_named(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_staleness"):
        check_staleness(bad)


def test_bad_requests_are_named() -> None:
    server, _ = _server(2, 1)
    with pytest.raises(ValueError, match="num_workers"):
        ParameterServer(server.params, [], None, 0, 1)
    with pytest.raises(ValueError, match="worker must be an int in \\[0, 1\\]"):
        server.pull(2)
    grads, present = _grads(server, 0)
    with pytest.raises(ValueError, match="version 5"):
        server.push(0, 5, grads, present, [], None)
    server.finish(0)
    with pytest.raises(RuntimeError, match="worker 0 already finished"):
        server.pull(0)


def test_abort_fails_waiting_and_later_requests_naming_the_worker() -> None:
    server, _ = _server(2, 0)
    waiting = _push(server, 0, 1)
    server.abort(1, "ValueError('boom')")
    with pytest.raises(RuntimeError, match="worker 1 failed.*boom"):
        waiting.wait()
    with pytest.raises(RuntimeError, match="worker 1 failed"):
        server.pull(0)


def test_an_adaptive_optimizer_moves_k_pushes_as_far_as_one_synchronous_step() -> None:
    """Adam ignores the gradient's scale, so only the learning-rate share keeps one push at 1/K of a
    step: the first Adam step moves each element by lr (sign of the gradient), so one push of K = 2 at
    lr 0.1 moves every touched element by exactly 0.05."""
    model = _model()
    params = [p for p in model.parameters() if p.requires_grad]
    server = ParameterServer(params, list(model.buffers()), torch.optim.Adam(params, lr=0.1), 2, math.inf)
    before = [p.detach().clone() for p in server.params]
    _push(server, 0, 5).wait()
    for p, b in zip(server.params, before):
        torch.testing.assert_close((p.detach() - b).abs(), torch.full_like(b, 0.05), rtol=0, atol=1e-6)
    assert server.optimizer.param_groups[0]["lr"] == 0.1  # the scaled rate was for that step only


def test_sqrt_lr_scaling_moves_one_push_by_lr_over_sqrt_k_and_is_exact_at_s0() -> None:
    """lr_scaling="sqrt": the first Adam step moves each element by the step's lr, so one push of K = 4 at
    lr 0.1 moves it by 0.1 / sqrt(4) = 0.05 (linear: 0.025). At s = 0 a step carries all K gradients,
    sqrt(K / K) = 1: the same model as linear scaling, which is synchronous SGD."""

    def adam_server(k: int, s: float, scaling: str) -> ParameterServer:
        model = _model()
        params = [p for p in model.parameters() if p.requires_grad]
        return ParameterServer(
            params, list(model.buffers()), torch.optim.Adam(params, lr=0.1), k, s, lr_scaling=scaling
        )

    server = adam_server(4, math.inf, "sqrt")
    before = [p.detach().clone() for p in server.params]
    _push(server, 0, 5).wait()
    for p, b in zip(server.params, before):
        torch.testing.assert_close((p.detach() - b).abs(), torch.full_like(b, 0.05), rtol=0, atol=1e-6)
    synchronous = []
    for scaling in ("linear", "sqrt"):
        server = adam_server(2, 0, scaling)
        for step in range(3):
            futures = [_push(server, w, 10 * step + w) for w in range(2)]
            for f in futures:
                f.wait()
        synchronous.append([p.detach().clone() for p in server.params])
    for a, b in zip(*synchronous):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad", ["Linear", "none", None, 1])
def test_bad_lr_scaling_is_named_with_the_allowed_ones(bad: Any) -> None:
    with pytest.raises(
        ValueError, match=r"lr_scaling must be one of \['linear', 'sqrt'\], got " + re.escape(repr(bad))
    ):
        check_lr_scaling(bad)
    with pytest.raises(ValueError, match=r"lr_scaling must be one of \['linear', 'sqrt'\]"):
        AsyncParameterServerStrategy(lr_scaling=bad)


def _workers(server: ParameterServer, lookahead: bool) -> tuple[list[PSWorker], list[nn.Module]]:
    replicas = [_model(), _model()]
    workers = [
        PSWorker(
            w, [p for p in r.parameters() if p.requires_grad], list(r.buffers()), LocalLink(server), lookahead=lookahead
        )
        for w, r in enumerate(replicas)
    ]
    for worker in workers:
        worker.pull()
    return workers, replicas


def _set_grads(replica: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in replica.parameters():
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("lookahead", [True, False])
def test_lookahead_computes_the_next_gradient_where_the_model_is_expected_to_be(lookahead: bool) -> None:
    """Two workers, s = 4. Worker 1 pushes first (version 0 -> 1); worker 0's gradient, read at version 0,
    is applied at version 1 (staleness 1, so tau_hat = LOOKAHEAD_EMA x 1) and makes version 2. With
    lookahead, worker 0 continues from theta_2 + tau_hat x (theta_2 - theta_0) / 2, the mean update per
    version since its previous model, extrapolated; without, from theta_2. Both are computed here by hand
    from the server's own models; the arithmetic is the same fp32 operations in the same order: exact."""
    server, _ = _server(2, 4)
    workers, replicas = _workers(server, lookahead)
    theta0 = [p.detach().clone() for p in server.params]
    _set_grads(replicas[1], seed=1)
    workers[1].push()
    assert workers[1].expected_staleness == 0.0  # fresh: nothing to extrapolate
    for a, b in zip(replicas[1].parameters(), server.params):
        assert torch.equal(a.detach(), b.detach())
    _set_grads(replicas[0], seed=0)
    workers[0].push()
    assert server.staleness == {0: 1, 1: 1} and server.version == 2
    tau_hat = LOOKAHEAD_EMA * 1 if lookahead else 0.0
    assert workers[0].expected_staleness == tau_hat
    theta2 = [p.detach().clone() for p in server.params]
    flat2, flat0 = server.layout.flatten(theta2), server.layout.flatten(theta0)
    want = [n + (n - o) * (tau_hat / 2) for n, o in zip(flat2, flat0)] if lookahead else flat2
    for got, expected in zip([p for p in replicas[0].parameters() if p.requires_grad], server.layout.views(want)):
        assert torch.equal(got.detach(), expected)
    if lookahead:
        assert not all(torch.equal(a.detach(), b) for a, b in zip(replicas[0].parameters(), theta2))
    workers[0].pull()  # evaluation, setup and the end of fit take the global model exactly
    for a, b in zip(replicas[0].parameters(), server.params):
        assert torch.equal(a.detach(), b.detach())


def test_lookahead_leaves_synchronous_training_untouched() -> None:
    """s = 0: no gradient is ever stale, so tau_hat stays 0 and every replica is the server's model bit
    for bit after every step."""
    server, _ = _server(2, 0, momentum=0.9)
    workers, replicas = _workers(server, lookahead=True)
    for step in range(3):
        for w in (0, 1):
            _set_grads(replicas[w], seed=10 * step + w)
        futures = [torch.futures.Future(), torch.futures.Future()]
        threads = [
            threading.Thread(target=lambda w=w, futures=futures: futures[w].set_result(workers[w].push()))
            for w in (0, 1)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert all(f.done() for f in futures), f"step {step}: a push did not return"
        for worker, replica in zip(workers, replicas):
            assert worker.expected_staleness == 0.0
            for a, b in zip(replica.parameters(), server.params):
                assert torch.equal(a.detach(), b.detach())
    assert server.staleness == {0: 6}


@pytest.mark.parametrize("bad", ["dc", "", None, True])
def test_bad_compensation_is_named_with_the_allowed_ones(bad: Any) -> None:
    with pytest.raises(
        ValueError, match=r"compensation must be one of \['lookahead', 'none'\], got " + re.escape(repr(bad))
    ):
        check_compensation(bad)
    with pytest.raises(ValueError, match=r"compensation must be one of \['lookahead', 'none'\]"):
        AsyncParameterServerStrategy(compensation=bad)


def _restoring_server(saved: dict[str, Any]) -> ParameterServer:
    """A server built with restoring=True from ``saved``'s model and counters; its optimizer not yet restored."""
    model = _model()
    params = [p for p in model.parameters() if p.requires_grad]
    server = ParameterServer(
        params, list(model.buffers()), torch.optim.SGD(params, lr=LR, momentum=0.9), 2, math.inf, restoring=True
    )
    with torch.no_grad():
        for p, v in zip(server.params, saved["params"]):
            p.copy_(v)
    server.load_state_dict(saved["state"])
    return server


def test_a_restoring_server_holds_pushes_until_restored_and_applies_them_to_the_restored_state() -> None:
    """restoring=True, s = inf: worker 1 pushes before the optimizer's momentum is restored. The push waits
    (pulls are still answered), then is applied with the restored momentum: one SGD step of half the
    learning rate (its share of the batch) from the restored state, as a reference SGD takes it (exact)."""
    trained, _ = _server(2, math.inf, momentum=0.9)
    _push(trained, 0, seed=1).wait()  # momentum buffers to restore
    saved = trained.snapshot()
    server = _restoring_server(saved)
    assert server.pull(0).version == 1
    early = _push(server, 1, seed=2)
    assert not early.done() and server.version == 1
    server.optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))  # it would step the very tensors loaded
    server.restored()
    assert early.done() and early.wait().applied and server.version == 2
    ref = [nn.Parameter(v.clone()) for v in saved["params"]]
    ref_opt = torch.optim.SGD(ref, lr=LR * 0.5, momentum=0.9)
    ref_opt.load_state_dict(
        {**saved["optimizer"], "param_groups": [{**saved["optimizer"]["param_groups"][0], "lr": LR * 0.5}]}
    )
    for p, g in zip(ref, server.layout.views(_grads(server, 2)[0])):
        p.grad = g.clone()
    ref_opt.step()
    for got, want in zip(server.params, ref):
        assert torch.equal(got.detach(), want.detach())


def test_a_restoring_server_sends_the_final_model_only_once_restored() -> None:
    trained, _ = _server(2, math.inf)
    server = _restoring_server(trained.snapshot())
    finals = [server.finish(0), server.finish(1)]
    assert not any(f.done() for f in finals)
    server.restored()
    assert all(f.done() and f.wait().version == 0 for f in finals)


def test_a_step_does_not_depend_on_the_order_its_pushes_arrived_in() -> None:
    """s = 0, K = 3: the same gradients and buffers arriving in another order make the same model bit for
    bit (fp32 sums in arrival order would differ in the last bits; the buffers would be whichever push came
    last), so a synchronous run, and its resume, is reproducible whatever the timing."""
    results = []
    for order in ((0, 1, 2), (2, 0, 1), (1, 2, 0)):
        server, _ = _server(3, 0)
        for step in range(3):
            for w in order:
                grads, present = _grads(server, 10 * step + w)
                buffers = [b + w + 1 for b in server.buffer_layout.flatten(server.buffers)]  # each worker its own
                server.push(w, server._read[w], grads, present, buffers, None)
        assert server.version == 3
        results.append([t.detach().clone() for t in [*server.params, *server.buffers]])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_a_snapshot_holds_no_push_the_server_has_not_applied() -> None:
    """s = 0: worker 0's push waits for worker 1's, so a checkpoint taken meanwhile is the version before it."""
    server, model = _server(2, 0)
    held = _push(server, 0, seed=1)
    snap = server.snapshot()
    assert not held.done() and snap["state"]["version"] == 0 and snap["state"]["pushes"] == 0
    for saved, initial in zip(snap["params"], [p for p in model.parameters() if p.requires_grad]):
        assert torch.equal(saved, initial.detach())


def test_another_number_of_workers_keeps_the_global_clock_and_restarts_the_pushes_per_worker() -> None:
    """A K = 2 checkpoint after 5 pushes (2.5 global steps' worth) resumed with K = 3: 7 pushes (7.5 rounded
    down: global step 2, a third of the next one done, so two more pushes reach step 3), the staleness
    histogram kept, every worker reading the saved version, pushes per worker from 0."""
    server, _ = _server(2, math.inf)
    for i in range(5):
        _push(server, i % 2, seed=i).wait()
    saved = server.snapshot()["state"]
    resumed, _ = _server(3, math.inf)
    resumed.load_state_dict(saved)
    assert (resumed.version, resumed.global_step, resumed.pushes) == (5, 2, 7)
    assert resumed.staleness == server.staleness and resumed.pushes_by_worker == [0, 0, 0]
    assert resumed._read == [5, 5, 5]
    for w in (0, 1):  # two more pushes of K = 3 complete the third global step (the uninterrupted run: one)
        _push(resumed, w, seed=10 + w).wait()
    assert (resumed.pushes, resumed.global_step) == (9, 3)
