"""How the harness starts its ranks: a ``forkserver`` that imports the heavy libraries once.

Ranks are forked by a ``forkserver`` that has imported torch, Lightning and Hydra once (:data:`PRELOAD`),
so a rank starts in a fraction of a second instead of importing them again (seconds each). Each rank is
still a fresh process of its own: it takes the caller's environment, working directory, ``sys.path`` and
stdout/stderr *at the call* (:class:`Inherit`, as a spawned one would), reseeds NumPy's global RNG from the
OS (Python's ``random`` reseeds itself after a fork) and applies ``OMP_NUM_THREADS`` to torch, which the
preloaded torch had read at the server's start (:func:`fresh_process_state`). The server also imports the
project's modules (and whatever the caller names, e.g. the test suite's warm-up of Hydra's override parser), so
a rank runs the code that was on disk when the server started: its process's first run (a test session, a
``bench``).
``LIGHTNING_SYNC_START_METHOD=spawn`` goes back to plain ``spawn`` (every rank imports everything itself).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

__all__ = [
    "PRELOAD",
    "START_METHOD_ENV",
    "Inherit",
    "fresh_process_state",
    "rank_context",
    "wait_until_ready",
    "warm_up",
]

START_METHOD_ENV = "LIGHTNING_SYNC_START_METHOD"
"""Names the start method of the harness's ranks: ``forkserver`` (the default) or ``spawn``."""
PRELOAD = (
    "torch",
    "torch.distributed",
    "numpy",
    "lightning.pytorch",
    "hydra",
    "hydra.utils",
    "omegaconf",
    "sklearn.datasets",  # the digits data of the CLI's default model
    "lightning_sync.cli",
    "lightning_sync.diagnostics",
    "lightning_sync.launch.requeue",
    "lightning_sync.models",
    "lightning_sync.strategies",
    "lightning_sync.sync",
)
"""Modules the forkserver imports once; a module that fails to import is skipped (its rank imports it)."""


# multiprocessing keeps one forkserver per process, so its warm-up state is per process too
_ready = threading.Event()  # the forkserver has forked (and reaped) its first process
_warming: threading.Thread | None = None
_warm_lock = threading.Lock()
_preload = list(PRELOAD)  # and the caller's extra modules (warm_up); read when the server starts


def _noop() -> None:
    pass


def _warm() -> None:
    from multiprocessing import process

    p = rank_context().Process(target=_noop, name="forkserver-warm-up", daemon=True)
    try:
        p.start()
        process._children.discard(p)  # type: ignore[attr-defined] - not a child of any test (active_children)
        p.join()
    finally:
        _ready.set()  # even when it failed: then the ranks' own start reports the error


def warm_up(extra: Sequence[str] = ()) -> None:
    """Start the forkserver and its imports (:data:`PRELOAD`, then ``extra``) in the background, if ranks are
    forked by one.

    Returns at once. A test session calls it before its first test, so the imports overlap collection and
    the other tests instead of counting against the first run's timeout. ``extra`` counts only before the
    server starts: it imports its modules once.
    """
    global _warming
    if os.environ.get(START_METHOD_ENV, "forkserver") != "forkserver":
        return
    with _warm_lock:
        if _warming is None:
            _preload.extend(name for name in extra if name not in _preload)
            _warming = threading.Thread(target=_warm, name="lightning_sync-forkserver-warm-up", daemon=True)
            _warming.start()


def wait_until_ready(deadline: float) -> bool:
    """Block until the forkserver has forked once, or until ``deadline`` (``time.monotonic()``).

    True at once when ranks are spawned; False when the deadline passed first, so that a caller bound by
    its own timeout never hangs on the server's imports.
    """
    if os.environ.get(START_METHOD_ENV, "forkserver") != "forkserver":
        return True
    warm_up()
    if not _ready.wait(max(0.0, deadline - time.monotonic())):
        return False
    assert _warming is not None
    _warming.join()  # the warm-up process is joined: it is no child of any run
    return True


def rank_context() -> Any:
    """The multiprocessing context that starts ranks (see the module docstring's *Start-up*)."""
    method = os.environ.get(START_METHOD_ENV, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_METHOD_ENV} must be one of ['forkserver', 'spawn'], got {method!r}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(_preload))  # takes effect when the server first starts
    return ctx


class Inherit:
    """What a spawned rank would inherit from its caller at the call: the environment and stdout/stderr.

    Pickled while the rank starts, where the file descriptors travel as ``multiprocessing`` passes
    descriptors to a child (the forkserver's own stdout/stderr are the caller's at the server's start).
    """

    def __init__(self) -> None:
        self.env = dict(os.environ)

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        fds = []
        for fd in (1, 2):
            try:
                os.fstat(fd)
            except OSError:
                fds.append(None)
            else:
                fds.append(reduction.DupFd(fd))
        return (Inherited, (self.env, fds))


class Inherited:
    def __init__(self, env: dict[str, str], fds: list[Any]) -> None:
        self.env, self.fds = env, fds

    def apply(self) -> None:
        """In the rank: take the caller's environment and stdout/stderr, as a freshly started process would."""
        for target, fd in zip((1, 2), self.fds, strict=True):
            if fd is not None:
                import sys

                for stream in (sys.stdout, sys.stderr):
                    if stream is not None:
                        stream.flush()
                os.dup2(fd.detach(), target)
        os.environ.clear()
        os.environ.update(self.env)


def fresh_process_state() -> None:
    """After a fork from a preloaded server: what a fresh interpreter would have done at its own imports.

    NumPy's global RNG is reseeded from the OS (a fork copies the server's), torch takes ``OMP_NUM_THREADS``
    (the preloaded torch read the server's at import), and the processes the rank starts itself (a
    DataLoader's workers) get the interpreter's default start method again: ``multiprocessing`` hands its
    children the start method that started them, and a worker started through a forkserver of the rank's own
    imports everything from scratch (about 2 s per worker, every epoch), where a rank of torchrun or Slurm
    forks it.
    """
    import multiprocessing
    import sys

    multiprocessing.set_start_method(None, force=True)  # the default context, as in a fresh interpreter
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        torch = sys.modules["torch"]
        if torch.get_num_threads() != int(threads):
            torch.set_num_threads(int(threads))
