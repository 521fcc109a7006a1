"""Single-process tests of the call hooks of a CommContext (lightning_sync.comms.hooks).

The dispatch point is driven with launches that stand in for the backend (no process group), so the order in which
hooks hear of a call, and what CommStats makes of it on a fixed clock, are checked exactly; the real collectives
through the same hooks are in tests/multiprocess/ (test_collectives, test_watchdog, test_zero_engine).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_sync import comms

__all__: list[str] = []


class _Recorder(comms.CallHook):
    """Every event it hears, in order, as ``(event, op, ...)``."""

    def __init__(self, events: list[tuple[Any, ...]], name: str = "rec") -> None:
        self.events, self.name = events, name

    def on_issue(self, call: comms.Call) -> str:
        self.events.append((self.name, "issue", call.op, call.seq, call.nbytes, call.detail, call.async_op))
        return f"token-{call.seq}"

    def on_launched(self, call: comms.Call, token: Any, handles: Any) -> None:
        self.events.append((self.name, "launched", call.op, token, len(handles)))

    def on_wait(self, call: comms.Call, token: Any) -> None:
        self.events.append((self.name, "wait", call.op, token))

    def on_complete(self, call: comms.Call, token: Any, ok: bool) -> None:
        self.events.append((self.name, "complete", call.op, token, ok))

    def record(self, op: str, nbytes: int, seconds: float = 0.0, calls: int = 1) -> None:
        self.events.append((self.name, "record", op, nbytes, seconds, calls))


class _Waiter(_Recorder):
    """A hook that waits for the backend requests itself (as the hang watchdog does), and may refuse calls."""

    waits = True

    def __init__(self, events: list[tuple[Any, ...]], refuse: bool = False) -> None:
        super().__init__(events, "waiter")
        self.refuse = refuse

    def on_issue(self, call: comms.Call) -> str:
        if self.refuse:
            raise RuntimeError("aborted by the test")
        return super().on_issue(call)

    def wait(self, token: Any, handle: Any) -> None:
        self.events.append((self.name, "waits for", token))
        handle.wait()


class _Handle:
    """A backend request that is complete once waited for; ``on_wait`` runs inside its wait (the clock moves)."""

    def __init__(self, events: list[tuple[Any, ...]], on_wait: Any = None) -> None:
        self.events, self.on_wait, self.done = events, on_wait, False

    def wait(self) -> None:
        self.events.append(("backend", "wait"))
        if self.on_wait is not None:
            self.on_wait()
        self.done = True

    def is_completed(self) -> bool:
        return self.done


def _issue(ctx: comms.CommContext, handles: list[Any], async_op: bool, op: str = "all_reduce") -> Any:
    result = torch.ones(1)
    return ctx._issue(op, 4, lambda blocking: handles, lambda: result, async_op, like=result, detail="sum")


def test_a_hook_hears_issue_launch_wait_and_completion_in_order() -> None:
    events: list[tuple[Any, ...]] = []
    ctx = comms.CommContext()
    ctx.add_hook(_Recorder(events))
    _issue(ctx, [], async_op=False)  # a synchronous call that ran within its launch: issued, then complete
    assert events == [
        ("rec", "issue", "all_reduce", 1, 4, "sum", False),
        ("rec", "complete", "all_reduce", "token-1", True),
    ]
    events.clear()
    _issue(ctx, [_Handle(events)], async_op=False)  # synchronous with a request: waited for directly
    assert events == [
        ("rec", "issue", "all_reduce", 2, 4, "sum", False),
        ("rec", "launched", "all_reduce", "token-2", 1),
        ("backend", "wait"),
        ("rec", "complete", "all_reduce", "token-2", True),
    ]
    events.clear()
    work = _issue(ctx, [_Handle(events)], async_op=True)
    assert events == [
        ("rec", "issue", "all_reduce", 3, 4, "sum", True),
        ("rec", "launched", "all_reduce", "token-3", 1),
    ]
    events.clear()
    work.wait()
    work.wait()  # a second wait tells nobody anything
    assert events == [
        ("rec", "wait", "all_reduce", "token-3"),
        ("backend", "wait"),
        ("rec", "complete", "all_reduce", "token-3", True),
    ]


def test_the_waiting_hook_goes_first_waits_for_the_requests_and_may_refuse_a_call() -> None:
    events: list[tuple[Any, ...]] = []
    ctx = comms.CommContext(observer=comms.CommStats())
    waiter = ctx.add_hook(_Waiter(events))
    ctx.add_hook(_Recorder(events))
    assert ctx.hooks == (waiter, ctx.observer, ctx.hooks[2])  # the waiting hook first, then in the order added
    launched = []
    handle = _Handle(events)
    ctx._issue("barrier", 0, lambda blocking: launched.append(blocking) or [handle], lambda: None, False)
    assert launched == [False]  # a hook waits: even a synchronous call is launched asynchronously
    assert [e[:2] for e in events] == [
        ("waiter", "issue"),
        ("rec", "issue"),
        ("waiter", "launched"),
        ("rec", "launched"),
        ("waiter", "waits for"),
        ("backend", "wait"),
        ("waiter", "complete"),
        ("rec", "complete"),
    ]
    assert ctx.observer["barrier"].calls == 1
    events.clear()
    waiter.refuse = True
    with pytest.raises(RuntimeError, match="aborted by the test"):
        ctx._issue("barrier", 0, lambda blocking: launched.append(blocking) or [], lambda: None, False)
    assert events == [] and launched == [False]  # refused first: nothing launched, no other hook told
    assert ctx.observer["barrier"].calls == 1  # the refused call is not counted


def test_a_failed_launch_completes_the_call_as_failed_and_counts_no_seconds() -> None:
    events: list[tuple[Any, ...]] = []
    now = [5.0]
    ctx = comms.CommContext(observer=comms.CommStats(clock=lambda: now[0]))
    ctx.add_hook(_Recorder(events))

    def launch(blocking: bool) -> list[Any]:
        now[0] = 6.0
        raise RuntimeError("the backend refused")

    with pytest.raises(RuntimeError, match="the backend refused"):
        ctx._issue("broadcast", 8, launch, lambda: None, True)
    assert [e[1:] for e in events] == [
        ("issue", "broadcast", 1, 8, "", True),
        ("complete", "broadcast", "token-1", False),
    ]
    stats = ctx.observer
    assert stats["broadcast"] == comms.OpStats(calls=1, bytes=8, seconds=0.0)  # issued, never completed
    assert stats.blocked_seconds() == 1.0 and stats.covered_seconds() == 0.0  # blocked in the launch, nothing left


class _Diagnosing(_Waiter):
    """A waiting hook that names the cause of a failed launch, as the hang watchdog does for a lost peer."""

    def launch_failed(self, token: Any, error: BaseException) -> BaseException | None:
        self.events.append((self.name, "diagnoses", token, str(error)))
        return ConnectionError(f"diagnosed: {error}") if isinstance(error, RuntimeError) else None


def test_a_failed_launch_raises_the_waiting_hooks_diagnosis_before_the_hooks_hear_it_failed() -> None:
    """gloo's send writes in its launch and fails there once the peer is gone: the waiting hook (the watchdog)
    turns that into its diagnosis, as it does a failed wait; the original error is the cause."""
    events: list[tuple[Any, ...]] = []
    ctx = comms.CommContext()
    ctx.add_hook(_Diagnosing(events))
    ctx.add_hook(_Recorder(events))

    def launch(blocking: bool) -> list[Any]:
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(ConnectionError, match="diagnosed: Connection closed by peer") as raised:
        ctx._issue("all_gather", 8, launch, lambda: None, True)
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert [e[:2] for e in events] == [
        ("waiter", "issue"),
        ("rec", "issue"),
        ("waiter", "diagnoses"),
        ("waiter", "complete"),
        ("rec", "complete"),
    ]
    assert events[-1][-1] is False  # heard as failed

    def refused(blocking: bool) -> list[Any]:
        raise ValueError("not a backend failure")

    with pytest.raises(ValueError, match="not a backend failure"):  # no diagnosis: the error itself
        ctx._issue("all_gather", 8, refused, lambda: None, True)


def test_commstats_as_a_hook_accounts_blocked_and_covered_time_on_a_fixed_clock() -> None:
    now = [0.0]
    stats = comms.CommStats(clock=lambda: now[0])
    ctx = comms.CommContext(observer=stats)

    def at(t: float) -> Any:
        return lambda: now.__setitem__(0, t)

    # synchronous, issued at 0 and complete at 2 (its request waited for inside): 2 s blocked, an op second each
    _issue(ctx, [_Handle([], on_wait=at(2.0))], async_op=False)
    assert stats["all_reduce"] == comms.OpStats(calls=1, bytes=4, seconds=2.0)
    assert stats.blocked_seconds() == 2.0 and stats.covered_seconds() == 0.0
    # asynchronous: issued at 10, launched by 11, the caller computes until 15, waits until 16
    now[0] = 10.0
    handle = _Handle([], on_wait=at(16.0))

    def launch(blocking: bool) -> list[Any]:
        now[0] = 11.0
        return [handle]

    work = ctx._issue("reduce_scatter", 16, launch, lambda: None, True)
    now[0] = 15.0
    work.wait()
    assert stats["reduce_scatter"] == comms.OpStats(calls=1, bytes=16, seconds=6.0)  # issue to completion
    assert stats.blocked_seconds() == 2.0 + 1.0 + 1.0  # the launch and the wait, not the compute between
    assert stats.covered_seconds() == 4.0  # 11 to 15: compute with the call in flight


def test_observer_is_one_of_the_hooks_and_assigning_replaces_it() -> None:
    first, second = comms.CommStats(), comms.CommStats()
    ctx = comms.CommContext(observer=first)
    assert ctx.hooks == (first,) and ctx.observer is first
    ctx.observer = second
    assert ctx.hooks == (second,) and ctx.observer is second
    ctx.observer = None
    assert ctx.hooks == () and ctx.observer is None and ctx.watchdog is None
    assert _issue(ctx, [], async_op=False).item() == 1.0  # no hook: the bare path
    assert first.snapshot() == {} and second.snapshot() == {}


def test_record_reaches_every_hook() -> None:
    events: list[tuple[Any, ...]] = []
    ctx = comms.CommContext(observer=comms.CommStats())
    ctx.add_hook(_Recorder(events))
    ctx.record("codec", 0, 1.5, calls=2)
    assert ctx.observer["codec"] == comms.OpStats(calls=2, bytes=0, seconds=1.5)
    assert events == [("rec", "record", "codec", 0, 1.5, 2)]
    comms.CommContext().record("codec", 0, 1.0)  # no hook: nothing to tell


def test_add_and_remove_hook_refuse_what_they_cannot_do() -> None:
    ctx = comms.CommContext()
    with pytest.raises(ValueError, match="must be a lightning_sync.comms.hooks.CallHook, got 'stats'"):
        ctx.add_hook("stats")  # type: ignore[arg-type]
    hook = ctx.add_hook(_Recorder([]))
    with pytest.raises(ValueError, match="already a hook of this context"):
        ctx.add_hook(hook)
    ctx.add_hook(_Waiter([]))
    with pytest.raises(ValueError, match="waits for backend requests, and so does another hook"):
        ctx.add_hook(_Waiter([]))
    ctx.remove_hook(hook)
    with pytest.raises(ValueError, match="is not a hook of this context"):
        ctx.remove_hook(hook)


def test_begin_job_reaches_every_hook() -> None:
    stats = comms.CommStats()
    ctx = comms.CommContext(observer=stats)
    stats.record("send", 3)
    ctx.begin_job()
    assert stats.snapshot() == {}
