"""``AtomicCheckpointIO``: a process killed (SIGKILL) in the middle of writing ``last.ckpt`` leaves the previous
``last.ckpt`` whole and loadable (weights only), and the half-written bytes are never what ModelCheckpoint
or ``ckpt_path="last"`` picks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sync import BucketedDDPStrategy
from lightning_sync.launch import AtomicCheckpointIO

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
