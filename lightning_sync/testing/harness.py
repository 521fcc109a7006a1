"""Run a function on N ranks, each in its own spawned process with a real gloo process group.

The harness is what every multi-process test (and benchmark) stands on, so it promises three things:

* **It never hangs.** A hard ``timeout`` bounds the whole run. When it passes, the parent sends
  SIGUSR2 to every stuck rank, whose ``faulthandler`` dumps the Python stack of every thread, so the
  error shows *where* each rank was stuck; then it kills every child and raises
  :class:`DistributedTimeoutError`. A rank whose function returned stays connected until all have
  returned, so a rank that skipped a collective shows up as its peers stuck in it.
* **Failures name the rank.** An exception in any rank is re-raised in the caller as
  :class:`DistributedRankError` carrying that rank's traceback; the other ranks are killed at once
  instead of waiting for their collectives to time out.
* **Nothing leaks.** Every rank leads its own process group, and on every path the whole group is
  killed (processes a rank started itself included) and joined; the rendezvous store lives in the
  parent (port chosen by the OS, so there is no free-port race), and the parent's environment is
  never modified - the rank variables are set only inside the children.

With ``process_group=False`` the ranks get the environment but no default process group: code that
must not have one (the asynchronous parameter server talks over RPC only) or that starts its own
processes (Hogwild) runs as it would under a launcher. Any rendezvous it does through ``env://``
(``torch.distributed.rpc``, or Lightning creating a process group itself) joins the parent's store as
a client, as under torchrun (``TORCHELASTIC_USE_AGENT_STORE``).

Results travel back through ``torch.save`` bytes, so tensors come back as ordinary CPU tensors.

**Start-up.** Ranks are forked by a preloaded ``forkserver`` (:mod:`~lightning_sync.testing.startup`), each
still a fresh process that takes the caller's environment and stdout/stderr at the call.
"""

from __future__ import annotations

import faulthandler
import io
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from lightning_sync.testing.startup import (
    PRELOAD,
    START_METHOD_ENV,
    Inherit,
    Inherited,
    fresh_process_state,
    rank_context,
    wait_until_ready,
)

__all__ = [
    "DistributedRankError",
    "DistributedTimeoutError",
    "run_distributed",
]

_DUMP_SIGNAL = signal.SIGUSR2  # the parent sends it to a stuck rank, whose faulthandler dumps all stacks
_GRACE_S = 1.0  # after a first failure, how long to collect other ranks' reports before choosing the cause
_DONE_KEY, _ALL_DONE_KEY = "lightning_sync/harness/done", "lightning_sync/harness/all_done"


class DistributedRankError(RuntimeError):
    """A rank raised (or died); ``rank`` and ``remote_traceback`` say which and where."""

    def __init__(self, rank: int, remote_traceback: str) -> None:
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")
        self.rank = rank
        self.remote_traceback = remote_traceback


class DistributedTimeoutError(TimeoutError):
    """The run did not finish within its timeout; the message holds each stuck rank's stacks."""


