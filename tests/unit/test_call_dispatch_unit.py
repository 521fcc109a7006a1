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
