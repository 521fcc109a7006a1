"""Atomic checkpoints: a process killed (SIGKILL) in the middle of a save leaves a loadable checkpoint.

* ``AtomicCheckpointIO`` (files): killed while writing ``last.ckpt``, the previous ``last.ckpt`` is whole and
  loadable (weights only), and the half-written bytes are never what ModelCheckpoint or ``ckpt_path="last"`` picks.
* Sharded directories (``ShardedStrategy``): replacing one takes several file-system steps (a directory cannot
  replace a non-empty one in one rename). Killed before any of them, the next start finds the old checkpoint or
  the new one under the final name, by an explicit path and by ``last``, and the next save leaves nothing else.
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_sync import BucketedDDPStrategy, ShardedStrategy
from lightning_sync.checkpoint.reading import load_file
from lightning_sync.launch import AtomicCheckpointIO
from lightning_sync.launch.atomic import recover_dir, recover_path
from lightning_sync.sync import LoopbackCommunicator, ZeroEngine, consolidate_checkpoint
from lightning_sync.sync.zero import full_state_dict
from lightning_sync.testing.startup import rank_context

_CHILD = textwrap.dedent("""
    import sys, time, pathlib, torch
    from lightning_sync.launch import AtomicCheckpointIO

    target, marker = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    io = AtomicCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.full((4,), 1.0)}, "global_step": 1}, target)

    class Stalling:  # a disk that stops after the first MiB: the parent kills us there
        def __init__(self, f):
            self.f, self.n = f, 0
        def write(self, data):
            self.n += len(data)
            out = self.f.write(data)
            if self.n > 2**20:
                self.f.flush()
                marker.touch()
                time.sleep(600)
            return out
        def flush(self):
            self.f.flush()
        def fileno(self):
            return self.f.fileno()

    real_save = torch.save
    torch.save = lambda obj, f, **kw: real_save(obj, Stalling(f), **kw)
    io.save_checkpoint({"state_dict": {"w": torch.full((2**20,), 2.0)}, "global_step": 2}, target)
""")


@pytest.mark.timeout(120)
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    target, marker = tmp_path / "last.ckpt", tmp_path / "stalled"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(target), str(marker)], start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not marker.exists():
            assert child.poll() is None, f"the child exited ({child.returncode}) before stalling mid-save"
            assert time.monotonic() < deadline, "the child never reached the middle of its second save"
            time.sleep(0.05)
        os.killpg(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    partial = [p for p in tmp_path.iterdir() if p.name.startswith(".last.ckpt.tmp-")]
    assert len(partial) == 1, sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(RuntimeError):  # the kill did land mid-write: those bytes are no checkpoint
        torch.load(partial[0], weights_only=True)
    previous = torch.load(target, map_location="cpu", weights_only=True)
    assert previous["global_step"] == 1 and torch.equal(previous["state_dict"]["w"], torch.full((4,), 1.0))
    assert ModelCheckpoint(dirpath=tmp_path)._find_last_checkpoints(None) == {str(target)}  # what "last" picks

    AtomicCheckpointIO().save_checkpoint({"global_step": 3}, target)  # the next save of that name succeeds
    assert torch.load(target, weights_only=True)["global_step"] == 3


def test_our_strategies_write_atomically_by_default() -> None:
    assert isinstance(BucketedDDPStrategy().checkpoint_io, AtomicCheckpointIO)
    with pytest.raises(TypeError, match="storage_options"):
        AtomicCheckpointIO().save_checkpoint({}, "x.ckpt", storage_options={"a": 1})


# ====================================================================== sharded directories
# One process, no process group: a LoopbackCommunicator stands in for the peers. Every parameter of the
# checkpoint of global step k holds the value k, so what loads says which save it came from.
def _sharded_strategy(fill: float) -> ShardedStrategy:
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(fill)
    engine = ZeroEngine(net, torch.optim.SGD(net.parameters(), lr=0.1), LoopbackCommunicator(1), stage=3)
    engine.gather_root()
    strategy = ShardedStrategy(stage=3)
    strategy.engine, strategy.parallel_devices = engine, [torch.device("cpu")]
    return strategy


def _save(step: int, final: Path) -> None:
    _sharded_strategy(float(step)).save_checkpoint({"global_step": step}, final)


# Saves global step 1, then replaces it with global step 2, logging every file-system step of that second
# save (renames, and tree removals) before taking it; SIGKILLs itself at step number kill_at (0: never).
# A removal is killed partway: one of its files is already gone.
_SHARDED_CHILD = (
    textwrap.dedent("""
    from __future__ import annotations
    import os, pathlib, shutil, signal, sys, warnings
    from pathlib import Path
    import torch
    from torch import nn
    from lightning_sync import ShardedStrategy
    from lightning_sync.sync import LoopbackCommunicator, ZeroEngine
