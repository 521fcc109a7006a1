"""Launch ``lightning-sync train`` the way torchrun or a cluster does: one process per rank, the rank variables
in each one's environment, every rank in a session of its own (so a test can kill it with its children).

Used by ``test_crash_restart.py`` and ``test_fault_matrix.py``; not a test module itself.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["finish", "launch", "weights"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, run_dir: Path, overrides: Sequence[str]) -> list[subprocess.Popen[str]]:
    """Start ``world`` ranks of ``lightning-sync train`` (one device each) with ``overrides``, writing into
    ``run_dir`` and their final weights to ``run_dir/final.ckpt``; stdout and stderr are merged."""
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
        cmd = [
            sys.executable,
            "-m",
            "lightning_sync",
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
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
            )
        )
    return procs


def finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str]]:
    """Every rank's exit code and output; a rank still running after ``timeout`` is killed (a test failure)."""
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=timeout)
            out.append((p.returncode, text))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return out


def weights(path: Path) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint file."""
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
