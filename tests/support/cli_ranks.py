"""Launch ``lightning-sync train`` the way torchrun or a cluster does: one process per rank, the rank variables
in each one's environment, every rank in a session of its own (so a test can kill it with its children).

Each rank is ``python -m lightning_sync train ...``. By default it is forked by the test harness's forkserver
(:func:`~lightning_sync.testing.startup.rank_context`), which has imported torch, Lightning and Hydra once, and
then runs ``lightning_sync``'s ``__main__`` as ``python -m`` would (``sys.argv``, the environment, stdout and
stderr into one file, a session of its own; exit code, or minus the signal that killed it): a rank starts in
a fraction of a second instead of importing those again. ``LIGHTNING_SYNC_START_METHOD=spawn`` starts every
rank as a real ``python -m lightning_sync`` subprocess instead. (``tests/test_cli.py`` runs the installed
console script itself.)

The crash, fault-matrix and Slurm tiers use it: the last for the local runs a Slurm job must equal.
:func:`run_script` starts an example script's processes the same way.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from lightning_sync.testing.startup import START_METHOD_ENV, fresh_process_state, rank_context

__all__ = ["Rank", "finish", "launch", "run", "run_script", "weights"]


def _run_module_as_main(
    argv: list[str], env: dict[str, str], output: str, script: str | None = None, cwd: str | None = None
) -> None:
    """In a forked rank: what ``python -m lightning_sync <argv>`` (or ``python <script> <argv>``) does in a fresh
    process, with ``start_new_session=True`` and stdout and stderr merged into ``output``."""
    import atexit
    import runpy
    import threading
    import traceback

    os.setsid()
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    fresh_process_state()
    code = 0
    try:
        if script is None:
            sys.argv = ["-m", *argv]  # run_module replaces argv[0] by the module's path, as ``python -m`` does
            runpy.run_module("lightning_sync", run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *argv]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as ``python <script>`` puts it first
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # the interpreter's own handling of SystemExit
        if isinstance(e.code, int):
            code = e.code
        elif e.code is not None:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:  # then the interpreter's shutdown: join non-daemon threads, run atexit, flush
        try:
            threading._shutdown()  # type: ignore[attr-defined]
            atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001, S110 - a closed stream at exit: nothing left to flush
                    pass
    os._exit(code)


class Rank:
    """One launched rank, with the part of :class:`subprocess.Popen` the tests use: ``pid`` (its session and
    process group), ``poll``, ``wait``, ``communicate`` (its merged output) and ``returncode`` (negative: the
    signal that killed it)."""

    def __init__(
        self, argv: list[str], env: dict[str, str], name: str, script: str | None = None, cwd: str | None = None
    ) -> None:
        fd, self._output = tempfile.mkstemp(prefix="ls_cli_rank_", suffix=".log")
        os.close(fd)
        self._process = rank_context().Process(
            target=_run_module_as_main, args=(argv, env, self._output, script, cwd), name=name, daemon=False
        )
        self._process.start()
        self.pid: int = self._process.pid
        self._text: str | None = None

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout or 0.0)
        return self._process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        if self._text is None:
            with open(self._output, errors="replace") as f:
                self._text = f.read()
            os.remove(self._output)
        return self._text, None

    def kill(self) -> None:
        try:  # the rank's session: the rank and any process it started
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # not yet its own group leader, or gone
            self._process.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, run_dir: Path, overrides: Sequence[str]) -> list[Rank | subprocess.Popen[str]]:
    """Start ``world`` ranks of ``lightning-sync train`` (one device each) with ``overrides``, writing into
    ``run_dir`` and their final weights to ``run_dir/final.ckpt``; stdout and stderr are merged.

    Returns a :class:`Rank` per rank (a :class:`subprocess.Popen` with ``LIGHTNING_SYNC_START_METHOD=spawn``)."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "NODE_RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
        }
        argv = [
            "train",
            "trainer.devices=1",
            f"trainer.num_nodes={world}",
            "trainer.enable_progress_bar=false",
            "trainer.logger=false",
            "final_validate=false",
            "sample_chars=0",
            f"final_checkpoint={run_dir}/final.ckpt",
            f"hydra.run.dir={run_dir}",
            *overrides,
        ]
        procs.append(_start(argv, env, f"lightning_sync-cli-rank{rank}"))
    return procs


def _start(
    argv: list[str], env: dict[str, str], name: str, script: str | None = None, cwd: str | None = None
) -> Rank | subprocess.Popen[str]:
    """One process of ``python -m lightning_sync <argv>`` (or ``python <script> <argv>``): forked as a
    :class:`Rank`, or a real subprocess with ``LIGHTNING_SYNC_START_METHOD=spawn``."""
    if os.environ.get(START_METHOD_ENV, "forkserver") != "spawn":
        return Rank(argv, env, name=name, script=script, cwd=cwd)
    command = ["-m", "lightning_sync"] if script is None else [script]
    return subprocess.Popen(
        [sys.executable, *command, *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        cwd=cwd,
    )


def finish(procs: list[Rank | subprocess.Popen[str]], timeout: float) -> list[tuple[int, str]]:
    """Every rank's exit code and output; a rank still running after ``timeout`` is killed (a test failure)."""
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=timeout)
            out.append((p.returncode, text))
    finally:
        for p in procs:
            if p.poll() is None:
                if isinstance(p, Rank):
                    p.kill()
                else:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            if isinstance(p, Rank):
                p.communicate()  # removes its output file
    return out


def run(world: int, run_dir: Path, overrides: Sequence[str], timeout: float = 300) -> list[str]:
    """:func:`launch`, then :func:`finish`: every rank's output, after checking that every rank exited 0."""
    return _succeeded(launch(world, run_dir, overrides), timeout, "rank")


def _succeeded(procs: list[Rank | subprocess.Popen[str]], timeout: float, what: str) -> list[str]:
    outputs = finish(procs, timeout=timeout)
    for rank, (code, text) in enumerate(outputs):
        assert code == 0, f"{what} {rank} of {len(procs)} exited {code}:\n{text[-4000:]}"
    return [text for _, text in outputs]


def run_script(
    script: str | os.PathLike[str],
    args: Sequence[str],
    cwd: str | os.PathLike[str],
    world: int = 1,
    timeout: float = 300,
) -> list[str]:
    """``python <script> <args>`` in the directory ``cwd`` on ``world`` processes of one node, as torchrun
    starts them (``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``, a rendezvous and ``OMP_NUM_THREADS=1`` in each one's
    environment; none for a single process, which then runs as a plain ``python <script>``), forked from the
    harness's forkserver like :func:`launch`'s ranks (``LIGHTNING_SYNC_START_METHOD=spawn``: real
    subprocesses). Every process must exit 0; returns their merged stdout and stderr."""
    script = str(script)
    port = _free_port()
    procs: list[Rank | subprocess.Popen[str]] = []
    for rank in range(world):
        env = dict(os.environ)
        if world > 1:
            env.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                NODE_RANK="0",
                LOCAL_RANK=str(rank),
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world),
            )
            env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for more than one process
        procs.append(_start(list(args), env, f"lightning_sync-script-rank{rank}", script, str(cwd)))
    return _succeeded(procs, timeout, f"{script} process")


def weights(path: Path) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint: a file, or a sharded directory (zero3's, after fit too), consolidated."""
    if Path(path).is_dir():
        from lightning_sync.sync.zero import consolidate_checkpoint

        return consolidate_checkpoint(path)
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
