"""``lightning_sync.launch.requeue`` in one process: arguments, the atomic checkpoint pointer (a save killed at
any point leaves the previous checkpoint as "latest"), exact mid-epoch skipping, and requeue outside Slurm
or without ``scontrol``, and Slurm's SIGTERM arriving while ``scontrol`` runs. The 2-rank stop-and-resume is ``tests/multiprocess/test_requeue.py``; the real
requeue is ``tests/slurm/test_requeue_on_slurm.py``."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from lightning_sync.launch.requeue import (
    POINTER,
    RequeueOnSignal,
    deferred_signal,
    latest_checkpoint,
    publish_checkpoint,
    requeue_job,
    resolve_signal,
    skip_batches,
)


@pytest.mark.parametrize(("value", "expected"), [("USR1", signal.SIGUSR1), ("sigusr2", signal.SIGUSR2),
                                                 (" TERM ", signal.SIGTERM), (int(signal.SIGUSR1), signal.SIGUSR1),
                                                 (signal.SIGHUP, signal.SIGHUP)])
def test_signal_names_and_numbers(value: object, expected: signal.Signals) -> None:
    assert resolve_signal(value) is expected


@pytest.mark.parametrize("value", ["KILL", "SIGSTOP", "usr3", "", None, True, 9999, 1.5])
def test_bad_signal_is_named_with_the_allowed_ones(value: object) -> None:
    with pytest.raises(ValueError, match=r"signal must be one of \['USR1', 'USR2', 'TERM'.*got " + repr(value)
                       .replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        resolve_signal(value)


def test_bad_callback_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="requeue must be True or False, got 'yes'"):
        RequeueOnSignal(tmp_path, requeue="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="directory must be a path .*got ''"):
        RequeueOnSignal("")
    with pytest.raises(ValueError, match="signal must be one of"):
        RequeueOnSignal(tmp_path, signal="KILL")


def _ckpt(path: Path, value: float) -> Path:
    torch.save({"w": torch.full((3,), value)}, path)
    return path


def test_no_pointer_means_a_first_run(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(None) is None


def test_pointer_moves_only_after_the_new_checkpoint_is_complete(tmp_path: Path) -> None:
    first = publish_checkpoint(tmp_path, _ckpt(tmp_path / ".a.tmp", 1.0), "requeue-step000000005.ckpt",
                               {"global_step": 5})
    assert latest_checkpoint(tmp_path) == first
    assert json.loads((tmp_path / POINTER).read_text()) == {"checkpoint": first.name, "global_step": 5}
    # a second save killed half-way: the temporary exists (truncated), the pointer never moved
    (tmp_path / ".requeue-step000000009.ckpt.tmp").write_bytes(b"PK\x03\x04 truncated")
    assert latest_checkpoint(tmp_path) == first
    assert torch.load(latest_checkpoint(tmp_path))["w"][0] == 1.0  # type: ignore[arg-type]
    # killed after the rename but before the pointer: the old checkpoint is still the one named, and whole
    _ckpt(tmp_path / "requeue-step000000009.ckpt", 2.0)
    assert latest_checkpoint(tmp_path) == first
    # a complete publish: the pointer moves, and older checkpoints (and the leftover) are removed
    second = publish_checkpoint(tmp_path, _ckpt(tmp_path / ".b.tmp", 3.0), "requeue-step000000012.ckpt")
    assert latest_checkpoint(tmp_path) == second
    assert not first.exists() and not (tmp_path / "requeue-step000000009.ckpt").exists()
    assert torch.load(second)["w"][0] == 3.0


def test_sharded_checkpoint_directories_publish_too(tmp_path: Path) -> None:
    tmp = tmp_path / ".dir.tmp"
    (tmp / "shards").mkdir(parents=True)
    _ckpt(tmp / "shards" / "rank0.pt", 4.0)
    final = publish_checkpoint(tmp_path, tmp, "requeue-step000000001.ckpt")
    assert final.is_dir() and latest_checkpoint(tmp_path) == final and not tmp.exists()


def test_a_pointer_to_a_missing_checkpoint_fails_loudly(tmp_path: Path) -> None:
    (tmp_path / POINTER).write_text(json.dumps({"checkpoint": "requeue-step000000003.ckpt"}))
    with pytest.raises(FileNotFoundError, match=r"latest.json names the checkpoint .*requeue-step000000003"):
        latest_checkpoint(tmp_path)


def _indices(loader: DataLoader) -> list[list[int]]:
    return [batch[0].tolist() for batch in loader]


def test_skip_batches_resumes_the_same_permutation_once() -> None:
    ds = TensorDataset(torch.arange(40))
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=3)
    loader = DataLoader(ds, batch_size=4, sampler=sampler)
    sampler.set_epoch(2)
    full = _indices(loader)
    skip_batches(loader, 3)
    sampler.set_epoch(2)  # Lightning sets the epoch on the original sampler: the wrapper must follow it
    assert _indices(loader) == full[3:]
    assert len(loader) == len(full)  # Lightning's batch count for the epoch is unchanged
    assert _indices(loader) == full  # the next epoch (same epoch number here) is whole again


def test_skip_batches_refuses_what_it_cannot_skip_exactly() -> None:
    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(8))

    with pytest.raises(TypeError, match="cannot resume mid-epoch on DataLoader: .*map-style"):
        skip_batches(DataLoader(Stream(), batch_size=None), 1)


def test_requeue_outside_slurm_or_without_scontrol_logs_and_returns_false(caplog: pytest.LogCaptureFixture,
                                                                          tmp_path: Path) -> None:
    caplog.set_level(logging.INFO, logger="lightning_sync.launch")
    assert requeue_job({"PATH": str(tmp_path)}) is False
    assert "not a SLURM job (no SLURM_JOB_ID)" in caplog.text
    caplog.clear()
    assert requeue_job({"SLURM_JOB_ID": "42", "PATH": str(tmp_path)}) is False  # no scontrol on this PATH
    assert "scontrol is not on PATH, so job 42 is NOT requeued; the checkpoint is saved" in caplog.text


def _scontrol_that_slurm_kills(directory: Path) -> Path:
    """A stand-in for ``scontrol`` doing what Slurm does on a requeue: it ends the running step, so SIGTERM
    reaches the job's process (its parent) and ``scontrol`` itself before ``scontrol`` has exited."""
    script = directory / "scontrol"
    script.write_text('#!/bin/sh\necho "$@" > "$0.args"\nkill -TERM $PPID\nkill -TERM $$\necho requeued\n')
    script.chmod(0o755)
    return script


