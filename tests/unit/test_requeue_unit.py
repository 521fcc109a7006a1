"""``lightning_sync.launch.requeue`` in one process: arguments, the atomic checkpoint pointer (a save killed at
any point leaves the previous checkpoint as "latest"), requeue outside Slurm or without ``scontrol``, and
Slurm's SIGTERM arriving while ``scontrol`` runs. Exact resume (data position, RNG states) is
``tests/unit/test_resume_unit.py``. The 2-rank stop-and-resume is ``tests/multiprocess/test_requeue.py``; the real
requeue is ``tests/slurm/test_requeue_on_slurm.py``."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

import pytest
import torch

from lightning_sync.launch.requeue import (
    POINTER,
    RequeueOnSignal,
    deferred_signal,
    latest_checkpoint,
    newest_checkpoint,
    publish_checkpoint,
    recorded_step,
    requeue_job,
    resolve_signal,
)
from lightning_sync.sync.zero.format import COMPLETE_MARKER, LIGHTNING_STATE


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("USR1", signal.SIGUSR1),
        ("sigusr2", signal.SIGUSR2),
        (" TERM ", signal.SIGTERM),
        (int(signal.SIGUSR1), signal.SIGUSR1),
        (signal.SIGHUP, signal.SIGHUP),
    ],
)
def test_signal_names_and_numbers(value: object, expected: signal.Signals) -> None:
    assert resolve_signal(value) is expected


@pytest.mark.parametrize("value", ["KILL", "SIGSTOP", "usr3", "", None, True, 9999, 1.5])
def test_bad_signal_is_named_with_the_allowed_ones(value: object) -> None:
    with pytest.raises(
        ValueError,
        match=r"signal must be one of \['USR1', 'USR2', 'TERM'.*got "
        + repr(value).replace("(", r"\(").replace(")", r"\)").replace(".", r"\."),
    ):
        resolve_signal(value)


def test_bad_callback_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="requeue must be True or False, got 'yes'"):
        RequeueOnSignal(tmp_path, requeue="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="directory must be a path .*got ''"):
        RequeueOnSignal("")
    with pytest.raises(ValueError, match="signal must be one of"):
        RequeueOnSignal(tmp_path, signal="KILL")


def _ckpt(path: Path, value: float, step: int = 0) -> Path:
    torch.save({"w": torch.full((3,), value), "global_step": step}, path)
    return path


def test_no_pointer_means_a_first_run(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(None) is None


def test_pointer_moves_only_after_the_new_checkpoint_is_complete(tmp_path: Path) -> None:
    first = publish_checkpoint(
        tmp_path, _ckpt(tmp_path / ".a.tmp", 1.0, step=5), "requeue-step000000005.ckpt", {"global_step": 5}
    )
    assert latest_checkpoint(tmp_path) == first
    assert json.loads((tmp_path / POINTER).read_text()) == {"checkpoint": first.name, "global_step": 5}
    # a second save killed half-way: the temporary exists (truncated), the pointer never moved
    (tmp_path / ".requeue-step000000009.ckpt.tmp").write_bytes(b"PK\x03\x04 truncated")
    assert latest_checkpoint(tmp_path) == first
    assert torch.load(latest_checkpoint(tmp_path))["w"][0] == 1.0  # type: ignore[arg-type]
    # a complete publish: the pointer moves, and older checkpoints (and the leftover) are removed
    second = publish_checkpoint(tmp_path, _ckpt(tmp_path / ".b.tmp", 3.0, step=12), "requeue-step000000012.ckpt")
    assert latest_checkpoint(tmp_path) == second
    assert not first.exists()
    assert torch.load(second)["w"][0] == 3.0


def test_the_newest_complete_checkpoint_wins_and_the_pointer_is_only_a_hint(tmp_path: Path) -> None:
    # killed after the rename of step 7 but before the pointer moved: two complete checkpoints, the pointer
    # still names step 3; step 7 holds more progress and is whole, so resume takes it
    older = publish_checkpoint(
        tmp_path, _ckpt(tmp_path / ".a.tmp", 1.0, step=3), "requeue-step000000003.ckpt", {"global_step": 3}
    )
    newer = _ckpt(tmp_path / "requeue-step000000007.ckpt", 2.0, step=7)
    assert json.loads((tmp_path / POINTER).read_text())["checkpoint"] == older.name
    assert latest_checkpoint(tmp_path) == newer
    # a truncated file under a checkpoint's name (not one we published) is not complete: it is passed over
    (tmp_path / "requeue-step000000009.ckpt").write_bytes(b"PK\x03\x04 truncated")
    assert latest_checkpoint(tmp_path) == newer
    assert newest_checkpoint([older, tmp_path / "requeue-step000000009.ckpt", newer]) == (newer, 7)
    assert recorded_step(older) == 3
    with pytest.raises(ValueError, match="requeue-step000000009.ckpt is not a complete checkpoint"):
        recorded_step(tmp_path / "requeue-step000000009.ckpt")


def test_sharded_checkpoint_directories_publish_too(tmp_path: Path) -> None:
    tmp = tmp_path / ".dir.tmp"
    (tmp / "shards").mkdir(parents=True)
    _ckpt(tmp / "shards" / "rank0.pt", 4.0)
    _ckpt(tmp / LIGHTNING_STATE, 0.0, step=1)  # what ShardedStrategy writes last: Lightning's state, the marker
    (tmp / COMPLETE_MARKER).write_text("{}")
    final = publish_checkpoint(tmp_path, tmp, "requeue-step000000001.ckpt")
    assert final.is_dir() and latest_checkpoint(tmp_path) == final and not tmp.exists()
    # a directory under a checkpoint's name without its marker (a save killed before it) is passed over
    (tmp_path / "requeue-step000000004.ckpt").mkdir()
    _ckpt(tmp_path / "requeue-step000000004.ckpt" / LIGHTNING_STATE, 0.0, step=4)
    assert latest_checkpoint(tmp_path) == final


def test_a_pointer_to_a_missing_checkpoint_fails_loudly(tmp_path: Path) -> None:
    (tmp_path / POINTER).write_text(json.dumps({"checkpoint": "requeue-step000000003.ckpt"}))
    with pytest.raises(FileNotFoundError, match=r"latest.json names the checkpoint .*requeue-step000000003"):
        latest_checkpoint(tmp_path)


def test_requeue_outside_slurm_or_without_scontrol_logs_and_returns_false(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
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
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
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
    assert events == [
        "requeue: job 42 requeued (scontrol requeue); it resumes from the checkpoint",
        "deferred block ends",
        "handler SIGTERM",
        "quiet block",
    ]


def test_ckpt_path_last_without_a_model_checkpoint_warns_that_it_trains_from_scratch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a run directory's checkpoints/last.ckpt is not looked at when checkpointing is off: say so loudly
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_sync.cli import _resume_from

    caplog.set_level(logging.INFO, logger="lightning_sync")
    off = SimpleNamespace(checkpoint_callbacks=[], is_global_zero=True)
    assert _resume_from("last", None, off) is None
    assert "ckpt_path=last looks for last.ckpt where the ModelCheckpoint writes, and this run has none" in caplog.text
    caplog.clear()
    on = SimpleNamespace(checkpoint_callbacks=[ModelCheckpoint(dirpath=tmp_path)], is_global_zero=True)
    assert _resume_from("last", None, on) is None
    assert "no complete checkpoint found" in caplog.text and "WARNING" not in caplog.text
