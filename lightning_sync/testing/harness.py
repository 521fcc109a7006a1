"""Run a function on N ranks, each in its own spawned process with a real gloo process group.

The harness is what every multi-process test (and benchmark) stands on, so it promises three things:

* **It never hangs.** A hard ``timeout`` bounds the whole run. Shortly before it, each rank dumps
  the Python stack of every thread (``faulthandler``) so the error shows *where* it was stuck;
  then the parent kills every child and raises :class:`DistributedTimeoutError`.
* **Failures name the rank.** An exception in any rank is re-raised in the caller as
  :class:`DistributedRankError` carrying that rank's traceback; the other ranks are killed at once
  instead of waiting for their collectives to time out.
* **Nothing leaks.** Children are killed and joined on every path; the rendezvous store lives in the
  parent (port chosen by the OS, so there is no free-port race), and the parent's environment is
  never modified - the rank variables are set only inside the children.

Results travel back through ``torch.save`` bytes, so tensors come back as ordinary CPU tensors.
"""

from __future__ import annotations

import faulthandler
import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

__all__ = ["DistributedRankError", "DistributedTimeoutError", "run_distributed"]

_STACK_DUMP_MARGIN_S = 3.0


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
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    pg_timeout_s: float,
    stack_dump_after_s: float,
    stack_file: str,
    env: Mapping[str, str],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    results: Any,
) -> None:
    dump = open(stack_file, "w")  # noqa: SIM115 - must outlive this frame for faulthandler
    faulthandler.dump_traceback_later(stack_dump_after_s, exit=False, file=dump)
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
    os.environ.update(env)
    try:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=timedelta(seconds=pg_timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
        try:
            out = fn(rank, world_size, *args, **kwargs)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, "ok", _encode(out)))
    except BaseException:  # the parent re-raises it with this rank's traceback
        results.put((rank, "error", traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
        dump.close()


def _kill_all(procs: list[Any]) -> None:
    for p in procs:
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

    Raises:
        DistributedRankError: a rank raised or died; carries its traceback.
        DistributedTimeoutError: the run exceeded ``timeout``; carries every stuck rank's stacks.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be one of ['gloo', 'nccl'], got {backend!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    tmpdir = tempfile.mkdtemp(prefix="ls_harness_")
    stack_files = [os.path.join(tmpdir, f"rank{r}.stacks") for r in range(world_size)]
    dump_after = max(1.0, timeout - _STACK_DUMP_MARGIN_S)
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, world_size, store.port, backend, pg_timeout or timeout, dump_after,
                  stack_files[r], dict(env or {}), args, kwargs, results),
            name=f"lightning_sync-rank{r}",
            daemon=True,
        )
        for r in range(world_size)
    ]
    deadline = time.monotonic() + timeout
    outputs: dict[int, Any] = {}
    try:
        for p in procs:
            p.start()
        while len(outputs) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in outputs and not p.is_alive() and p.exitcode not in (None, 0):
                        # drain once more: the message may have arrived just before exit
                        try:
                            rank, status, payload = results.get(timeout=1.0)
                        except queue.Empty:
                            raise DistributedRankError(
                                r, f"process exited with code {p.exitcode} without reporting"
                            ) from None
                        break
                else:
                    if time.monotonic() > deadline:
                        stuck = [r for r in range(world_size) if r not in outputs]
                        time.sleep(0.5)  # let the faulthandler dumps flush
                        stacks = "\n".join(
                            f"--- rank {r} stacks ---\n{_read(stack_files[r])}" for r in stuck
                        )
                        raise DistributedTimeoutError(
                            f"{fn.__name__} on {world_size} ranks did not finish within "
                            f"{timeout:.0f}s; ranks {stuck} never returned\n{stacks}"
                        )
                    continue
            if status == "error":
                raise DistributedRankError(rank, payload)
            outputs[rank] = _decode(payload)
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


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip() or "(no stack dump written)"
    except OSError:
        return "(no stack dump written)"

