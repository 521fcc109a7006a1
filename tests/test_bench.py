"""`lightning-sync bench`: the schedule alternates, and a tiny real run writes a sound report."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_sync.bench import schedule
from test_cli import run_cli  # noqa: E402 - tests/ is on sys.path under pytest's rootdir import mode


def test_schedule_alternates_and_reverses() -> None:
    assert schedule(["a", "b", "c"], 3) == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    with pytest.raises(ValueError, match="pairs must be >= 1, got 0"):
        schedule(["a"], 0)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_smoke_writes_report_with_exact_byte_ratios(tmp_path: Path) -> None:
    proc = run_cli(["bench", "pairs=1", "steps=3", "warmup_steps=3", "run_models=[deep_mlp]",
                    "bucket_sweep.caps_mb=[1,10000]", "scaling.models=[deep_mlp]",
                    "models.deep_mlp.data.num_samples=1024"], tmp_path, timeout=360)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (report,) = (tmp_path / "outputs" / "bench").glob("*/*/report.md")
    assert (report.parent / "step_time.png").stat().st_size > 0
    assert (report.parent / "bucket_sweep.png").stat().st_size > 0
    rows = {}
    for line in report.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 12 and cells[0] == "deep_mlp":
            rows[cells[1]] = cells
    assert set(rows) == {"lightning_ddp", "bucketed_ddp", "bucketed_ddp_fp16", "bucketed_ddp_bf16",
                         "bucketed_ddp_powersgd"}
    # column 5 is payload bytes / gradient bytes: exact by construction for plain and cast buckets
    assert rows["bucketed_ddp"][5] == "1.000" and rows["bucketed_ddp_fp16"][5] == "0.500"
    assert rows["bucketed_ddp_bf16"][5] == "0.500" and float(rows["bucketed_ddp_powersgd"][5]) < 0.1
    assert rows["lightning_ddp"][3] == "1.000"  # the baseline's ratio to itself
    assert re.search(r"Single-process step time T1\(b\) \(ms\): deep_mlp \d", report.read_text())