def _encode(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _decode(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _child(
    job: bytes,
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    pg_timeout_s: float,
    stack_file: str,
    env: Mapping[str, str],
    results: Any,
    process_group: bool = True,
    inherit: Inherited | None = None,
) -> None:
    if inherit is not None:
        inherit.apply()
    # The handler is in place before the (possibly slow) unpickling of the job. The file appears
    # under its final name only once the handler is registered: the parent signals only ranks
    # whose file exists, since SIGUSR2 would otherwise terminate the process.
    dump = open(stack_file + ".tmp", "w")  # noqa: SIM115 - must outlive this frame for faulthandler
    faulthandler.register(_DUMP_SIGNAL, file=dump, all_threads=True)
    os.setpgrp()  # this rank leads a process group: the parent kills it with everything it started
    os.rename(stack_file + ".tmp", stack_file)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    if not process_group:
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # env:// rendezvous: a client of the parent's store
    os.environ.update(env)
    fresh_process_state()  # a spawned rank, too, would hand its start method to its DataLoader's workers
    try:
        fn, args, kwargs = pickle.loads(job)
        import torch
        import torch.distributed as dist

        if backend == "nccl":  # one GPU per rank, as NCCL requires
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore(
            "127.0.0.1", port, world_size + 1, is_master=False, timeout=timedelta(seconds=pg_timeout_s)
        )
        if process_group:
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
            )
        out = fn(rank, world_size, *args, **kwargs)
        results.put((rank, "ok", time.time(), _encode(out)))
        # Stay connected until every rank has returned: a rank that skipped a collective then shows
        # up as a peer stuck in it (a timeout with stacks), not as a "connection reset" elsewhere.
        if store.add(_DONE_KEY, 1) == world_size:
            store.set(_ALL_DONE_KEY, "1")
        store.wait([_ALL_DONE_KEY])
        if dist.is_initialized():  # ours, or one that fn's code created itself
            dist.destroy_process_group()
    except BaseException:  # report first, then tear down: the parent names the rank that failed first
        results.put((rank, "error", time.time(), traceback.format_exc()))
    finally:
        faulthandler.unregister(_DUMP_SIGNAL)
        dump.close()


def _kill_all(procs: list[Any]) -> None:
    for p in procs:
        if p.pid is None:
            continue
        try:  # the rank's whole process group: the rank and any process it started
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # the group is gone (or the rank never reached setpgrp)
            if p.is_alive():
                p.kill()
    for p in procs:
        p.join(timeout=10)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    pg_timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    process_group: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned ranks.

    Args:
        fn: a module-level (picklable) function; its return values come back in rank order.
        world_size: number of ranks (>= 1).
        timeout: hard limit in seconds for the whole run, start-up included.
        backend: process-group backend, ``"gloo"`` or ``"nccl"``.
        pg_timeout: the process group's own collective timeout (default: ``timeout``).
        env: extra environment variables set inside every child only.
        process_group: initialise the default process group before calling ``fn`` (else ranks get
            only the environment, may start processes of their own, and an ``env://`` rendezvous
            joins the parent's store as a client; see the module docstring).

    Raises:
        DistributedRankError: a rank raised or died; carries its traceback. When several ranks
            fail, the root cause is reported: a rank that died without reporting, else the earliest
            error (peers of a failed rank fail later with "connection closed by peer").
        DistributedTimeoutError: the run exceeded ``timeout``; carries every stuck rank's stacks.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be one of ['gloo', 'nccl'], got {backend!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    import torch.distributed as dist

    deadline = time.monotonic() + timeout  # bounds the whole run: the forkserver's start, the ranks' start-up
    if not wait_until_ready(deadline):
        raise DistributedTimeoutError(
            f"the forkserver that starts the ranks was not ready within {timeout:.0f}s (it imports {list(PRELOAD)} "
            f"once); set {START_METHOD_ENV}=spawn to start every rank by itself"
        )
    job = pickle.dumps((fn, args, kwargs))  # unpickled in the child after its stack-dump handler is set
    ctx = rank_context()
    results = ctx.Queue()
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )
    tmpdir = tempfile.mkdtemp(prefix="ls_harness_")
    stack_files = [os.path.join(tmpdir, f"rank{r}.stacks") for r in range(world_size)]
    procs = [
        ctx.Process(
            target=_child,
            args=(
                job,
                r,
                world_size,
                store.port,
                backend,
                pg_timeout or timeout,
                stack_files[r],
                dict(env or {}),
                results,
                process_group,
                Inherit(),
            ),
            name=f"lightning_sync-rank{r}",
            # not daemonic: a rank may start processes of its own (DataLoader workers, Hogwild); every
            # path below kills the rank's whole process group and joins it, so none outlives the run
            daemon=False,
        )
        for r in range(world_size)
    ]
    outputs: dict[int, Any] = {}
    errors: dict[int, tuple[float, str]] = {}
    try:
        for p in procs:
            p.start()
        failed_at: float | None = None
        while len(outputs) < world_size:
            try:
                rank, status, stamp, payload = results.get(timeout=0.1)
                if status == "error":
                    errors[rank] = (stamp, payload)
                else:
                    outputs[rank] = _decode(payload)
            except queue.Empty:
                pass
            now = time.monotonic()
            dead = [
                r
                for r, p in enumerate(procs)
                if r not in outputs and r not in errors and not p.is_alive() and p.exitcode not in (None, 0)
            ]
            if (errors or dead) and failed_at is None:
                failed_at = now  # give the other ranks' reports a moment to arrive, then pick the cause
            if failed_at is not None and now - failed_at > _GRACE_S:
                _raise_root_cause(procs, dead, errors)
            if now > deadline:
                _raise_timeout(fn, procs, outputs, errors, stack_files, timeout)
        return [outputs[r] for r in range(world_size)]
    finally:
        _kill_all(procs)
        results.close()
        results.join_thread()
        del store
        for f in stack_files:
            if os.path.exists(f):
                os.remove(f)
        os.rmdir(tmpdir)


def _raise_root_cause(procs: list[Any], dead: list[int], errors: dict[int, tuple[float, str]]) -> None:
    if dead:
        r = dead[0]
        raise DistributedRankError(
            r, f"process exited with code {procs[r].exitcode} without reporting (other failing ranks: {sorted(errors)})"
        )
    r = min(errors, key=lambda k: errors[k][0])
    others = "".join(f"\n--- later failure on rank {k} ---\n{errors[k][1]}" for k in sorted(errors) if k != r)
    raise DistributedRankError(r, errors[r][1] + others)


def _raise_timeout(
    fn: Callable[..., Any],
    procs: list[Any],
    outputs: dict[int, Any],
    errors: dict[int, tuple[float, str]],
    stack_files: list[str],
    timeout: float,
) -> None:
    stuck = [r for r in range(len(procs)) if r not in outputs and r not in errors]
    ready = [r for r in stuck if procs[r].is_alive() and os.path.exists(stack_files[r])]
    for r in ready:  # ask every stuck rank for the stacks of all its threads
        os.kill(procs[r].pid, _DUMP_SIGNAL)
    end = time.monotonic() + 5.0
    while time.monotonic() < end and not all(_read(stack_files[r], None) for r in ready):
        time.sleep(0.05)
    time.sleep(0.2)  # let the last dump finish writing
    stacks = "\n".join(
        f"--- rank {r} stacks ---\n"
        + (_read(stack_files[r]) if r in ready else "(still starting up: the process had not reached the harness yet)")
        for r in stuck
    )
    returned = sorted(outputs)
    raise DistributedTimeoutError(
        f"{fn.__name__} on {len(procs)} ranks did not finish within {timeout:.0f}s; ranks {stuck} never "
        f"returned" + (f" (ranks {returned} had returned)" if returned else "") + f"\n{stacks}"
    )


def _read(path: str, missing: str | None = "(no stack dump written)") -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or missing
    except OSError:
        return missing