""")
    + inspect.getsource(_sharded_strategy)
    + inspect.getsource(_save)
    + textwrap.dedent("""

    warnings.simplefilter("ignore")  # DCP without a process group says so
    final, log, kill_at = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
    taken = 0

    def step(what, partly=None):
        global taken
        taken += 1
        with open(log, "a") as f:
            f.write(what + "\\n")
        if taken == kill_at:
            if partly is not None:
                partly()
            os.kill(os.getpid(), signal.SIGKILL)

    real_replace, real_rename, real_rmtree = os.replace, pathlib.Path.rename, shutil.rmtree

    def replace(src, dst, *args, **kwargs):
        step(f"replace {pathlib.Path(src).name} -> {pathlib.Path(dst).name}")
        return real_replace(src, dst, *args, **kwargs)

    def rename(self, target):
        step(f"rename {self.name} -> {pathlib.Path(target).name}")
        return real_rename(self, target)

    def rmtree(path, *args, **kwargs):
        files = sorted(p for p in pathlib.Path(path).rglob("*") if p.is_file())
        step(f"rmtree {pathlib.Path(path).name}", partly=lambda: files[0].unlink())
        return real_rmtree(path, *args, **kwargs)

    _save(1, final)
    os.replace, pathlib.Path.rename, shutil.rmtree = replace, rename, rmtree
    _save(2, final)
