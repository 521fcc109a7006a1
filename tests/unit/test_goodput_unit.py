"""The goodput table's arithmetic, on made-up runs: goodput is the failure-free run's wall time over the failing
run's, the seconds lost per failure the difference over the failures, and the prediction's terms are the ones the
module docstring names (a number changed in any of them changes the table)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from lightning_sync.bench.goodput import GoodputRun, ProgressLog, goodput_markdown, predicted_lost_s

CFG = OmegaConf.create(
    {
        "goodput": {
            "model": "digits_mlp",
            "devices": 3,
            "steps": 1000,
            "checkpoint_every": 200,
            "fail_every_s": 20,
            "report_every_s": 60,
        }
    }
)


def _runs() -> dict[str, GoodputRun]:
    start = [(4.0, 0)]  # 4 s from the launch to the first step
    return {
        "live_clean": GoodputRun("live_clean", True, 54.0, progress=start),
        "live": GoodputRun("live", True, 60.0, failures=[20.0, 40.0], progress=start),
        "restart_clean": GoodputRun("restart_clean", False, 54.0, progress=start),
        "restart": GoodputRun("restart", False, 90.0, failures=[20.0, 40.0], launches=3, progress=start),
    }


def test_the_prediction_of_each_path() -> None:
    clean = _runs()["live_clean"]
    step_s = (54.0 - 4.0) / 1000
    # live: the replacement's start at (K-1)/K of the rate, and the replay
    assert predicted_lost_s(clean, True, CFG) == pytest.approx(4.0 / 3 + 0.1)
    # restart: the relaunch, the detection, half a checkpoint interval trained again
    assert predicted_lost_s(clean, False, CFG) == pytest.approx(4.0 + 2.0 + 100 * step_s)


def test_the_table_gives_goodput_and_seconds_lost_per_failure() -> None:
    text = goodput_markdown(_runs(), CFG)
    live = next(line for line in text.splitlines() if line.startswith("| live"))
    restart = next(line for line in text.splitlines() if line.startswith("| restart"))
    # live: 54 / 60 = 0.900, (60 - 54) / 2 = 3.00 s a failure, 60 / 63 at a failure a minute
    assert live.split(" | ")[1:8] == ["54.0", "60.0", "2", "1", "0.900", "3.00", "1.43"], live
    assert live.rstrip(" |").endswith(f"{60 / 63:.3f}"), live
    # restart: 54 / 90 = 0.600, 18 s a failure, 3 launches
    assert restart.split(" | ")[1:7] == ["54.0", "90.0", "2", "3", "0.600", "18.00"], restart


def test_progress_log_writes_rank_0s_steps(tmp_path: object) -> None:
    path = tmp_path / "progress.txt"  # type: ignore[operator]

    class Trainer:
        is_global_zero, global_step = True, 20

    ProgressLog(str(path), every=10).on_train_batch_end(Trainer())  # type: ignore[arg-type]
    Trainer.global_step = 25
    ProgressLog(str(path), every=10).on_train_batch_end(Trainer())  # type: ignore[arg-type]
    Trainer.is_global_zero, Trainer.global_step = False, 30
    ProgressLog(str(path), every=10).on_train_batch_end(Trainer())  # type: ignore[arg-type]
    lines = path.read_text().splitlines()
    assert len(lines) == 1 and lines[0].endswith(" 20"), lines