def test_slurms_sigterm_during_the_requeue_neither_fails_it_nor_runs_the_handler_before_the_outcome(
        caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    # the order of events: the outcome's log line, the end of the deferred block, then the SIGTERM handler
    # that was there before (in a Lightning job: its handler, which runs a broadcast)
    events: list[str] = []

    class Outcome(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            events.append(record.getMessage())

    scontrol = _scontrol_that_slurm_kills(tmp_path)
    outcome = Outcome(level=logging.INFO)
    logging.getLogger("lightning_sync.launch").addHandler(outcome)
    caplog.set_level(logging.INFO, logger="lightning_sync.launch")
    recorder = lambda signum, frame: events.append(f"handler {signal.Signals(signum).name}")  # noqa: E731
    previous = signal.signal(signal.SIGTERM, recorder)
    try:
        with deferred_signal(signal.SIGTERM) as held:
            requeued = requeue_job({"SLURM_JOB_ID": "42", "PATH": str(tmp_path)})
            events.append("deferred block ends")
        assert signal.getsignal(signal.SIGTERM) is recorder  # the previous handler is back
        with deferred_signal(signal.SIGTERM) as nothing:  # no signal: nothing is raised on leaving
            events.append("quiet block")
    finally:
        signal.signal(signal.SIGTERM, previous)
        logging.getLogger("lightning_sync.launch").removeHandler(outcome)
    # True: scontrol ignored the SIGTERM sent to it (without that it dies of it, exit -15, a "failed" requeue)
    assert requeued is True, caplog.text
    assert (scontrol.parent / "scontrol.args").read_text().split() == ["requeue", "42"]
    assert held == [signal.SIGTERM] and nothing == []
    assert events == ["requeue: job 42 requeued (scontrol requeue); it resumes from the checkpoint",
                      "deferred block ends", "handler SIGTERM", "quiet block"]


def test_cuda_rng_states_restore_on_cuda_only(caplog: pytest.LogCaptureFixture) -> None:
    # the GPU round trip is tests/gpu/test_requeue_cuda.py; here: nothing saved means nothing done, and a
    # CUDA state met by a CPU run is reported, never applied to a device that does not exist
    from types import SimpleNamespace

    caplog.set_level(logging.INFO, logger="lightning_sync.launch")
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), global_rank=0)
    RequeueOnSignal._restore_cuda_rng(trainer, None)
    assert caplog.text == ""
    RequeueOnSignal._restore_cuda_rng(trainer, torch.zeros(2, 16, dtype=torch.uint8))
    assert "the checkpoint holds CUDA RNG states but this run is on cpu: not restored" in caplog.text


def test_host_rng_state_round_trips_python_and_numpy_with_cached_gaussians() -> None:
    import random

    import numpy as np

    from lightning_sync.launch.requeue import host_rng_state, set_host_rng_state

    random.seed(3)
    np.random.seed(4)
    random.gauss(0, 1)  # both generators now hold a cached second Gaussian, part of the state
    np.random.standard_normal()
    state = host_rng_state()
    assert state.dtype == torch.float64 and state.numel() == 1255
    first = (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.standard_normal())
    random.seed(99)
    np.random.seed(99)
    set_host_rng_state(state)
    assert (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.standard_normal()) == first
    with pytest.raises(ValueError, match="holds 1255 numbers, got 3"):
        set_host_rng_state(torch.zeros(3))