""")
)


def _exec_script(code: str, argv: list[str], stderr_path: str) -> None:
    """What ``python -c code *argv`` does, in a process forked from the harness's preloaded forkserver (so
    each of the many kills below costs no fresh import of torch), its stderr into ``stderr_path``."""
    fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)
    sys.argv = ["-c", *argv]
    code_ = 0
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    except BaseException:  # what the interpreter prints for an uncaught exception, and its exit code
        traceback.print_exc()
        code_ = 1
    sys.stderr.flush()
    os._exit(code_)


def _killed_save(directory: Path, kill_at: int) -> list[str]:
    """Run the child on ``directory/last.ckpt``; the steps of its second save it logged (random parts of
    names as ``*``). With ``kill_at`` it must have died of SIGKILL at that step."""
    log, stderr = directory.with_suffix(".log"), directory.with_suffix(".stderr")
    argv = [str(directory / "last.ckpt"), str(log), str(kill_at)]
    child = rank_context().Process(target=_exec_script, args=(_SHARDED_CHILD, argv, str(stderr)), name="killed-save")
    child.start()
    child.join(120)
    if child.exitcode is None:
        child.kill()
        child.join()
        pytest.fail(f"kill_at={kill_at}: the save did not end within 120 s")
    want = -signal.SIGKILL if kill_at else 0
    said = stderr.read_text()[-3000:] if stderr.exists() else "(no stderr: the process never started the script)"
    assert child.exitcode == want, f"kill_at={kill_at}: exit {child.exitcode}\n{said}"
    steps = [re.sub(r"-[0-9a-f]{8,}$", "-*", line) for line in log.read_text().splitlines()] if log.exists() else []
    assert not kill_at or len(steps) == kill_at, steps
    return steps


def _loaded_step(final: Path) -> int:
    """Load ``final`` the way ``trainer.fit(ckpt_path=final)`` does (``ShardedStrategy.load_checkpoint``)
    into a model of other values; the global step it holds, checked against its parameters."""
    strategy = _sharded_strategy(0.0)
    step = strategy.load_checkpoint(final)["global_step"]
    for key, value in full_state_dict(strategy.engine).items():
        assert torch.equal(value, torch.full_like(value, float(step))), f"{key} is not global step {step}'s"
    return step


def _last_step(directory: Path) -> int:
    """What ``ckpt_path="last"`` resumes from, after the recovery the train app runs before ``fit``."""
    recover_dir(directory)
    assert ModelCheckpoint(dirpath=directory)._find_last_checkpoints(None) == {str(directory / "last.ckpt")}
    full = consolidate_checkpoint(directory / "last.ckpt")
    steps = {value.flatten()[0].item() for value in full.values()}
    assert len(steps) == 1, steps
    return int(steps.pop())


@pytest.mark.timeout(400)
@pytest.mark.filterwarnings("ignore:.*torch.distributed.*:UserWarning")  # DCP without a process group
def test_a_sharded_save_killed_at_any_step_leaves_a_checkpoint_the_next_start_finds(tmp_path: Path) -> None:
    steps = _killed_save(tmp_path / "whole", kill_at=0)
    swap = steps.index("replace .last.ckpt.tmp -> last.ckpt")  # where the new checkpoint takes the name
    assert swap > 0 and len(steps) > swap + 1, steps  # the old one was moved aside first, and removed after
    assert sorted(os.listdir(tmp_path / "whole")) == ["last.ckpt"], "a successful save left something behind"
    assert _loaded_step(tmp_path / "whole" / "last.ckpt") == 2
    wants, where = {}, {}
    for kill_at in range(1, len(steps) + 1):  # each kill leaves its directory, and copies for other starts
        directory = tmp_path / f"killed_at_{kill_at}"
        assert _killed_save(directory, kill_at) == steps[:kill_at]
        wants[kill_at] = 2 if kill_at - 1 > swap else 1  # the steps before kill_at were taken
        where[kill_at] = f"killed at step {kill_at} ({steps[kill_at - 1]!r}), left {sorted(os.listdir(directory))}"
        for copy in ("last", "saved"):
            shutil.copytree(directory, tmp_path / f"{copy}_{kill_at}", symlinks=True)
    for kill_at, want in wants.items():  # trainer.fit(ckpt_path=<the directory>)
        assert _loaded_step(tmp_path / f"killed_at_{kill_at}" / "last.ckpt") == want, where[kill_at]
    for kill_at, want in wants.items():  # trainer.fit(ckpt_path="last")
        assert _last_step(tmp_path / f"last_{kill_at}") == want, where[kill_at]
    for kill_at in wants:  # the next save leaves only itself behind, after a start or straight away
        for start in ("killed_at", "last", "saved"):
            directory = tmp_path / f"{start}_{kill_at}"
            _save(3, directory / "last.ckpt")
            assert sorted(os.listdir(directory)) == ["last.ckpt"], f"{start}: {where[kill_at]}"
            assert _loaded_step(directory / "last.ckpt") == 3, f"{start}: {where[kill_at]}"


def _checkpoint_dir(path: Path, content: str) -> Path:
    path.mkdir()
    (path / "shard").write_text(content)
    return path


@pytest.mark.filterwarnings("ignore:.*torch.distributed.*:UserWarning")  # DCP without a process group
def test_a_save_replaces_a_checkpoint_of_the_other_kind(tmp_path: Path) -> None:
    """A file saved where a sharded directory of the same name is (``trainer.save_checkpoint`` after fit over
    the directory ModelCheckpoint wrote, or a run whose ``state_dict_type`` changed) replaces it, and a sharded
    directory replaces a file: the old one goes aside first (one rename), so a kill at any moment leaves one
    whole checkpoint under the name or aside, as between two directories. Nothing else is left behind."""
    final = tmp_path / "last.ckpt"
    _save(1, final)
    assert final.is_dir()
    AtomicCheckpointIO().save_checkpoint({"global_step": 2}, final)  # a file where the directory was
    assert final.is_file() and torch.load(final, weights_only=True)["global_step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]
    _save(3, final)  # a sharded directory where the file was
    assert final.is_dir() and _loaded_step(final) == 3
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


class _Module(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.filterwarnings("ignore:.*torch.distributed.*:UserWarning")  # DCP without a process group
def test_a_sharded_directory_where_a_file_is_expected_names_the_consolidate_command(tmp_path: Path) -> None:
    """Lightning's ``load_from_checkpoint`` opens the path as a file before any hook of ours could run, and stops
    with the OS's IsADirectoryError (pinned here, so a Lightning that changes it shows up). What we own says what
    to do: the directory's README, and every load of ours that expects a file (each strategy's through its
    AtomicCheckpointIO, and load_file)."""
    final = tmp_path / "last.ckpt"
    _save(1, final)
    assert "lightning-sync consolidate <this directory> model.ckpt" in (final / "README.txt").read_text()
    with pytest.raises(IsADirectoryError, match="Is a directory"):
        _Module.load_from_checkpoint(final)
    command = f"lightning-sync consolidate {re.escape(str(final))} model.ckpt"
    for name, load in (
        ("AtomicCheckpointIO", AtomicCheckpointIO().load_checkpoint),
        ("BucketedDDPStrategy", BucketedDDPStrategy().load_checkpoint),
        ("load_file", load_file),
    ):
        with pytest.raises(IsADirectoryError, match=rf"sharded checkpoint .*zero1, zero2 or zero3.*{command}"):
            load(final)
            pytest.fail(f"{name} loaded a directory")


def test_recover_path_renames_the_old_copy_back_or_deletes_it(tmp_path: Path) -> None:
    missing, both, neither = tmp_path / "missing.ckpt", tmp_path / "both.ckpt", tmp_path / "neither.ckpt"
    _checkpoint_dir(tmp_path / ".missing.ckpt.old", "old")  # killed between the two renames
    _checkpoint_dir(both, "new")  # killed after them, before the old copy was deleted
    _checkpoint_dir(tmp_path / ".both.ckpt.old", "old")
    _checkpoint_dir(tmp_path / ".neither.ckpt.tmp", "new")  # killed before them: nothing to recover
    for final in (missing, both, neither):
        recover_path(final)
    assert (missing / "shard").read_text() == "old" and (both / "shard").read_text() == "new"
    assert not neither.exists()
    assert sorted(os.listdir(tmp_path)) == [".neither.ckpt.tmp", "both.ckpt", "missing.ckpt"]
    # a file replacing a directory (or the other way round) was killed between its renames: the old one is a
    # file aside, or a directory aside with a file under the name
    (tmp_path / ".file.ckpt.old").write_text("old")
    _checkpoint_dir(tmp_path / ".mixed.ckpt.old", "old")
    (tmp_path / "mixed.ckpt").write_text("new")
    recover_path(tmp_path / "file.ckpt")
    recover_path(tmp_path / "mixed.ckpt")
    assert (tmp_path / "file.ckpt").read_text() == "old" and (tmp_path / "mixed.ckpt").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == [".neither.ckpt.tmp", "both.ckpt", "file.ckpt", "missing.ckpt", "mixed.ckpt"]


def _recover_at_once(directory: str, barrier: Any) -> None:
    barrier.wait(timeout=60)
    recover_dir(directory)


@pytest.mark.timeout(120)
def test_every_rank_may_recover_the_same_directory_at_once(tmp_path: Path) -> None:
    """Each rank of a job runs the recovery before it resumes; processes racing over the same checkpoints
    all succeed, and each checkpoint ends up recovered exactly once."""
    for i in range(40):
        if i % 2:
            _checkpoint_dir(tmp_path / f"both{i}.ckpt", "new")
        _checkpoint_dir(tmp_path / f".{'both' if i % 2 else 'missing'}{i}.ckpt.old", "old")
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(4)
    ranks = [
        context.Process(target=_recover_at_once, args=(str(tmp_path), barrier), name=f"lightning_sync-recover{r}")
        for r in range(4)
    ]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(90)
    assert [rank.exitcode for rank in ranks] == [0, 0, 0, 0]
    assert sorted(os.listdir(tmp_path)) == sorted(f"{'both' if i % 2 else 'missing'}{i}.ckpt" for i in range(40))
    for i in range(40):
        name = f"{'both' if i % 2 else 'missing'}{i}.ckpt"
        assert (tmp_path / name / "shard").read_text() == ("new" if i % 2 else "old"), name
