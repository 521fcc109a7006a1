"""How a :class:`~lightning_sync.comms.hooks.Call` reaches its hooks when one refuses it: the hooks told before the
refusal hear that it failed, the others hear nothing, and nothing is launched, whether the call has one hook (the
usual case, dispatched without a loop) or several."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_sync import comms

__all__: list[str] = []


class _Hook(comms.CallHook):
    def __init__(self, events: list[tuple[str, ...]], name: str, refuse: bool = False) -> None:
        self.events, self.name, self.refuse = events, name, refuse

    def on_issue(self, call: comms.Call) -> str:
        if self.refuse:
            raise RuntimeError(f"{self.name} refuses")
        self.events.append((self.name, "issue"))
        return f"{self.name}-token"

    def on_complete(self, call: comms.Call, token: Any, ok: bool) -> None:
        self.events.append((self.name, "complete", token, "ok" if ok else "failed"))


def _refused(hooks: list[_Hook]) -> list[bool]:
    ctx = comms.CommContext()
    for hook in hooks:
        ctx.add_hook(hook)
    launched: list[bool] = []
    with pytest.raises(RuntimeError, match="refuses"):
        ctx._issue("barrier", 0, lambda blocking: launched.append(blocking) or [], lambda: None, False)
    return launched


def test_a_lone_hook_that_refuses_is_not_told_of_the_failure() -> None:
    events: list[tuple[str, ...]] = []
    assert _refused([_Hook(events, "only", refuse=True)]) == []
    assert events == []


def test_the_hooks_told_before_a_refusal_hear_that_the_call_failed() -> None:
    events: list[tuple[str, ...]] = []
    assert _refused([_Hook(events, "first"), _Hook(events, "second", refuse=True), _Hook(events, "third")]) == []
    assert events == [("first", "issue"), ("first", "complete", "first-token", "failed")]


def test_every_hook_hears_a_completed_call_with_its_own_token() -> None:
    events: list[tuple[str, ...]] = []
    ctx = comms.CommContext()
    for name in ("first", "second"):
        ctx.add_hook(_Hook(events, name))
    ctx._issue("barrier", 0, lambda blocking: [], lambda: None, False)
    assert events == [
        ("first", "issue"),
        ("second", "issue"),
        ("first", "complete", "first-token", "ok"),
        ("second", "complete", "second-token", "ok"),
    ]


# ------------------------------------------------------------------------------------- a counting hook alone


class _Counter(comms.CountingHook):
    """Records how it is told of calls: begin/end (no Call) or the Call methods."""

    def __init__(self, events: list[tuple[str, ...]], refuse: bool = False) -> None:
        self.events, self.refuse = events, refuse

    def begin(self, op: str, nbytes: int) -> str:
        if self.refuse:
            raise RuntimeError("the counter refuses")
        self.events.append(("begin", op, str(nbytes)))
        return f"{op}-token"

    def end(self, op: str, token: Any, ok: bool) -> None:
        self.events.append(("end", op, token, "ok" if ok else "failed"))

    def on_issue(self, call: comms.Call) -> str:
        self.events.append(("on_issue", call.op))
        return "call-token"

    def on_complete(self, call: comms.Call, token: Any, ok: bool) -> None:
        self.events.append(("on_complete", call.op, token, "ok" if ok else "failed"))


class _Request:
    def __init__(self, events: list[tuple[str, ...]], fail: bool = False) -> None:
        self.events, self.fail = events, fail

    def wait(self) -> None:
        self.events.append(("backend", "wait"))
        if self.fail:
            raise RuntimeError("the request failed")

    def is_completed(self) -> bool:
        return True


def test_a_counting_hook_alone_hears_of_a_synchronous_call_without_a_call() -> None:
    events: list[tuple[str, ...]] = []
    ctx = comms.CommContext(observer=_Counter(events))
    assert ctx._issue("broadcast", 8, lambda blocking: [_Request(events)], lambda: "result", False) == "result"
    assert events == [("begin", "broadcast", "8"), ("backend", "wait"), ("end", "broadcast", "broadcast-token", "ok")]
    events.clear()
    ctx._issue("broadcast", 8, lambda blocking: [_Request(events)], lambda: None, True).wait()  # async: a Call
    assert [e[0] for e in events] == ["on_issue", "backend", "on_complete"]
    events.clear()
    other = ctx.add_hook(_Hook(events, "other"))  # a second hook: synchronous calls build a Call again
    ctx._issue("broadcast", 8, lambda blocking: [], lambda: None, False)
    assert [e[0] for e in events] == ["on_issue", "other", "on_complete", "other"]
    events.clear()
    ctx.remove_hook(other)
    ctx._issue("broadcast", 8, lambda blocking: [], lambda: None, False)
    assert [e[0] for e in events] == ["begin", "end"]


def test_a_counting_hook_hears_a_failed_launch_or_wait_as_failed_and_a_failed_finish_as_completed() -> None:
    events: list[tuple[str, ...]] = []
    ctx = comms.CommContext(observer=_Counter(events))

    def launch(blocking: bool) -> list[Any]:
        raise RuntimeError("the backend refused")

    def finish() -> None:
        raise ValueError("the result could not be made")

    with pytest.raises(RuntimeError, match="the backend refused"):
        ctx._issue("gather", 4, launch, lambda: None, False)
    with pytest.raises(RuntimeError, match="the request failed"):
        ctx._issue("gather", 4, lambda blocking: [_Request(events, fail=True)], lambda: None, False)
    with pytest.raises(ValueError, match="could not be made"):
        ctx._issue("gather", 4, lambda blocking: [], finish, False)
    assert [e[::3] for e in events if e[0] == "end"] == [("end", "failed"), ("end", "failed"), ("end", "ok")]
    events.clear()
    ctx.observer.refuse = True
    launched: list[bool] = []
    with pytest.raises(RuntimeError, match="the counter refuses"):
        ctx._issue("gather", 4, lambda blocking: launched.append(blocking) or [], lambda: None, False)
    assert launched == [] and events == []


def test_commstats_counts_the_same_told_directly_or_through_a_call() -> None:
    def run(extra_hook: bool) -> tuple[Any, ...]:
        now = [0.0]
        stats = comms.CommStats(clock=lambda: now[0])
        ctx = comms.CommContext(observer=stats)
        if extra_hook:  # two hooks: every call builds a Call
            ctx.add_hook(_Hook([], "other"))
        for i in range(3):

            def launch(blocking: bool, i: int = i) -> list[Any]:
                now[0] += 0.25 * (i + 1)  # the call takes a while
                return []

            ctx._issue("all_reduce", 4 * (i + 1), launch, lambda: None, False)
            now[0] += 1.0  # the caller's own work between calls
        work = ctx._issue("all_reduce", 4, lambda blocking: [], lambda: None, True)  # one async call in flight
        now[0] += 2.0
        work.wait()
        return stats.snapshot(), stats.blocked_seconds(), stats.covered_seconds()

    direct, through_a_call = run(extra_hook=False), run(extra_hook=True)
    assert direct == through_a_call
    assert direct[0]["all_reduce"] == comms.OpStats(calls=4, bytes=28, seconds=3.5)  # 0.25 + 0.5 + 0.75 + 2
