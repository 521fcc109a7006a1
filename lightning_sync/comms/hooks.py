"""Call hooks: what measures or watches the collectives of a :class:`~lightning_sync.comms.context.CommContext`.

A context holds a list of hooks (``ctx.hooks``; :meth:`~lightning_sync.comms.context.CommContext.add_hook`).
Every collective it issues is described once by a :class:`Call` and shown to each hook in turn:

1. :meth:`CallHook.on_issue` before the backend call is launched; what it returns is the hook's *token* for this
   call, handed back to the hook's later methods (raising refuses the call: the hang watchdog raises an abort);
2. :meth:`CallHook.on_launched` once the launch returned backend requests, or left an asynchronous call in flight
   (a synchronous call is still blocking the caller then; one that ran within its launch skips this step);
3. :meth:`CallHook.on_wait` when the caller starts waiting for an asynchronous call;
4. :meth:`CallHook.on_complete` when the call completed (or failed).

A hook whose :attr:`CallHook.waits` is true also waits for the backend requests itself (:meth:`CallHook.wait`),
so that a hang can be interrupted; the context then launches even a synchronous call asynchronously. Local work
that is not a backend call (a codec's arithmetic, a written-out algorithm's own entry, a remote call's reply)
reaches every hook through :meth:`CallHook.record` (``ctx.record``).

A :class:`CountingHook` that is its context's only hook hears of a synchronous call through
:meth:`CountingHook.begin` and :meth:`CountingHook.end` instead, given the op name and bytes: no :class:`Call` is
built for it.

:class:`~lightning_sync.comms.stats.CommStats` (counts and times, a counting hook) and
:class:`~lightning_sync.comms.watchdog.Watchdog` (hang detection) are the two hooks of the package. With no hook
attached, a call builds no :class:`Call`, reads no clock and takes no lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = ["Call", "CallHook", "CountingHook"]

T = TypeVar("T")


class CallHook:
    """The base of a call hook: every method does nothing, so a hook overrides only what it needs.

    A hook is shown the calls of every thread that issues through its context, so one that keeps state must
    guard it (both hooks of the package take a lock)."""

    waits = False
    """True for a hook that waits for the backend requests itself (:meth:`wait`); at most one per context."""

    def on_issue(self, call: Call) -> Any:
        """``call`` is about to be launched; returns this hook's token for it (raise to refuse the call)."""
        return None

    def on_launched(self, call: Call, token: Any, handles: Sequence[Any]) -> None:
        """The launch returned ``handles``, the backend requests (none for an asynchronous call that ran within its
        launch); not called for a synchronous call that did."""

    def on_wait(self, call: Call, token: Any) -> None:
        """The caller starts waiting for an asynchronous call (a synchronous one waits from its issue on)."""

    def wait(self, token: Any, handle: Any) -> None:
        """Wait for one backend request of the call (only called on a hook whose :attr:`waits` is true)."""
        handle.wait()

    def launch_failed(self, token: Any, error: BaseException) -> BaseException | None:
        """The call's launch raised ``error`` (only called on a hook whose :attr:`waits` is true): the error to raise
        in its place, as a failed wait would be diagnosed (a send can fail in its launch, when the peer is gone),
        or None for ``error`` itself."""
        return None

    def on_complete(self, call: Call, token: Any, ok: bool) -> None:
        """The call completed (``ok``), or its launch or wait raised (not ``ok``)."""

    def record(self, op: str, nbytes: int, seconds: float = 0.0, calls: int = 1) -> None:
        """``calls`` entries of ``op`` that are not backend calls: ``nbytes`` counted, ``seconds`` of local work."""

    def begin_job(self) -> None:
        """A new job starts on the context: forget what the previous one left (calls in flight included)."""


class CountingHook(CallHook):
    """A hook that needs nothing of a synchronous call but its op name and bytes, and is told of one by
    :meth:`begin` and :meth:`end`: when it is its context's only hook, a synchronous call reaches it that way
    without a :class:`Call` being built. On a 4-byte all-reduce, which is all latency, the Call and its dispatch
    cost more than a hook's own counting (``docs/benchmarks.md``, "Per-call overhead of the collectives layer").
    Its :meth:`on_issue` and :meth:`on_complete` must do for a synchronous call what :meth:`begin` and :meth:`end`
    do."""

    def begin(self, op: str, nbytes: int) -> Any:
        """A synchronous call of ``op`` moving ``nbytes`` is about to be launched; returns the hook's token for it
        (raise to refuse the call)."""
        raise NotImplementedError

    def end(self, op: str, token: Any, ok: bool) -> None:
        """The synchronous call :meth:`begin` gave ``token`` for completed (``ok``), or its launch or wait raised
        (not ``ok``)."""
        raise NotImplementedError


