"""`lightning-sync bench`: the schedule alternates, and a tiny real run writes a sound report."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from test_cli import run_cli  # noqa: E402 - tests/ is on sys.path under pytest's rootdir import mode

from lightning_sync.bench import Report, schedule
from lightning_sync.bench.app import select_strategies
from lightning_sync.bench.report import analytic_wire_bytes, analytic_wire_factor, load_raw, wire_bytes
from lightning_sync.bench.rows import Measurement
from lightning_sync.bench.tradeoff import TradeoffResult
from lightning_sync.testing import run_distributed


def test_the_compute_row_sits_mid_round_so_its_samples_lie_a_round_apart() -> None:
    from lightning_sync.bench.app import COMPUTE_ROW, with_compute_row

    rows = with_compute_row({n: ({}, {}) for n in "abcd"})
    assert list(rows) == ["a", "b", COMPUTE_ROW, "c", "d"]
    order = schedule(list(rows), 3)
    at = [i for i, n in enumerate(order) if n == COMPUTE_ROW]
    assert at == [2, 7, 12]  # evenly spread; at the end of the list it would be [4, 5, 14]
    assert list(with_compute_row({})) == [COMPUTE_ROW]


def test_schedule_alternates_and_reverses() -> None:
    assert schedule(["a", "b", "c"], 3) == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    with pytest.raises(ValueError, match="pairs must be >= 1, got 0"):
        schedule(["a"], 0)


ALL_ROWS = [
    "lightning_ddp",
    "bucketed_ddp",
    "bucketed_ddp_fp16",
    "bucketed_ddp_bf16",
    "bucketed_ddp_powersgd",
    "fsdp2",
    "zero1",
    "zero2",
    "zero3",
    "local_sgd",
    "diloco",
]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_quick_suite_smoke_writes_report_with_exact_byte_ratios(tmp_path: Path) -> None:
    """``suite=quick`` with a few steps per strategy (the issue's CI smoke test), the bucket sweep and a
    small all-reduce sweep: every strategy row, the cost model's validation row for each, the plots, and
    the byte figures that are exact by construction. No timing is asserted."""
    proc = run_cli(
        [
            "bench",
            "suite=quick",
            "steps=10",
            "warmup_steps=2",
            "bucket_sweep.enabled=true",
            "bucket_sweep.caps_mb=[1,10000]",
            "cost_model.sweep.largest=65536",
            "cost_model.sweep.repeats=1",
            "models.deep_mlp.data.num_samples=1024",
        ],
        tmp_path,
        timeout=360,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (report,) = (tmp_path / "outputs" / "bench").glob("*/*/report.md")
    for png in ("step_time.png", "bucket_sweep.png", "sharding.png", "fit.png", "projection.png"):
        assert (report.parent / png).stat().st_size > 0
    rows, shard_rows = {}, {}
    for line in report.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 16 and cells[0] == "deep_mlp":
            rows[cells[2]] = cells
        if len(cells) == 10 and cells[0] == "deep_mlp" and cells[1].isdigit():  # not the validation table's
            shard_rows[cells[2]] = cells
    assert set(rows) == set(ALL_ROWS)
    assert all(r[1] == "2" for r in rows.values())  # K
    # column 7 is payload bytes / gradient bytes: exact by construction for plain and cast buckets, and
    # LocalSGD (sync_every 5) averages its parameters twice in the 10 timed steps, DiLoCo (10) once
    assert rows["bucketed_ddp"][7] == "1.000" and rows["bucketed_ddp_fp16"][7] == "0.500"
    assert rows["bucketed_ddp_bf16"][7] == "0.500" and float(rows["bucketed_ddp_powersgd"][7]) < 0.1
    assert rows["local_sgd"][7] == "0.200" and rows["diloco"][7] == "0.100"
    assert rows["lightning_ddp"][4] == "1.000" and rows["fsdp2"][5] == "1.000"  # each reference's ratio to itself
    assert rows["lightning_ddp"][8] == "n/a"  # torch DDP's traffic is outside comms
    # column 13, covered: zero3 computes a unit's forward with the next unit's all-gather in flight (prefetch);
    # torch's DDP and FSDP2 issue their calls outside comms, which cannot see them in flight
    assert float(rows["zero3"][13]) > 0, rows["zero3"]
    assert rows["lightning_ddp"][13] == rows["fsdp2"][13] == "n/a", (rows["lightning_ddp"], rows["fsdp2"])
    # FSDP2's is counted while its trials run: two all-gathers of the half shard and one reduce-scatter of
    # the whole, 2 x the gradient bytes. zero3 keeps its last two groups of units gathered from forward into
    # backward (with prefetch; groups within coalesce_mb), which on deep_mlp are all of them (the first Linear,
    # then the other 7): 1 (reduce-scatter) + 0.5 (forward's gathers), no gather for backward
    assert rows["fsdp2"][7] == "2.000" and rows["zero3"][7] == "1.500", (rows["fsdp2"], rows["zero3"])
    assert re.search(r"Single-process step time T1\(b\) \(ms\): deep_mlp \d", report.read_text())
    # sharding table: K, step ms, x lightning_ddp, x fsdp2, peak, wire, analytic, wire / analytic
    assert list(shard_rows) == ["lightning_ddp", "bucketed_ddp", "fsdp2", "zero1", "zero2", "zero3"]
    # measured wire bytes hit the analytic figure exactly (deep_mlp's units split evenly over 2 ranks, no
    # padding): DDP one all-reduce, ZeRO-1/2 reduce-scatter + all-gather, FSDP2 two all-gathers + one
    # reduce-scatter of every parameter byte; zero3 the same less the second gather of its last two groups,
    # all of deep_mlp's: 1 / 1.5 of the textbook 3(K-1)/K * S
    for name in ("bucketed_ddp", "zero1", "zero2", "fsdp2"):
        assert shard_rows[name][9] == "1.000", shard_rows[name]
    assert shard_rows["zero3"][9] == "0.667", shard_rows["zero3"]
    assert shard_rows["zero3"][8] == shard_rows["fsdp2"][8]  # the same textbook figure, like for like
    assert float(shard_rows["zero3"][7]) == pytest.approx(2 / 3 * float(shard_rows["fsdp2"][7]), rel=1e-3)
    assert float(shard_rows["fsdp2"][8]) == pytest.approx(1.5 * float(shard_rows["bucketed_ddp"][8]), rel=1e-3)
    # the cost model: a fit per swept op, a finite prediction for every row, a projection to 4096 ranks
    data = json.loads((report.parent / "report.json").read_text())
    assert set(data["fits"]) == {
        "backend",
        "ring",
        "tree",
        "all_gather",
        "reduce_scatter",
        "torch_all_gather",
        "torch_reduce_scatter",
    }
    assert {v["strategy"] for v in data["validation"]} == set(ALL_ROWS)
    # codec arithmetic is measured exactly where a compressor runs (PowerSGD past its 2 warm-up steps)
    codec = {v["strategy"]: v["codec_s"] for v in data["validation"]}
    assert all(codec[n] > 0 for n in ("bucketed_ddp_fp16", "bucketed_ddp_bf16", "bucketed_ddp_powersgd")), codec
    assert all(codec[n] == 0 for n in ALL_ROWS if "_fp16" not in n and "_bf16" not in n and "powersgd" not in n), codec
    assert all(math.isfinite(v["predicted_s"]) and v["predicted_s"] > 0 for v in data["validation"])
    # the synchronization period comes from the steps that issued collectives: LocalSGD and DiLoCo's config
    every = {v["strategy"]: v["sync_every"] for v in data["validation"]}
    assert every == {n: {"local_sgd": 5, "diloco": 10}.get(n, 1) for n in ALL_ROWS}, every
    # the compute rows ran among the strategies at K=2 (in step), and T1 alone
    assert {(c["model"], c["concurrent"]) for c in data["compute_s"]} == {("deep_mlp", 1), ("deep_mlp", 2)}
    # FSDP2 ran at one rank too, among the T1 rounds, and the validation adds its host work to its rows only
    assert [(h["model"], h["strategy"]) for h in data["host_s"]] == [("deep_mlp", "fsdp2")]
    assert {v["strategy"] for v in data["validation"] if v["host_s"] != 0} <= {"fsdp2"}
    assert {p["world"] for p in data["projection"]} == {8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096}
    assert all(r["torch"] and r["lightning"] and r["cpu"] and r["date"] and r["command"] for r in data["rows"])
    assert "## Cost model" in report.read_text() and "### Projection to K ranks" in report.read_text()
    # the raw measurements rebuild the same report with the run's own config
    from omegaconf import OmegaConf

    results, single, params, meta = load_raw(report.parent / "raw.json")
    cfg = OmegaConf.load(report.parent / ".hydra" / "config.yaml")
    again = Report(results, single, cfg, meta, params)
    assert again.markdown() == report.read_text()


# --------------------------------------------------------------------------- wire bytes arithmetic

DDP = {"_target_": "lightning.pytorch.strategies.DDPStrategy"}
FSDP2 = {"_target_": "lightning_sync.bench.fsdp2.FullyShardStrategy", "shard_classes": ["torch.nn.Linear"]}


def _zero(stage: int, **kw: object) -> dict[str, object]:
    return {"_target_": "lightning_sync.strategies.sharded.ShardedStrategy", "stage": stage, **kw}


def test_wire_bytes_apply_the_ring_factor_of_each_op() -> None:
    # K=4: all_reduce 2*3/4 = 1.5, reduce_scatter 3/4, all_gather 3 (payload = one shard), send 1,
    # recv 0 (the sender counts it), barrier 0, an op the table does not know counts once
    ops = {"all_reduce": 100, "reduce_scatter": 40, "all_gather": 10, "send": 7, "recv": 999, "barrier": 0, "custom": 5}
    assert wire_bytes(ops, 4) == pytest.approx(150 + 30 + 30 + 7 + 5)
    assert wire_bytes({"all_reduce": 8, "all_gather": 8, "reduce_scatter": 8}, 1) == 0.0  # one rank sends nothing
    # ZeRO-3 on K=2 with S=1000 bytes: two all-gathers of a 500-byte shard and one reduce-scatter of
    # the full 1000 bytes are exactly the analytic 3(K-1)/K * S = 1500
    assert wire_bytes({"all_gather": 2 * 500, "reduce_scatter": 1000}, 2) == pytest.approx(1500)
    with pytest.raises(ValueError, match="world size must be an int >= 1, got 0"):
        wire_bytes({}, 0)


def test_analytic_wire_bytes_per_strategy() -> None:
    s = 1000.0
    assert analytic_wire_bytes(DDP, s, 2) == pytest.approx(1000)  # 2(K-1)/K * S
    assert analytic_wire_bytes(DDP, s, 4) == pytest.approx(1500)
    assert analytic_wire_bytes({"_target_": None}, s, 1) == 0.0
    assert analytic_wire_bytes(_zero(1), s, 4) == pytest.approx(1500)
    assert analytic_wire_bytes(_zero(2), s, 4) == pytest.approx(1500)
    assert analytic_wire_bytes(_zero(3, wrap_policy=["torch.nn.Linear"]), s, 4) == pytest.approx(2250)  # 3(K-1)/K
    assert analytic_wire_bytes(_zero(3, reshard_after_forward=False), s, 4) == pytest.approx(1500)
    assert analytic_wire_bytes({k: v for k, v in _zero(3).items() if k != "stage"}, s, 2) == pytest.approx(1500)
    assert analytic_wire_bytes(FSDP2, s, 2) == pytest.approx(1500)
    assert analytic_wire_bytes({**FSDP2, "reshard_after_forward": False}, s, 2) == pytest.approx(1000)
    with pytest.raises(ValueError, match=r"stage must be one of \[1, 2, 3\], got 4"):
        analytic_wire_factor(_zero(4), 2)
    with pytest.raises(ValueError, match="param_bytes must be >= 0, got -1"):
        analytic_wire_bytes(DDP, -1, 2)


def _result(
    name: str,
    strategy: dict[str, object],
    step_ms: float,
    ops: dict[str, float],
    calls: int,
    peak: float,
    world: int = 2,
    param_bytes: int = 2**20,
) -> Measurement:
    return Measurement(
        name=name,
        model="m",
        world=world,
        step_s=[step_ms / 1e3] * 3,
        bytes_per_step=sum(ops.values()),
        op_bytes_per_step=ops,
        comm_calls=calls,
        param_bytes=param_bytes,
        strategy=strategy,
        peak_mib=peak,
    )


def test_report_sharding_table_measured_against_analytic(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    mib = 2**20
    cfg = OmegaConf.create(
        {
            "baseline": "lightning_ddp",
            "pairs": 2,
            "steps": 3,
            "warmup_steps": 1,
            "sharding_table": {"rows": ["lightning_ddp", "bucketed_ddp", "fsdp2", "zero3"], "reference": "fsdp2"},
        }
    )
    bucketed = {"_target_": "lightning_sync.strategies.bucketed_ddp.BucketedDDPStrategy"}
    one_pair = [
        ("lightning_ddp", DDP, 100.0, {}, 0),
        ("bucketed_ddp", bucketed, 110.0, {"all_reduce": mib}, 4),
        ("fsdp2", FSDP2, 200.0, {}, 0),
        # zero3 that gathers once more than it should (3 all-gathers of the half shard): 1.25 MiB over 1.5 analytic
        (
            "zero3",
            _zero(3, wrap_policy=["torch.nn.Linear"]),
            300.0,
            {"all_gather": 3 * mib / 2, "reduce_scatter": mib, "broadcast": 0},
            9,
        ),
    ]
    rank0 = [_result(n, s, t, o, c, peak=50.0) for n, s, t, o, c in one_pair * 2]
    rank1 = [_result(n, s, t, o, c, peak=70.0) for n, s, t, o, c in one_pair * 2]
    meta = {
        "date": "2026-01-01",
        "cpu": "cpu",
        "python": "3",
        "torch": "t",
        "lightning": "l",
        "world_size": 2,
        "threads_per_rank": 1,
        "command": "x",
    }
    for i, t in enumerate(rank0):  # zero3 computed with a call in flight: 10 ms a step in one pair, 30 in the other
        if t.name == "zero3":
            t.covered_s = [0.01 if i < len(one_pair) else 0.03] * 3
    report = Report([rank0, rank1], [], cfg, meta)
    covered = {r.strategy: r.covered_ms for r in report.rows()}
    assert covered["zero3"] == pytest.approx(20.0) and math.isnan(covered["bucketed_ddp"])  # median of the pairs
    rows = {r.strategy: r for r in report.sharding_rows()}
    assert list(rows) == ["lightning_ddp", "bucketed_ddp", "fsdp2", "zero3"]
    assert rows["zero3"].ratio == pytest.approx(3.0) and rows["zero3"].ratio_ref == pytest.approx(1.5)
    assert rows["fsdp2"].ratio == pytest.approx(2.0) and rows["lightning_ddp"].ratio_ref == pytest.approx(0.5)
    assert rows["zero3"].peak_mib == 70.0  # the largest over ranks
    assert rows["bucketed_ddp"].wire_x_analytic == pytest.approx(1.0)
    assert rows["zero3"].wire_measured_mib == pytest.approx(1.5 + 0.5)
    assert rows["zero3"].wire_analytic_mib == pytest.approx(1.5)
    assert rows["zero3"].wire_x_analytic == pytest.approx(2.0 / 1.5)
    assert not rows["fsdp2"].measured and not rows["lightning_ddp"].measured
    text = report.markdown()
    assert "| m | 2 | zero3 | 300.0 | 3.000 | 1.500 | 70 | 2.00 | 1.50 | 1.333 |" in text
    assert "| m | 2 | fsdp2 | 200.0 | 2.000 | 1.000 | 70 | n/a | 1.50 | n/a |" in text
    assert "| m | 2 | lightning_ddp | 100.0 | 1.000 | 0.500 | 70 | n/a | 1.00 | n/a |" in text
    report.write(tmp_path)
    assert (tmp_path / "sharding.png").stat().st_size > 0
    # without a sharded row there is no sharding table
    plain = Report([rank0[:2], rank1[:2]], [], cfg, meta)
    assert plain.sharding_rows() == [] and "## Sharding" not in plain.markdown()


def test_in_step_compute_rows_give_the_compute_and_are_not_strategy_rows() -> None:
    from omegaconf import OmegaConf

    from lightning_sync.bench.app import COMPUTE_ROW
    from lightning_sync.bench.runner import IN_STEP

    cfg = OmegaConf.create({"baseline": "lightning_ddp", "pairs": 2, "steps": 3, "warmup_steps": 1})
    meta = {
        "date": "d",
        "cpu": "c",
        "python": "3",
        "torch": "t",
        "lightning": "l",
        "threads_per_rank": 1,
        "command": "x",
    }

    def in_step(times: list[float]) -> Measurement:
        return replace(
            _result(COMPUTE_ROW, {"_target_": None}, 0.0, {}, 0, peak=1.0), step_s=times, extra={IN_STEP: True}
        )

    ddp = _result("lightning_ddp", DDP, 100.0, {}, 0, peak=1.0)
    # two rounds, each: ddp, then the compute row; per step the slower rank counts (a step waits for it)
    rank0 = [ddp, in_step([0.010, 0.050, 0.020]), ddp, in_step([0.030, 0.030, 0.030])]
    rank1 = [ddp, in_step([0.020, 0.040, 0.010]), ddp, in_step([0.001, 0.060, 0.002])]
    report = Report([rank0, rank1], [Measurement("single", "m", step_s=[0.005, 0.007, 0.006])], cfg, meta)
    # slowest per step: round 1 [0.020, 0.050, 0.020], round 2 [0.030, 0.060, 0.030] -> median 0.030
    assert report.compute == {("m", 2): pytest.approx(0.030), ("m", 1): pytest.approx(0.006)}
    assert [r.strategy for r in report.rows()] == ["lightning_ddp"]
    assert COMPUTE_ROW not in report.markdown()


def test_one_rank_rounds_give_t1_over_every_round_and_the_host_rows_work() -> None:
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"baseline": "lightning_ddp", "pairs": 3, "steps": 3, "warmup_steps": 1})
    meta = {
        "date": "d",
        "cpu": "c",
        "python": "3",
        "torch": "t",
        "lightning": "l",
        "threads_per_rank": 1,
        "command": "x",
    }
    ddp = _result("lightning_ddp", DDP, 100.0, {}, 0, peak=1.0)
    # three rounds of the one-rank schedule: single, fsdp2 / fsdp2, single / single, fsdp2
    single = [Measurement("single", "m", step_s=s) for s in ([0.010, 0.011], [0.030, 0.031], [0.012, 0.013])]
    host = [Measurement("fsdp2", "m", step_s=s) for s in ([0.020], [0.019], [0.050])]
    report = Report([[ddp], [ddp]], [single[0], host[0], host[1], single[1], single[2], host[2]], cfg, meta)
    # T1: the median over rounds of each round's median (not the last round's): 0.0125
    assert report.compute[("m", 1)] == pytest.approx(0.0125)
    assert report.host == {("m", "fsdp2"): pytest.approx(0.020 - 0.0125)}
    assert (
        "Host work at one rank, the row's single-process step less T1 (ms; the cost model adds it): fsdp2 on m +7.5"
    ) in report.markdown()
    assert report.as_json()["host_s"] == [{"model": "m", "strategy": "fsdp2", "seconds": pytest.approx(0.0075)}]


def test_host_rows_must_name_strategy_rows() -> None:
    from omegaconf import OmegaConf

    from lightning_sync.bench.app import host_rows

    cfg = OmegaConf.create(
        {"strategies": {"lightning_ddp": DDP, "fsdp2": FSDP2}, "cost_model": {"host_rows": ["fsdp2"]}}
    )
    assert host_rows(cfg, {"lightning_ddp": DDP, "fsdp2": FSDP2}) == {"fsdp2": (FSDP2, {})}
    assert host_rows(cfg, {"lightning_ddp": DDP}) == {}  # a row not selected by run_strategies is not run
    cfg.cost_model.host_rows = ["fsdp3"]
    with pytest.raises(
        ValueError,
        match=r"cost_model.host_rows must name rows of strategies \['lightning_ddp', "
        r"'fsdp2'\], got \['fsdp3'\]",
    ):
        host_rows(cfg, {"lightning_ddp": DDP})


def test_a_periodic_row_is_timed_and_predicted_over_windows_of_its_period() -> None:
    from omegaconf import OmegaConf

    from lightning_sync.bench.app import COMPUTE_ROW
    from lightning_sync.bench.runner import IN_STEP

    cfg = OmegaConf.create({"baseline": "lightning_ddp", "pairs": 1, "steps": 6, "warmup_steps": 1})
    meta = {
        "date": "d",
        "cpu": "c",
        "python": "3",
        "torch": "t",
        "lightning": "l",
        "threads_per_rank": 1,
        "command": "x",
    }
    ddp = replace(_result("lightning_ddp", DDP, 100.0, {}, 0, peak=1.0), step_s=[0.010, 0.011, 0.012])
    # communicates on steps 3 and 6 (H = 3), and those steps hold the wait for the other rank: the median
    # of single steps (0.010) would leave the synchronization out; the median window mean is 0.020
    local = replace(
        _result("local_sgd", {"_target_": "x.LocalSGDStrategy"}, 10.0, {"all_reduce": 10.0}, 2, peak=1.0),
        step_s=[0.010, 0.010, 0.040, 0.010, 0.010, 0.040],
        step_calls=[0, 0, 1, 0, 0, 1],
    )

    def in_step(times: list[float]) -> Measurement:
        return replace(
            _result(COMPUTE_ROW, {"_target_": None}, 0.0, {}, 0, peak=1.0), step_s=times, extra={IN_STEP: True}
        )

    rank0 = [ddp, local, in_step([0.010, 0.010, 0.040, 0.010, 0.010, 0.040])]
    rank1 = [ddp, local, in_step([0.040, 0.010, 0.010, 0.040, 0.010, 0.010])]
    report = Report([rank0, rank1], [Measurement("single", "m", step_s=[0.005])], cfg, meta)
    rows = {r.strategy: r for r in report.rows()}
    assert rows["local_sgd"].sync_every == 3 and rows["lightning_ddp"].sync_every == 1
    assert rows["local_sgd"].step_ms == pytest.approx(20.0) and rows["lightning_ddp"].step_ms == pytest.approx(11.0)
    # compute: per step the slower rank, [40, 10, 40, 40, 10, 40] ms -> 40; per window of 3 steps both
    # ranks average 20 ms -> 20 (a rank's slow step is made up by its fast ones before the ranks meet)
    assert report.compute[("m", 2)] == pytest.approx(0.040)
    assert report.compute_every("m", 2, 3) == pytest.approx(0.020)
    assert math.isnan(report.compute_every("m", 2, 8))  # no whole window of 8 steps was measured


def _count_torch_collectives(rank: int, world: int) -> object:
    import torch
    import torch.distributed as dist

    from lightning_sync.bench.runner import stats_of, torch_collectives_counted

    original = dist.all_gather_single
    strategy = object.__new__(type("Foreign", (), {}))  # not ours: the bench keeps its statistics on it
    shard = torch.full((3,), float(rank))
    whole = torch.arange(8.0)
    with torch_collectives_counted(strategy):
        gathered = torch.empty(3 * world)
        dist.all_gather_single(gathered, shard)
        reduced = torch.empty(8 // world)
        work = dist.reduce_scatter_single(output=reduced, input=whole, async_op=True)
        work.wait()
    dist.all_gather_single(gathered, shard)  # after the block: not counted
    snap = stats_of(strategy).snapshot()
    return (
        dist.all_gather_single is original,
        gathered.tolist(),
        reduced.tolist(),
        {op: (s.calls, s.bytes) for op, s in snap.items()},
    )


def test_torch_collectives_are_counted_as_comms_ops_while_the_block_runs() -> None:
    (restored, gathered, reduced, ops), _ = run_distributed(_count_torch_collectives, 2, timeout=120)
    assert restored
    # the collectives still run: rank 0's shard then rank 1's; the sum over 2 ranks of arange(8), rank 0's half
    assert gathered == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0] and reduced == [0.0, 2.0, 4.0, 6.0]
    # payloads as comms counts them: the all-gather's own shard (3 floats), the reduce-scatter's whole input
    assert ops == {"torch_all_gather": (1, 12), "torch_reduce_scatter": (1, 32)}


def _sweep_order(rank: int, world: int, sizes: list[int], algorithms: list[str], repeats: int) -> object:
    from lightning_sync.bench import sweep

    order: list[tuple[int, str]] = []
    real = sweep._run

    def recording(ctx: object, op: str, whole: torch.Tensor) -> None:
        order.append((whole.numel() * 4, op))
        real(ctx, op, whole)

    sweep._run = recording
    try:
        points = sweep.sweep_all_reduce(rank, world, sizes, algorithms, repeats)
    finally:
        sweep._run = real
    return points, order


def test_sweep_passes_over_every_size_per_repeat_and_reports_every_time_per_point() -> None:
    sizes, algorithms = [1024, 4096], ["backend", "ring"]
    (points, order), (points1, _) = run_distributed(_sweep_order, 2, sizes, algorithms, 3, timeout=120)
    assert points == points1  # every rank reports the same all-reduced times
    assert [(p.bytes, p.algorithm) for p in points] == [(n, a) for n in sizes for a in algorithms]
    # the times themselves are the benchmark's to judge (the fit table of the report), not a test's
    # (the report prints span / rank time per K: CostModel.span_ratio)
    assert all(
        p.world == 2 and all(isinstance(getattr(p, t), float) for t in ("seconds", "median_seconds", "rank_seconds"))
        for p in points
    )
    # one warm-up per point, then each repeat passes over every size, the algorithms alternating: a burst
    # of load hits one repeat of several sizes (a little on each mean), not every repeat of one size
    warm = [(n, a) for n in sizes for a in algorithms]
    passes = [[(n, a) for n in sizes for a in (algorithms if r % 2 == 0 else algorithms[::-1])] for r in range(3)]
    assert order == warm + [x for p in passes for x in p]


# --------------------------------------------------------------------------- strategy selection


def test_select_strategies_subset_keeps_baseline_and_fails_fast() -> None:
    from omegaconf import OmegaConf

    rows = {"lightning_ddp": DDP, "fsdp2": FSDP2, "broken": {"_target_": "lightning_sync.no_such_module.Nope"}}
    cfg = OmegaConf.create({"baseline": "lightning_ddp", "strategies": rows, "run_strategies": ["fsdp2"]})
    assert list(select_strategies(cfg)) == ["lightning_ddp", "fsdp2"]
    cfg.run_strategies = ["fsdp2", "zero9"]
    with pytest.raises(ValueError, match=r"run_strategies must name rows of strategies .*got \['zero9'\]"):
        select_strategies(cfg)
    cfg.run_strategies = None
    with pytest.raises(
        ImportError,
        match=r"strategy row 'broken': cannot import 'lightning_sync.no_such_module.Nope'"
        r".*run_strategies=\[lightning_ddp,fsdp2\]",
    ):
        select_strategies(cfg)
    cfg.baseline = "nope"
    with pytest.raises(ValueError, match="baseline must be one of"):
        select_strategies(cfg)


# --------------------------------------------------------------------------- the FSDP2 baseline


def test_fully_shard_strategy_rejects_bad_arguments() -> None:
    from lightning_sync.bench.fsdp2 import FullyShardStrategy, resolve_classes

    assert resolve_classes(["torch.nn.Linear", "torch.nn.Conv1d"]) == (torch.nn.Linear, torch.nn.Conv1d)
    with pytest.raises(ValueError, match=r"nn.Module subclasses .*got 'torch.nn.NoSuchLayer'"):
        FullyShardStrategy(shard_classes=["torch.nn.NoSuchLayer"])
    with pytest.raises(ValueError, match=r"got 'torch.tensor'"):
        FullyShardStrategy(shard_classes=["torch.tensor"])
    with pytest.raises(ValueError, match="must be a list of dotted class names, got 'torch.nn.Linear'"):
        FullyShardStrategy(shard_classes="torch.nn.Linear")
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        FullyShardStrategy(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="reshard_after_forward must be True or False, got 'yes'"):
        FullyShardStrategy(reshard_after_forward="yes")  # type: ignore[arg-type]


class _LossLog(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: object, *args: object
    ) -> None:
        self.losses.append(float(outputs["loss"]))  # type: ignore[index]


def _fit_fsdp2_and_ddp(rank: int, world: int) -> dict[str, object]:
    """Fit the same tiny WideMLP with the FSDP2 baseline and with Lightning DDP; report what each did."""
    import logging
    import warnings

    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from lightning_sync.bench.fsdp2 import FullyShardStrategy
    from lightning_sync.models.synthetic import SyntheticDataModule, WideMLP

    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    out: dict[str, object] = {}
    for name in ("fsdp2", "ddp"):
        pl.seed_everything(0, verbose=False)
        model = WideMLP(in_features=16, hidden=33, lr=0.1)  # 33: dim 0 does not split evenly over 2 ranks
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        log = _LossLog()
        strategy = FullyShardStrategy(shard_classes=["torch.nn.Linear"]) if name == "fsdp2" else DDPStrategy()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=strategy,
            max_steps=4,
            max_epochs=-1,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[log],
        )
        trainer.fit(model, datamodule=SyntheticDataModule(num_samples=256, in_features=16, batch_size=8))
        params = dict(model.named_parameters())
        out[name] = {
            "losses": log.losses,
            "before": before,
            "after": {
                k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                for k, v in model.state_dict().items()
            },
            "units": sum(isinstance(m, FSDPModule) for m in model.modules()),
            "local_numel": {k: (p.to_local() if isinstance(p, DTensor) else p).numel() for k, p in params.items()},
            "hook_left": "configure_model" in model.__dict__,
        }
    return out


@pytest.mark.timeout(240)
def test_fsdp2_baseline_trains_like_ddp_on_two_ranks() -> None:
    results = run_distributed(_fit_fsdp2_and_ddp, 2, timeout=200, env={"PL_GLOBAL_SEED": "0"})
    for rank, res in enumerate(results):
        fsdp, ddp = res["fsdp2"], res["ddp"]
        assert len(fsdp["losses"]) == 4 and all(math.isfinite(x) for x in fsdp["losses"])
        assert fsdp["units"] == 4  # three Linear units plus the root
        assert not fsdp["hook_left"]  # the installed configure_model is gone after teardown
        for key, w in fsdp["after"].items():
            assert (w - fsdp["before"][key]).abs().max() > 1e-3, f"rank {rank}: {key} did not train"
        # every rank holds only its shard: 33 rows split 17 + 16
        assert fsdp["local_numel"]["net.0.weight"] == (17 if rank == 0 else 16) * 16
        assert fsdp["local_numel"]["net.0.bias"] == (17 if rank == 0 else 16)
        # Same seed, same DistributedSampler batches, gradients averaged over the same 2 ranks: FSDP2
        # (reduce-scatter) and DDP (all-reduce) differ only in float32 rounding of the average (~1e-7
        # relative); 4 SGD steps at lr 0.1 on weights <= ~1 keep that below 1e-5, while a missing
        # average or a skipped unit moves weights by ~1e-3 or more.
        assert fsdp["losses"] == pytest.approx(ddp["losses"], abs=1e-5)
        for key, w in ddp["after"].items():
            torch.testing.assert_close(fsdp["after"][key], w, rtol=0.0, atol=1e-5)


# --------------------------------------------------------------------------- the synchronization trade-off


def _trade(name: str, slow: float | None, rnd: int, loss: float, mib: float, wall: float) -> TradeoffResult:
    return TradeoffResult(name, "m", slow, rnd, loss, mib * 2**20, wall, 1000, 1000 / wall, [4, 4])


def test_tradeoff_rows_take_same_round_ratios_and_check_the_targets() -> None:
    from omegaconf import OmegaConf

    from lightning_sync.bench.tradeoff import tradeoff_markdown, tradeoff_rows

    results = [
        # round 0: the machine is slow for both rows; round 1: fast. Same-round ratios cancel that out.
        _trade("bucketed_ddp", None, 0, 2.0, 80.0, 20.0),
        _trade("local_sgd", None, 0, 2.02, 10.0, 18.0),
        _trade("bucketed_ddp", None, 1, 2.0, 80.0, 10.0),
        _trade("local_sgd", None, 1, 2.08, 10.0, 9.0),
        _trade("bucketed_ddp", 2.0, 0, 2.0, 80.0, 40.0),
        _trade("async_ps", 2.0, 0, 2.04, 40.0, 25.0),
        _trade("bucketed_ddp", 2.0, 1, 2.0, 80.0, 20.0),
        _trade("async_ps", 2.0, 1, 2.06, 40.0, 16.0),
    ]
    rows = {(r.name, r.slow): r for r in tradeoff_rows(results)}
    local = rows[("local_sgd", None)]
    assert local.x_bytes == pytest.approx(0.125)
    assert local.x_loss == pytest.approx((1.01 + 1.04) / 2)  # median of the two same-round ratios
    assert local.x_throughput == pytest.approx((20 / 18 + 10 / 9) / 2)
    ps = rows[("async_ps", 2.0)]
    assert ps.x_throughput == pytest.approx((40 / 25 + 20 / 16) / 2)  # 1.6 and 1.25: median 1.425
    assert rows[("bucketed_ddp", 2.0)].x_throughput == 1.0
    cfg = OmegaConf.create({"tradeoff": {"steps": 4, "world_size": 2, "pairs": 2, "reference": "bucketed_ddp"}})
    text = tradeoff_markdown(results, cfg)
    assert "m local_sgd: bytes x0.1250 <= 0.1250: met; loss x1.025 <= 1.03: met" in text
    assert "m async_ps with the straggler: throughput x1.43 >= 1.4: met; loss x1.025 <= 1.05: met" in text


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tradeoff_smoke_runs_every_strategy_and_writes_the_plot(tmp_path: Path) -> None:
    """Every trade-off row for 8 steps (no straggler rows): the report and plot exist, LocalSGD with
    sync_every=8 sends exactly 1/8 of DDP's bytes, DiLoCo (sync_every=50) sends nothing in 8 steps and
    Hogwild sends nothing at all."""
    proc = run_cli(
        ["bench", "suite=tradeoff", "tradeoff.pairs=1", "tradeoff.steps=8", "tradeoff.slow_factor=null"],
        tmp_path,
        timeout=360,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (report,) = (tmp_path / "outputs" / "bench").glob("*/*/tradeoff.md")
    assert (report.parent / "tradeoff.png").stat().st_size > 0
    rows = {}
    for line in report.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 11 and cells[0] in ("char_gpt", "bow_topics"):
            rows[(cells[0], cells[1])] = cells
    assert set(rows) == {("char_gpt", n) for n in ("bucketed_ddp", "local_sgd", "diloco", "async_ps")} | {
        ("bow_topics", "bucketed_ddp"),
        ("bow_topics", "hogwild"),
    }
    assert rows[("char_gpt", "local_sgd")][6] == "0.1250"  # column 6: bytes / bucketed_ddp's bytes
    assert rows[("char_gpt", "diloco")][6] == "0.0000" and rows[("bow_topics", "hogwild")][6] == "0.0000"
    assert rows[("char_gpt", "bucketed_ddp")][10] == "[8, 8]"
    for cells in rows.values():
        assert math.isfinite(float(cells[3])), cells  # a real validation loss for every row


# --------------------------------------------------------------------------- Streaming DiLoCo


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_streaming_suite_measures_peak_and_total_bytes_and_checks_the_goals(tmp_path: Path) -> None:
    """Every streaming row on a small deep_mlp for 8 steps at H=4, tau=1 (the last syncs still in flight at the
    end): the report, its goals and the plot exist; the per-step byte counts add up exactly (DiLoCo's peak is one
    of its two syncs, bucketed DDP's one of its eight all-reduces); the fp32 streaming rows send DiLoCo's bytes
    in all but at most the larger fragment's at their busiest step, and int4 sends far fewer."""
    small = ["models.deep_mlp.model.in_features=32", "streaming.models.deep_mlp.data.in_features=32"]
    small += ["+models.deep_mlp.model.hidden=64", "streaming.models.deep_mlp.data.num_samples=512"]
    every = ["streaming.steps=8", "streaming.sync_every=4", "streaming.overlap_steps=1", "streaming.seeds=[0]"]
    proc = run_cli(["bench", "suite=streaming", "~streaming.models.char_gpt", *every, *small], tmp_path, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (report,) = (tmp_path / "outputs" / "bench").glob("*/*/streaming.md")
    assert (report.parent / "streaming.png").stat().st_size > 0
    text = report.read_text()
    names = ["bucketed_ddp", "local_sgd", "diloco"] + [f"streaming_f{f}_{d}" for f in (2, 4) for d in ("fp32", "int4")]
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 14 and cells[0] == "deep_mlp":
            rows[cells[1]] = cells
    assert list(rows) == names
    for cells in rows.values():
        assert math.isfinite(float(cells[5])) and float(cells[12]) >= 0, cells  # val loss, exposed seconds
    assert rows["diloco"][9] == "0.2500" and rows["streaming_f2_fp32"][2:5] == ["2", "1", "fp32"]
    got = {r["name"]: r for r in json.loads((report.parent / "streaming.json").read_text())}
    assert got["diloco"]["peak_bytes"] * 2 == got["diloco"]["bytes"]
    assert got["bucketed_ddp"]["peak_bytes"] * 8 == pytest.approx(got["bucketed_ddp"]["bytes"], rel=1e-3)
    for f in (2, 4):
        fp32, int4 = got[f"streaming_f{f}_fp32"], got[f"streaming_f{f}_int4"]
        assert fp32["bytes"] == got["diloco"]["bytes"]  # every fragment synced twice in 8 steps, as DiLoCo's model
        # a fragment is 1/F of the values, to one value: the busiest step moves 1/F of what DiLoCo's does
        assert fp32["peak_bytes"] == pytest.approx(got["diloco"]["peak_bytes"] / f, rel=1e-3)
        assert int4["bytes"] < fp32["bytes"] / 4 and int4["peak_bytes"] < fp32["peak_bytes"] / 4
        assert f"- deep_mlp streaming_f{f}_fp32: bytes x0.2500 of bucketed_ddp <= 0.0100: MISSED; peak/step x" in text
        assert re.search(
            rf"- deep_mlp streaming_f{f}_int4: .* of streaming_f{f}_fp32 <= 1.01 \(median\): (met|MISSED)", text
        )
