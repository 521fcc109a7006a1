"""Asynchronous parameter server with bounded staleness (stale-synchronous parallel).

The global model and its optimizer live in one place, the :class:`ParameterServer` (Li et al., "Scaling
distributed machine learning with the parameter server", OSDI 2014; the bound is SSP, Ho et al., NIPS
2013, counted in server versions). Workers never meet each other: each one pulls parameters, computes
a gradient on its own data, pushes it, and gets the newest parameters back. Nothing is group-wide,
so a slow worker delays only itself, up to the staleness bound.

Versions and staleness
    The server's *version* V counts the optimizer steps it has applied. A worker's gradient is
    computed on the version it last received, r. Applied at version V, its *staleness* is V - r.
    With bound s (``max_staleness``), the server applies the pending gradients as one step only if
    every other worker that is still running would then stay within the bound, i.e. V + 1 - r_u <= s
    for each running worker u that has not pushed; otherwise the pushes wait (their workers block).
    So no applied gradient is ever staler than s, and nothing deadlocks: the step waits only for
    workers that will push or finish.

    * s = 0 is synchronous training: a step waits for every worker's gradient of the same version
      and applies them together, which is data-parallel SGD step for step.
    * s = inf is fully asynchronous: every push is applied at once (Downpour SGD).
    * In between, a fast worker runs up to s versions ahead of the slowest, then waits for it.

Step rule
    A step applies the *mean* of its pending gradients with the learning rate scaled by the share of the
    global batch they carry, so K pushes are worth one synchronous step; at s = 0 it is exactly synchronous
    SGD, bit for bit however the pushes are timed. See :mod:`lightning_sync.sync.ps.step`.

Global clock and budget
    ``pushes // K`` is the *global step*: the number of synchronous steps' worth of samples applied.
    LR schedulers are stepped on it (:attr:`ParameterServer.on_global_step`), and a ``budget`` of
    global steps stops training: pushes beyond it are discarded and every reply then says ``stop``.

Failure
    A worker that raises reports it (:meth:`ParameterServer.abort`): every waiting and later request
    of every worker then fails with an error naming it. So does an exception in the server's own
    update (the optimizer, clipping, a scheduler on the global clock): every push of that step, every
    push held by the bound, every finish, and every later request fails with an error naming the
    exception, and the model, possibly half-stepped, can no longer be checkpointed. After either,
    :meth:`ParameterServer.wait_stopped` tells the server's host when every worker has reported back,
    so it keeps answering until each one has heard why training stopped. A worker process that dies
    without a word never pushes again: whoever waits on the server calls :meth:`ParameterServer.expire`
    now and then, which fails every request, naming the worker, once the others wait for it and it has
    sent nothing for the timeout. If the server's process dies, every request fails at once. A worker
    that finishes normally (:meth:`ParameterServer.finish`) stops counting against the bound.

Restoring
    A server built with ``restoring=True`` serves pulls but holds every push until
    :meth:`ParameterServer.restored`. Its host restores a checkpoint in stages (the model and counters
    before the server is reachable, the optimizer and LR schedulers after, when Lightning restores
    them), and a worker may push as soon as it has pulled: a push applied before the restore completes
    would step a fresh optimizer and then be overwritten by the restore. Held, it is applied after, to
    the checkpoint's model and optimizer state.

Transport
    Workers reach the server through :mod:`lightning_sync.sync.ps.worker`: directly in the server's
    own process, over ``torch.distributed.rpc`` from other ranks (through
    :mod:`lightning_sync.comms.rpc`, which counts the bytes). Payloads are one flat tensor per dtype,
    staged through host memory (:mod:`lightning_sync.sync.ps.wire`).
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_sync.sync.ps.state import counters_of, restore_counters, snapshot_of
from lightning_sync.sync.ps.step import LR_SCALINGS, Push, apply_step, check_lr_scaling
from lightning_sync.sync.ps.wire import WIRE_DEVICE, FlatLayout, Reply
from lightning_sync.sync.rewritten import check_rewritable

# FlatLayout, Reply: from ps_wire; LR_SCALINGS, check_lr_scaling: from ps_step
__all__ = ["LR_SCALINGS", "FlatLayout", "ParameterServer", "Reply", "check_lr_scaling", "check_staleness"]


def check_staleness(value: Any) -> int | float:
    """``max_staleness`` checked and returned: an int >= 0, or ``math.inf`` for no bound."""
    if isinstance(value, float) and value == math.inf:
        return math.inf
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"max_staleness must be an int >= 0 or math.inf (no bound), got {value!r}")
    return value


class ParameterServer:
    """The global model, its optimizer and the staleness bound (see the module docstring). What of it a
    checkpoint holds, and how that comes back: :mod:`lightning_sync.sync.ps.state`.

    Args:
        params: the trainable parameters as they are now (each tensor once, in a fixed order every
            worker uses too); the server keeps its own copies.
        buffers: the model's buffers (the server keeps those of each step's newest push: computed on the
            newest model, from the highest worker among equals).
        optimizer: the optimizer over ``params``; its param groups are rewritten in place to step the
            server's copies (same object, same hyperparameters: LR schedulers on it keep working).
            ``None`` for a server that only serves pulls (evaluation).
        num_workers: K, the number of workers (>= 1).
        max_staleness: s, an int >= 0 or ``math.inf``.
        budget: stop after this many global steps (``pushes // K``); ``None`` for no limit.
        restoring: hold every push (and the final replies) until :meth:`restored`.

    Attributes:
        staleness: ``Counter`` of staleness -> number of applied gradients.
        pushes_by_worker: applied pushes per worker.
        on_global_step: called with the new global step whenever it advances (under the server lock).
        schedulers: objects with ``state_dict()`` saved in :meth:`snapshot` (the LR schedulers).
        lock: guards every read and write of the server's state.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer | None,
        num_workers: int,
        max_staleness: float,
        budget: int | None = None,
        lr_scaling: str = "linear",
        restoring: bool = False,
    ) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ValueError(f"budget must be None or an int >= 0, got {budget!r}")
        self.max_staleness = check_staleness(max_staleness)
        self.lr_scaling = check_lr_scaling(lr_scaling)
        self.num_workers, self.budget = num_workers, budget
        self.params = [nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in params]
        self.buffers = [b.detach().clone() for b in buffers]
        self.layout = FlatLayout(self.params, device=WIRE_DEVICE)
        self.buffer_layout = FlatLayout(self.buffers, device=WIRE_DEVICE)
        self.optimizer = optimizer
        if optimizer is not None:
            self._repoint(optimizer, params)
        self.lock = threading.Lock()
        self._changed = threading.Condition(self.lock)  # a worker finished or reported a failure
        self.version = 0
        self.pushes = 0
        self.discarded = 0
        self.global_step = 0
        self.staleness: Counter[int] = Counter()
        self.pushes_by_worker = [0] * num_workers
        self.on_global_step: Callable[[int], None] | None = None
        self.schedulers: list[Any] = []
        self._read = [0] * num_workers  # every worker starts computing on version 0
        self._heard = [time.monotonic()] * num_workers  # each worker's last request
        self._done = [False] * num_workers
        self._pending: list[Push] = []
        self._finishing: list[torch.futures.Future] = []
        self._error: str | None = None
        self._broken = False  # the server's own update raised: the model may be half-stepped
        self._reported: set[int] = set()  # workers that reported a failure (abort)
        self._released = False  # every worker finished and has the final model
        self._restoring = restoring  # pushes wait for restored()

    def _repoint(self, optimizer: torch.optim.Optimizer, live: Sequence[torch.Tensor]) -> None:
        check_rewritable(optimizer, "ParameterServer")
        copies = {id(p): c for p, c in zip(live, self.params)}
        for group in optimizer.param_groups:
            group["params"] = [copies.get(id(p), p) for p in group["params"]]  # frozen ones stay as they are

    # ------------------------------------------------------------------ requests
    @property
    def error(self) -> str | None:
        """Why training stopped (a worker's failure or the server's own), or ``None``."""
        return self._error

    @property
    def stopped(self) -> bool:
        """Whether the budget is spent."""
        return self.budget is not None and self.global_step >= self.budget

    def pull(self, worker: int) -> Reply:
        """The newest parameters; the worker computes on this version from now on."""
        with self.lock:
            self._check_worker(worker)
            self._read[worker] = self.version
            return self._reply()

    def push(
        self,
        worker: int,
        read_version: int,
        grads: list[torch.Tensor],
        present: list[bool],
        buffers: list[torch.Tensor],
        clip: tuple[str, float] | None = None,
    ) -> torch.futures.Future:
        """Queue a gradient computed on ``read_version``; the future completes with the :class:`Reply`
        once it has been applied (or discarded because the budget is spent)."""
        item = Push(worker, read_version, grads, present, buffers, clip)
        with self.lock:
            self._check_worker(worker)
            if self.optimizer is None:
                raise RuntimeError("this ParameterServer has no optimizer (it only serves pulls)")
            if read_version != self._read[worker]:
                raise ValueError(
                    f"worker {worker} pushed a gradient of version {read_version}, but it last "
                    f"received version {self._read[worker]}"
                )
            if len(present) != len(self.params):
                raise ValueError(
                    f"worker {worker} sent {len(present)} presence flags for {len(self.params)} parameters"
                )
            self._pending.append(item)
            done = self._try_step()
        self._complete(done)
        return item.future

    def finish(self, worker: int) -> torch.futures.Future:
        """The worker is done training; the future completes with the final :class:`Reply` once every
        worker has finished (so all of them end with the same model)."""
        future: torch.futures.Future = torch.futures.Future()
        with self.lock:
            self._check_worker(worker)
            self._done[worker] = True
            self._finishing.append(future)
            done = self._try_step() + self._release()  # this worker no longer holds anyone back
            self._changed.notify_all()
        self._complete(done)
        return future

    def restored(self) -> None:
        """The host has restored everything: apply the pushes that waited (calling it again does nothing)."""
        with self.lock:
            self._restoring = False
            done = self._try_step() + self._release()
        self._complete(done)

    def _release(self) -> list[tuple[torch.futures.Future, Any]]:
        """Once every worker has finished: the final model for all of them."""
        if self._error is not None or self._restoring or not all(self._done):
            return []
        reply = self._reply()
        done = [(f, reply) for f in self._finishing]
        self._finishing, self._released = [], True
        return done

    def abort(self, worker: int, message: str) -> None:
        """``worker`` failed (or heard that training stopped): fail every waiting request, and every
        later one, with an error naming the first failure."""
        with self.lock:
            done = self._fail(f"parameter server: worker {worker} failed, so training stopped: {message}")
            self._reported.add(worker)
            self._changed.notify_all()
        self._complete(done)

    def expire(self, timeout: float) -> bool:
        """Fail every waiting request, and every later one, if a worker the server waits for (one that has not
        finished nor reported a failure) has sent nothing for ``timeout`` seconds: its process is presumably lost
        (a SIGKILL says nothing). Whoever waits on the server calls it now and then; True if it failed them."""
        now = time.monotonic()
        with self.lock:
            waiting = {p.worker for p in self._pending}  # a worker whose push is held waits on the server
            silent = [
                w
                for w in range(self.num_workers)
                if not self._done[w]
                and w not in self._reported
                and w not in waiting
                and now - self._heard[w] >= timeout
            ]
            if self._error is not None or not silent or not (self._pending or self._finishing):
                return False
            names = ", ".join(str(w) for w in silent)
            done = self._fail(
                f"parameter server: worker {names} sent nothing for {timeout:g} s while the others waited for it "
                f"(its process lost?), so training stopped"
            )
            self._changed.notify_all()
        self._complete(done)
        return True

    def wait_stopped(self, timeout: float) -> bool:
        """Whether every worker has stopped, waiting up to ``timeout`` seconds: each one has reported a
        failure (:meth:`abort`: it heard why training stopped), or all finished normally. A worker whose
        process died without a word never reports, hence the bound."""
        with self._changed:
            return self._changed.wait_for(
                lambda: self._released or len(self._reported) == self.num_workers, timeout=timeout
            )

    def _fail(self, error: str, also: Sequence[Push] = ()) -> list[tuple[torch.futures.Future, Any]]:
        """Keep the first ``error``; every waiting request (and the pushes ``also`` taken off the queue)
        is answered with it."""
        if self._error is None:
            self._error = error
        waiting = [p.future for p in [*also, *self._pending]] + self._finishing
        self._pending, self._finishing = [], []
        return [(f, RuntimeError(self._error)) for f in waiting]

    def _check_worker(self, worker: int) -> None:
        if self._error is not None:
            raise RuntimeError(self._error)
        if isinstance(worker, bool) or not isinstance(worker, int) or not 0 <= worker < self.num_workers:
            raise ValueError(f"worker must be an int in [0, {self.num_workers - 1}], got {worker!r}")
        if self._done[worker]:
            raise RuntimeError(f"worker {worker} already finished")
        self._heard[worker] = time.monotonic()

    @staticmethod
    def _complete(done: list[tuple[torch.futures.Future, Any]]) -> None:
        for future, outcome in done:  # outside the lock: completing may send the reply right away
            if isinstance(outcome, Exception):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

    # ------------------------------------------------------------------ the step
    def _blocked(self) -> bool:
        """Whether applying a step now would push some running worker's next gradient past the bound."""
        waiting = {p.worker for p in self._pending}
        return any(
            not self._done[u] and u not in waiting and self.version + 1 - self._read[u] > self.max_staleness
            for u in range(self.num_workers)
        )

    def _try_step(self) -> list[tuple[torch.futures.Future, Any]]:
        if self._restoring or not self._pending:
            return []
        if self.stopped:
            dropped, self._pending = self._pending, []
            self.discarded += len(dropped)
            for p in dropped:
                self._read[p.worker] = self.version
            reply = self._reply(applied=False)
            return [(p.future, reply) for p in dropped]
        if self._blocked():
            return []
        take = self._pending
        if self.budget is not None:
            room = self.budget * self.num_workers - self.pushes
            take, dropped = take[:room], take[room:]
        else:
            dropped = []
        self._pending = []
        target = self.version + 1
        try:
            self._step(take)
        except Exception as err:  # noqa: BLE001 - every worker must hear of it, or those waiting wait forever
            self._broken = True
            return self._fail(
                f"parameter server: its update to version {target} failed, so training stopped: "
                f"{type(err).__name__}: {err}",
                also=take + dropped,
            )
        self.discarded += len(dropped)
        reply = self._reply()
        out = [(p.future, reply) for p in take]
        if dropped:
            lost = self._reply(applied=False)
            out += [(p.future, lost) for p in dropped]
        for p in take + dropped:
            self._read[p.worker] = self.version
        return out

    def _step(self, take: list[Push]) -> None:
        """Apply ``take`` as one optimizer step (:func:`~lightning_sync.sync.ps.step.apply_step`), then count it."""
        assert self.optimizer is not None
        take = apply_step(take, self.params, self.layout, self.optimizer, self.num_workers, self.lr_scaling)
        self.buffer_layout.copy_into(take[-1].buffers, self.buffers)  # the newest model's push (the last worker's)
        for p in take:
            self.staleness[self.version - p.read_version] += 1
            self.pushes_by_worker[p.worker] += 1
        self.version += 1
        self.pushes += len(take)
        while self.pushes // self.num_workers > self.global_step:
            self.global_step += 1
            if self.on_global_step is not None:
                self.on_global_step(self.global_step)

    def _reply(self, applied: bool = True) -> Reply:
        lrs = [float(g["lr"]) for g in self.optimizer.param_groups] if self.optimizer is not None else []
        return Reply(
            self.version,
            self.layout.flatten(self.params),
            self.buffer_layout.flatten(self.buffers),
            lrs,
            self.global_step,
            self.stopped,
            applied,
            dict(self.staleness),
        )

    # ------------------------------------------------------------------ checkpoints (their form: ps/state.py)
    def snapshot(self) -> dict[str, Any]:
        """One consistent copy of the global model, optimizer state and counters (taken under the lock;
        :func:`~lightning_sync.sync.ps.state.snapshot_of`)."""
        with self.lock:
            if self._broken:
                raise RuntimeError(f"the parameter server's state cannot be checkpointed: {self._error}")
            return snapshot_of(self)

    def state_dict(self) -> dict[str, Any]:
        """Counters (version, pushes, global step, staleness histogram); call under the lock or when idle."""
        return counters_of(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters of :meth:`state_dict` (:func:`~lightning_sync.sync.ps.state.restore_counters`;
        the model and optimizer are restored separately). Every worker restarts on the restored version."""
        with self.lock:
            restore_counters(self, state)
            self._read = [self.version] * self.num_workers