class Call:
    """One collective as its hooks see it, built by the context's dispatch point only when hooks are attached (and
    not for a synchronous call whose only hook is a :class:`CountingHook`).

    ``op`` carries the scope prefixes (``"intra_node/reduce"``); ``seq`` counts the calls on ``group_name``
    (point-to-point apart, ``peer`` being the other global rank). ``like`` (the tensor whose dtype and shape every
    rank passes alike), ``detail`` (reduce op, root rank) and ``label`` (what the caller reduces, e.g. a logged
    key) complete the call's signature for the hang watchdog.
    """

    __slots__ = (
        "async_op",
        "detail",
        "group",
        "group_name",
        "hooks",
        "label",
        "like",
        "nbytes",
        "op",
        "peer",
        "seq",
        "tokens",
    )

    def __init__(
        self,
        hooks: Sequence[CallHook],
        op: str,
        seq: int,
        group_name: str,
        group: dist.ProcessGroup | None,
        peer: int | None,
        nbytes: int,
        like: torch.Tensor | None,
        detail: str,
        label: str | None,
        async_op: bool,
    ) -> None:
        self.hooks = hooks
        self.op = op
        self.seq = seq
        self.group_name = group_name
        self.group = group
        self.peer = peer
        self.nbytes = nbytes
        self.like = like
        self.detail = detail
        self.label = label
        self.async_op = async_op
        self.tokens: Sequence[Any] = ()  # the tokens of the hooks told so far, in their order (set by issue)

    def issue(self) -> None:
        """Show the call to every hook; if one refuses it, the hooks already told see it fail."""
        hooks = self.hooks
        if len(hooks) == 1:  # the usual case, one observer: no loop (a refusal leaves no hook told)
            self.tokens = [hooks[0].on_issue(self)]
            return
        tokens: list[Any] = []
        self.tokens = tokens
        try:
            for hook in hooks:
                tokens.append(hook.on_issue(self))
        except BaseException:
            self.complete(ok=False)
            raise

    def launched(self, handles: Sequence[Any]) -> None:
        for hook, token in zip(self.hooks, self.tokens):
            hook.on_launched(self, token, handles)

    def wait(self, handles: Sequence[Any]) -> None:
        """Wait for ``handles``: by the waiting hook when there is one, else directly. An asynchronous call's
        hooks are told first that the caller now waits."""
        if self.async_op:
            for hook, token in zip(self.hooks, self.tokens):
                hook.on_wait(self, token)
        if not handles:
            return
        for hook, token in zip(self.hooks, self.tokens):
            if hook.waits:
                for h in handles:
                    hook.wait(token, h)
                return
        for h in handles:
            h.wait()

    def launch_failed(self, error: BaseException) -> BaseException:
        """What to raise for a launch that raised ``error``: the waiting hook's diagnosis, if it has one."""
        for hook, token in zip(self.hooks, self.tokens):
            if hook.waits:
                return hook.launch_failed(token, error) or error
        return error

    def settle(self, handles: Sequence[Any], finish: Callable[[], T]) -> T:
        """Wait for ``handles`` (:meth:`wait`), make the result with ``finish`` and tell the hooks the call
        completed; once the backend requests completed they hear so, even if ``finish`` raises."""
        try:
            if handles or self.async_op:  # else a synchronous call already ran in its launch
                self.wait(handles)
        except BaseException:
            self.complete(ok=False)
            raise
        try:
            return finish()
        finally:
            self.complete(ok=True)

    def complete(self, ok: bool) -> None:
        tokens = self.tokens
        if len(tokens) == 1:  # one hook told (the only one, or the one before a refusal): no loop
            self.hooks[0].on_complete(self, tokens[0], ok)
            return
        for hook, token in zip(self.hooks, tokens):
            hook.on_complete(self, token, ok)
