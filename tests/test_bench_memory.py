"""The bench's memory table (``lightning_sync/bench/memory.py``): the peak-RSS reset it relies on, the schedule and
its checks, the table, and one small run of two rows in their own processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from lightning_sync.bench.memory import MemoryResult, memory_markdown, memory_trials, peak_rss_mib, reset_peak_rss

__all__: list[str] = []

ZERO3 = {"_target_": "lightning_sync.strategies.sharded.ShardedStrategy", "stage": 3, "wrap_policy": ["Block"]}
# the bench's models hold torchmetrics states, which a model built in trainer.init_module() under zero3 cannot move
TINY = {"model": {"_target_": "support.block_net.BlockLM"}, "data": {"_target_": "support.block_net.TokenData"}}


def _cfg(rows: dict[str, Any], **kw: Any) -> Any:
    memory = {"world_size": 2, "pairs": 2, "steps": 2, "warmup_steps": 1, "timeout_s": 120, "model": TINY, "rows": rows}
    return OmegaConf.create({"memory": {**memory, **kw}})


def test_the_peak_resets_to_the_current_resident_set() -> None:
    start = reset_peak_rss()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    assert peak_rss_mib() >= start + 60
    del block
    now = reset_peak_rss()
    assert peak_rss_mib() < start + 60 and abs(peak_rss_mib() - now) < 8


def test_trials_alternate_the_rows_and_check_them() -> None:
    rows = {"a": {"strategy": ZERO3}, "b": {"strategy": ZERO3, "init_module": True, "deferred": True}}
    trials = memory_trials(_cfg(rows))
    assert [(t.name, t.extra["round"], t.extra["init_module"], t.extra["deferred"], t.devices) for t in trials] == [
        ("a", 0, False, False, 2),
        ("b", 0, True, True, 2),
        ("b", 1, True, True, 2),
        ("a", 1, False, False, 2),
    ]
    for rows, match in (
        ({}, "at least one row"),
        ({"a": {"strategy": ZERO3, "offload": True}}, r"memory.rows.a must have a strategy node .*'offload'"),
        ({"a": {"strategy": ZERO3, "init_module": "yes"}}, r"memory.rows.a.init_module must be True or False"),
        ({"a": {"strategy": ZERO3, "deferred": 1}}, r"memory.rows.a.deferred must be True or False"),
    ):
        with pytest.raises(ValueError, match=match):
            memory_trials(_cfg(rows))
    with pytest.raises(ValueError, match="memory.pairs"):
        memory_trials(_cfg({"a": {"strategy": ZERO3}}, pairs=0))


def test_the_table_takes_the_largest_rank_and_the_median_round() -> None:
    def result(name: str, rnd: int, rank: int, setup: float, step: float) -> MemoryResult:
        engine = {"device": {"params": 2**20, "grads": 0, "optimizer": 0}, "host": {"params": 3 * 2**20}}
        engine = engine if name == "z" else None
        return MemoryResult(name, rnd, rank, 300.0, setup, setup + 10, [step], engine=engine, base_mib=310.0)

    d_steps, z_steps = [1.0, 2.0, 1.0], [1.5, 2.0, 3.0]  # same-round ratios 1.5, 1.0, 3.0: median 1.5 (not 2.0 / 1.0)
    results = [result("d", k, r, 400 + 10 * k + r, d_steps[k]) for k in range(3) for r in range(2)]
    results += [result("z", k, r, 350 + r, z_steps[k]) for k in range(3) for r in range(2)]
    text = memory_markdown(results, _cfg({}), {"cpu": "test cpu", "date": "2026-11-28"}, {"d": 55.0, "z": None})
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in text.splitlines()[5:]}
    # d: the largest rank per round is 401, 411, 421 -> median 411; above the start (300): 111; training above the
    # base (310): 111, predicted 55 of it
    assert rows["d"] == ["411", "421", "111", "121", "111", "55", "0.50", "1.000", "1.00", "n/a"]
    assert rows["z"] == ["351", "361", "51", "61", "51", "n/a", "n/a", "2.000", "1.50", "1.0 / 3.0"]
    assert "test cpu, 2026-11-28" in text


@pytest.mark.timeout(300)
def test_a_small_run_measures_every_row_in_its_own_processes(tmp_path: Path) -> None:
    """One round of ZeRO-3 built eagerly and inside trainer.init_module() (deferred), each trial 2 ranks of its
    own; the model is too small for its memory to show beside the process's, so the figures are checked to be
    there, not compared."""
    from lightning_sync.bench.memory import run_memory

    cfg = _cfg({"zero3": {"strategy": ZERO3}, "zero3_init_module": {"strategy": ZERO3, "init_module": True}}, pairs=1)
    results = run_memory(cfg, tmp_path)
    assert sorted((r.name, r.rank) for r in results) == [(n, k) for n in ("zero3", "zero3_init_module") for k in (0, 1)]
    for r in results:
        assert 0 < r.start_mib <= r.setup_mib and 0 < r.train_mib, r
        assert len(r.step_s) == 2 and all(s > 0 for s in r.step_s), r
        assert r.engine is not None and r.engine["host"]["optimizer"] == 0 and r.engine["device"]["optimizer"] > 0
    # the engine materialized the init_module row's model itself (deferred), and not the other's
    assert {r.name: r.init_peak_mib is not None for r in results} == {"zero3": False, "zero3_init_module": True}
    assert (tmp_path / "memory.md").read_text().count("| zero3") == 2 and (tmp_path / "memory.json").is_file()
    # both rows are ZeRO-3 with the same units: the same prediction, every term there
    predicted = json.loads((tmp_path / "memory_predicted.json").read_text())
    assert predicted["zero3"] == predicted["zero3_init_module"] and all(v >= 0 for v in predicted["zero3"].values())
    assert predicted["zero3"]["activations"] > 0 and all(r.base_mib is not None for r in results)
