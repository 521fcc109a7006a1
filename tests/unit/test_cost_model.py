"""The communication cost model (lightning_sync.bench.model) and the report's use of it (cost_report).

Every expected figure is computed by hand from the formulas in the module docstring; the fit tests
generate points from known latency and bandwidth and require the fit to recover them.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_sync.bench import model as M
from lightning_sync.bench.app import world_sizes
from lightning_sync.bench.cost_report import CostModel, traffic_of
from lightning_sync.bench.report import slowest_per_step, sync_every, window_means
from lightning_sync.bench.rows import Row
from lightning_sync.bench.sweep import price, sweep_sizes

MIB = 2**20
ONE = M.Link(alpha=1e-3, beta=1e-9)  # 1 ms per message, 1 GB/s


def _flat(link: M.Link = ONE, g: int = 1 << 20) -> M.Fabric:
    return M.Fabric(name="flat", intra=link, inter=link, ranks_per_node=g)


@pytest.mark.parametrize(
    ("algorithm", "k", "expected"),
    [
        ("ring", 2, (2, 1.0)),
        ("ring", 4, (6, 1.5)),
        ("backend", 8, (14, 1.75)),
        ("tree", 2, (2, 2)),
        ("tree", 5, (6, 6)),
        ("tree", 1, (0, 0)),
        ("all_gather", 4, (3, 0.75)),
        ("reduce_scatter", 2, (1, 0.5)),
        ("torch_all_gather", 3, (2, 2 / 3)),
        ("torch_reduce_scatter", 4, (3, 0.75)),
    ],
)
def test_coefficients(algorithm: str, k: int, expected: tuple[float, float]) -> None:
    assert M.all_reduce_coefficients(algorithm, k) == pytest.approx(expected)


def test_bad_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match=r"algorithm must be one of .*'tree'.*, got 'star'"):
        M.all_reduce_coefficients("star", 4)
    with pytest.raises(ValueError, match="world must be an int >= 1, got 0"):
        M.all_reduce_coefficients("ring", 0)
    with pytest.raises(ValueError, match=r"Link.beta must be a finite number >= 0, got -1"):
        M.Link(alpha=0.0, beta=-1)
    with pytest.raises(ValueError, match=r"Link.alpha must be a finite number >= 0, got inf"):
        M.Link(alpha=math.inf, beta=0.0)
    with pytest.raises(ValueError, match="ranks_per_node must be an int >= 1, got 0"):
        M.Fabric(name="x", intra=ONE, inter=ONE, ranks_per_node=0)
    with pytest.raises(ValueError, match=r"algorithm must be one of .*, got 'mesh'"):
        M.comm_seconds(M.Traffic({}, 2), 4, _flat(), "mesh")
    with pytest.raises(ValueError, match="compute_s must be > 0, got 0"):
        M.project(M.Traffic({}, 2), 0, _flat(), [8])
    with pytest.raises(ValueError, match="needs >= 2 ring points with world > 1"):
        M.fit_alpha_beta([M.SweepPoint("ring", 2, 8, 1.0)], "ring")
    with pytest.raises(ValueError, match=r"world_sizes must be a non-empty list of ints >= 2, got \[2, 1\]"):
        world_sizes(OmegaConf.create({"world_sizes": [2, 1]}))
    with pytest.raises(ValueError, match="world_sizes must be a non-empty list of ints >= 2, got 4"):
        world_sizes(OmegaConf.create({"world_sizes": 4}))
    assert world_sizes(OmegaConf.create({"world_sizes": [4, 2, 4]})) == [2, 4]


def test_all_reduce_seconds_by_hand() -> None:
    s = 8 * MIB
    # ring over 4 ranks: 6 messages of 1 ms + 1.5 S at 1 GB/s
    assert M.all_reduce_seconds(s, 4, _flat()) == pytest.approx(6e-3 + 1.5 * s * 1e-9)
    # tree: 2 * ceil(log2 4) = 4 rounds, each a message and the whole tensor
    assert M.all_reduce_seconds(s, 4, _flat(), "tree") == pytest.approx(4 * (1e-3 + s * 1e-9))
    # three calls: three times the latency, the same bytes
    assert M.all_reduce_seconds(s, 4, _flat(), "ring", calls=3) == pytest.approx(18e-3 + 1.5 * s * 1e-9)
    # hierarchical over 4 nodes of 8: tree inside a node (2 * 3 rounds) + ring among 4 leaders on the slow link
    fast, slow = M.Link(alpha=1e-6, beta=1e-11), M.Link(alpha=1e-5, beta=1e-10)
    fab = M.Fabric(name="two-level", intra=fast, inter=slow, ranks_per_node=8)
    inside = 6 * (1e-6 + s * 1e-11)
    among = 6 * 1e-5 + 1.5 * s * 1e-10
    assert M.all_reduce_seconds(s, 32, fab, "hierarchical") == pytest.approx(inside + among)
    # a flat ring over 32 ranks spans nodes: the slow link; within one node the fast one, and there
    # hierarchical is the ring
    assert M.all_reduce_seconds(s, 32, fab, "ring") == pytest.approx(62 * 1e-5 + 62 / 32 * s * 1e-10)
    assert M.all_reduce_seconds(s, 8, fab, "hierarchical") == M.all_reduce_seconds(s, 8, fab, "ring")
    assert M.all_reduce_seconds(s, 8, fab, "ring") == pytest.approx(14e-6 + 1.75 * s * 1e-11)


def test_traffic_rescales_shards_only() -> None:
    t = M.Traffic({"all_gather": (4, 1000.0), "reduce_scatter": (2, 2000.0), "all_reduce": (1, 10.0)}, world=2)
    assert t.at(8) == {"all_gather": (4, 250.0), "reduce_scatter": (2, 2000.0), "all_reduce": (1, 10.0)}
    assert t.bytes == 3010.0


def test_comm_seconds_of_a_zero3_like_step_by_hand() -> None:
    # measured at K=2: two all-gathers of a 4 MiB shard (the whole is 8 MiB), one reduce-scatter of 8 MiB,
    # in 3 + 3 and 3 calls; at K=4 the shard is 2 MiB
    t = M.Traffic({"all_gather": (6, 8.0 * MIB), "reduce_scatter": (3, 8.0 * MIB)}, world=2)
    gather = 6 * 3 * 1e-3 + 3 * (8 * MIB / 2) * 1e-9  # calls * (K-1) messages; (K-1) x the 2-rank-shard x 2/4
    scatter = 3 * 3 * 1e-3 + 0.75 * 8 * MIB * 1e-9
    assert M.comm_seconds(t, 4, _flat()) == pytest.approx(gather + scatter)
    # an op-specific link replaces the fabric's for that op only
    slow_gather = M.Link(alpha=2e-3, beta=2e-9)
    fab = M.Fabric(name="x", intra=ONE, inter=ONE, ranks_per_node=64, op_links={"all_gather": slow_gather})
    assert M.comm_seconds(t, 4, fab) == pytest.approx(2 * gather + scatter)
    # an op the table does not know costs one message and its payload once; recv costs nothing
    assert M.comm_seconds(M.Traffic({"custom": (2, 100.0), "recv": (5, 1e9)}, 2), 2, _flat()) == pytest.approx(
        2e-3 + 100e-9
    )


@pytest.mark.parametrize("algorithm", M.SWEPT)
def test_fit_recovers_known_latency_and_bandwidth(algorithm: str) -> None:
    alpha, beta = 250e-6, 1 / 1.5e9
    points = []
    for k in (2, 3, 4):
        for s in sweep_sizes(1024, 256 * MIB):
            msgs, factor = M.all_reduce_coefficients(algorithm, k)
            points.append(M.SweepPoint(algorithm, k, s, msgs * alpha + factor * s * beta))
    points.append(M.SweepPoint("other", 2, 8, 99.0))  # another algorithm's point
    fit = M.fit_alpha_beta(points, algorithm)
    assert fit.link.alpha == pytest.approx(alpha, rel=1e-9) and fit.link.beta == pytest.approx(beta, rel=1e-9)
    assert len(fit.points) == 30 and fit.median_abs_error() == pytest.approx(0.0, abs=1e-9)


def test_fit_clamps_a_negative_latency_and_reports_errors() -> None:
    # times that fall faster than linearly at small sizes would need a negative latency: clamp it to 0
    pts = [M.SweepPoint("ring", 2, b, t) for b, t in ((1000, 1e-7), (1_000_000, 1e-3), (10_000_000, 1e-2))]
    fit = M.fit_alpha_beta(pts, "ring")
    assert fit.link.alpha == 0.0 and fit.link.beta > 0
    assert all(fit.predict(p) == pytest.approx(p.bytes * fit.link.beta) for p in fit.points)
    assert fit.median_abs_error(world=3) != fit.median_abs_error(world=3)  # nan: no point of that world


def test_projection_efficiency_falls_with_ranks_and_overlap_helps() -> None:
    t = M.Traffic({"all_reduce": (2, 64.0 * MIB)}, world=2)
    rows = M.project(t, 0.1, M.H100_NDR400, M.projection_worlds(8, 4096))
    ring = [r for r in rows if r.algorithm == "ring"]
    assert [r.world for r in ring] == M.projection_worlds(8, 4096) == [2**i for i in range(3, 13)]
    assert all(a.efficiency >= b.efficiency for a, b in zip(ring, ring[1:]))
    for r in rows:
        assert r.step_s == pytest.approx(0.1 + r.comm_s)
        assert r.step_overlap_s == pytest.approx(max(0.1, r.comm_s))
        assert r.efficiency_overlap >= r.efficiency
        assert r.compute_for_90 == pytest.approx(9 * r.comm_s)
    # at 4096 ranks (512 nodes) the leader-based hierarchical all-reduce pays 2*511 inter-node latencies,
    # the flat ring 2*4095: hierarchical must be faster
    at = {r.algorithm: r for r in rows if r.world == 4096}
    assert at["hierarchical"].comm_s < at["ring"].comm_s


def test_contention_and_predict_here() -> None:
    assert M.contention(2, 2) == 1.0 and M.contention(4, 2) == 2.0 and M.contention(3, 2, threads_per_rank=2) == 3.0
    t = M.Traffic({"all_reduce": (1, 1e6)}, world=2)
    assert M.predict_here(t, 2, 0.01, ONE) == pytest.approx(0.01 + 2e-3 + 1e6 * 1e-9)
    m = M.this_machine(ONE, cores=2)
    assert m.ranks_per_node == 2 and m.intra == m.inter == ONE


def test_window_means_slowest_per_window_and_the_sync_period() -> None:
    assert window_means([1.0, 3.0, 5.0, 7.0, 9.0], 2) == [2.0, 6.0]  # the partial window [9] is dropped
    assert window_means([1.0, 3.0], 1) == [1.0, 3.0] and window_means([1.0], 2) == []
    for bad in (0, 1.5, "2"):
        with pytest.raises(ValueError, match=rf"every must be an int >= 1, got {bad!r}"):
            window_means([1.0], bad)  # type: ignore[arg-type]
    # per window of 2 steps the slowest process's mean: [max(2, 1.5), max(3, 4)]
    assert slowest_per_step([[1.0, 3.0, 2.0, 4.0], [2.0, 1.0, 5.0, 3.0]], every=2) == [2.0, 4.0]
    assert sync_every([0, 0, 0, 0, 1] * 2) == 5 and sync_every([1, 0, 1, 0, 2, 0]) == 2
    assert sync_every([2] * 10) == 1 and sync_every([0] * 10) == 1 and sync_every(None) == 1 and sync_every([]) == 1
    assert sync_every([0] * 9 + [1]) == 10


def test_slowest_per_step_takes_each_steps_slowest_process() -> None:
    # step 0: 1.0 vs 3.0 -> 3.0; step 1: 2.0 vs 1.5 -> 2.0; the third step of rank 0 has no partner
    assert slowest_per_step([[1.0, 2.0, 9.0], [3.0, 1.5]]) == [3.0, 2.0]
    assert slowest_per_step([[0.5, 0.25]]) == [0.5, 0.25]  # one process: its own times
    assert slowest_per_step([]) == []


def _row(strategy: dict[str, object], measured: bool, world: int = 2, **kw: object) -> Row:
    return Row(
        model="m",
        strategy=kw.pop("name", "s"),  # type: ignore[arg-type]
        world=world,
        param_bytes=60 * MIB,
        measured=measured,
        op_bytes_per_step=kw.pop("ops", {}),  # type: ignore[arg-type]
        op_calls_per_step=kw.pop("calls", {}),  # type: ignore[arg-type]
        n_linear=5,
        strategy_node=strategy,
        step_ms=kw.pop("step_ms", 100.0),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def test_traffic_of_measured_and_analytic_rows() -> None:
    measured = traffic_of(_row({}, True, ops={"all_reduce": 8.0}, calls={"all_reduce": 2.0}))
    assert measured.ops == {"all_reduce": (2.0, 8.0)} and measured.source == "measured"
    # torch DDP: a 1 MiB first bucket, then 25 MiB buckets: 60 MiB -> 1 + ceil(59 / 25) = 4 all-reduces
    ddp = traffic_of(_row({"_target_": "lightning.pytorch.strategies.DDPStrategy"}, False))
    assert ddp.ops == {"all_reduce": (4, 60.0 * MIB)} and ddp.source == "analytic"
    fsdp = traffic_of(_row({"_target_": "lightning_sync.bench.fsdp2.FullyShardStrategy"}, False, world=4))
    # FSDP2 calls the backend's own all-gather and reduce-scatter, priced by their own fits
    assert fsdp.ops == {"torch_all_gather": (10, 30.0 * MIB), "torch_reduce_scatter": (5, 60.0 * MIB)}
    once = traffic_of(_row({"_target_": "x.FullyShardStrategy", "reshard_after_forward": False}, False, world=4))
    assert once.ops["torch_all_gather"] == (5, 15.0 * MIB)


def test_cost_model_validation_error_by_hand() -> None:
    sweep = M.calibrate(
        [
            M.SweepPoint("backend", k, s, 2 * (k - 1) * 1e-3 + 2 * (k - 1) / k * s * 1e-9)
            for k in (2, 4)
            for s in (1000, 10**6, 10**8)
        ],
        "test",
    )
    rows = [
        _row({}, True, name="ddp", ops={"all_reduce": 1e7}, calls={"all_reduce": 1.0}, step_ms=40.0, codec_ms=1.5),
        _row({}, True, name="ddp", world=4, ops={"all_reduce": 1e7}, calls={"all_reduce": 1.0}, step_ms=50.0),
    ]
    compute = {("m", 1): 0.020, ("m", 2): 0.025}  # no K=4 measurement of compute under time-sharing
    cost = CostModel(rows, compute, sweep, cores=2)
    assert cost.link.alpha == pytest.approx(1e-3) and cost.link.beta == pytest.approx(1e-9)
    v2, v4 = cost.validation()
    comm2 = 2e-3 + 1e7 * 1e-9
    # the measured codec arithmetic (1.5 ms) is compute the plain model's T_comp does not hold: added
    assert v2.comm_s == pytest.approx(comm2) and v2.predicted_s == pytest.approx(0.025 + 0.0015 + comm2)
    assert v2.error == pytest.approx((0.0265 + comm2) / 0.040 - 1)
    assert v2.predicted_ck_s == pytest.approx(0.0215 + comm2)  # c(2) = 1 on 2 cores
    assert v4.predicted_s is None and v4.error is None
    assert v4.predicted_ck_s == pytest.approx(2 * 0.020 + 6e-3 + 1.5e7 * 1e-9)  # c(4) = 2
    proj = cost.projection()  # the K=4 row, on both fabrics, 10 world sizes, 3 algorithms
    assert len(proj) == 2 * 10 * 3 and {p.fabric for p in proj} == {
        M.H100_NDR400.name,
        "this machine (fitted backend links)",
    }
    text = "\n".join(cost.markdown())
    assert "| m | ddp | 2 | 1 | 40.0 | 25.0 | 0.0 | 1.5 | 12.0 | 38.5 | -4% | 33.5 | -16% |" in text
    assert "1 of 1 predictions lie within 25 %" in text
    # the compute row at K=2 took 25 ms where 2 ranks on 2 cores alone give c(2) T1 = 20 ms
    assert cost.sharing() == {("m", 2): pytest.approx(1.25)}
    assert "compute row over c(K) T1 (about 1.00 where" in text and "m K=2 1.25." in text


def test_a_row_measured_at_one_rank_adds_its_host_work_scaled_like_the_compute() -> None:
    sweep = M.calibrate(
        [
            M.SweepPoint("backend", k, s, 2 * (k - 1) * 1e-3 + 2 * (k - 1) / k * s * 1e-9)
            for k in (2, 4)
            for s in (1000, 10**6, 10**8)
        ],
        "test",
    )
    rows = [
        _row({}, True, name=n, world=k, ops={"all_reduce": 1e7}, calls={"all_reduce": 1.0}, step_ms=60.0)
        for n in ("fsdp", "ddp")
        for k in (2, 4)
    ]
    compute = {("m", 1): 0.020, ("m", 2): 0.025, ("m", 4): 0.050}
    # fsdp's one-rank step took 8 ms more than T1; ddp was not measured at one rank
    cost = CostModel(rows, compute, sweep, cores=2, host={("m", "fsdp"): 0.008})
    f2, f4, d2, d4 = cost.validation()
    comm2, comm4 = 2e-3 + 1e7 * 1e-9, 6e-3 + 1.5e7 * 1e-9
    # scaled by the measured time-sharing factor compute(K) / T1: 1.25 at K=2, 2.5 at K=4
    assert f2.host_s == pytest.approx(0.010) and f4.host_s == pytest.approx(0.020)
    assert f2.predicted_s == pytest.approx(0.025 + 0.010 + comm2)
    assert f4.predicted_s == pytest.approx(0.050 + 0.020 + comm4)
    assert f4.predicted_ck_s == pytest.approx(2 * (0.020 + 0.008) + comm4)  # c(4) = 2 on 2 cores
    assert d2.host_s == 0.0 and d2.predicted_s == pytest.approx(0.025 + comm2)
    assert d4.predicted_ck_s == pytest.approx(2 * 0.020 + comm4)
    # without a compute measurement at K the host work falls back to c(K), like the compute
    assert cost.host_at("m", "fsdp", 3) == pytest.approx(1.5 * 0.008)
    # the projection's T_comp of the row is its one-rank step
    proj = {(p.strategy, p.fabric, p.world, p.algorithm): p for p in cost.projection()}
    key = (M.H100_NDR400.name, 8, "ring")
    assert proj[("fsdp", *key)].efficiency == pytest.approx(0.028 / proj[("fsdp", *key)].step_s)
    assert proj[("ddp", *key)].step_s == pytest.approx(proj[("fsdp", *key)].step_s - 0.008)
    assert "| m | fsdp | 4 | 1 | 60.0 | 50.0 | 20.0 |" in "\n".join(cost.markdown())


def test_a_row_that_syncs_once_in_h_steps_is_predicted_with_the_compute_of_h_step_windows() -> None:
    sweep = M.calibrate([M.SweepPoint("backend", 2, s, 2e-3 + s * 1e-9) for s in (1000, 10**6, 10**8)], "test")
    rows = [
        _row({}, True, name="local", ops={"all_reduce": 2e6}, calls={"all_reduce": 0.2}, step_ms=30.0, sync_every=5),
        _row({}, True, name="ddp", ops={"all_reduce": 1e7}, calls={"all_reduce": 1.0}, step_ms=40.0),
    ]
    compute = {("m", 1): 0.020, ("m", 2): 0.025}
    cost = CostModel(rows, compute, sweep, cores=2, compute_every={("m", 2, 5): 0.022})
    local, ddp = cost.validation()
    # the amortized traffic (one all-reduce of 10 MB in 5 steps) is priced as measured per step
    assert local.sync_every == 5 and local.compute_s == pytest.approx(0.022)
    assert local.comm_s == pytest.approx(0.2 * 2e-3 + 2e6 * 1e-9)
    assert ddp.sync_every == 1 and ddp.compute_s == pytest.approx(0.025)
    # a period without its own compute measurement has no prediction (rather than a wrong one)
    orphan = CostModel(rows[:1], compute, sweep, cores=2).validation()[0]
    assert orphan.compute_s is None and orphan.error is None


def test_validation_prices_each_k_with_the_links_fitted_at_that_k() -> None:
    # the sweep's latency doubles from K=2 to K=4 (time-sharing): the pooled fit lies between, the
    # validation uses each K's own exact fit; a K the sweep did not run at falls back to the pooled fit
    sweep = M.calibrate(
        [
            M.SweepPoint("backend", k, s, 2 * (k - 1) * (1e-3 if k == 2 else 2e-3) + 2 * (k - 1) / k * s * 1e-9)
            for k in (2, 4)
            for s in (1000, 10**6, 10**8)
        ],
        "test",
    )
    rows = [
        _row({}, True, name="ddp", world=k, ops={"all_reduce": 1e7}, calls={"all_reduce": 1.0}, step_ms=50.0)
        for k in (2, 3, 4)
    ]
    compute = {("m", 1): 0.020, ("m", 2): 0.025, ("m", 3): 0.03, ("m", 4): 0.035}
    cost = CostModel(rows, compute, sweep, cores=2)
    assert cost.fits_at[2]["backend"].link.alpha == pytest.approx(1e-3)
    assert cost.fits_at[4]["backend"].link.alpha == pytest.approx(2e-3)
    assert 1e-3 < cost.link.alpha < 2e-3  # the pooled fit, which the projection uses
    v2, v3, v4 = cost.validation()
    assert (v2.links, v3.links, v4.links) == ("K=2", "pooled", "K=4")
    assert v2.comm_s == pytest.approx(2 * 1e-3 + 1e7 * 1e-9)
    assert v4.comm_s == pytest.approx(6 * 2e-3 + 1.5e7 * 1e-9)
    pooled = cost.link
    assert v3.comm_s == pytest.approx(4 * pooled.alpha + 4 / 3 * 1e7 * pooled.beta)
    text = "\n".join(cost.markdown())
    assert "| backend | 1000 / 1.00 (0%) | 2000 / 1.00 (0%) |" in text


def test_a_sweep_point_is_priced_at_its_mean_span_and_keeps_the_median() -> None:
    # a step pays the sum of its calls, so one slow repeat of three (a call that waited a scheduler slice)
    # moves the price by a third of its delay; the median, kept beside it, does not see it
    point = price([0.001, 0.002, 0.300], [0.002, 0.003, 0.301])
    assert point == {
        "seconds": pytest.approx(0.101),
        "median_seconds": 0.002,
        "rank_seconds": 0.003,
        "min_seconds": 0.001,  # the spread the fit figure draws around the median
        "max_seconds": 0.300,
    }


def test_calibration_writes_the_parameters_and_a_report_reads_the_same_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`lightning-sync bench mode=calibrate` (run_calibration, with the sweep replaced by known points) stores the
    fitted links in cost_model.params_file; a report run afterwards prices with exactly those numbers, and
    without the file it uses the documented defaults."""
    from lightning_sync.bench import app
    from lightning_sync.bench.report import Report
    from lightning_sync.bench.rows import Measurement

    def sweep(cost: object, threads: int, timeout: float) -> list[M.SweepPoint]:
        out = []
        for a in M.SWEPT:
            for k in (2, 3):
                msgs, factor = M.all_reduce_coefficients(a, k)
                out += [
                    M.SweepPoint(a, k, s, msgs * 3e-4 * k + factor * s * 1e-9, 0.9, 1.0, 0.8, 1.2)
                    for s in (10**3, 10**6, 10**8)
                ]
        return out

    monkeypatch.setattr(app, "run_sweep", sweep)
    params_file = tmp_path / "stored" / "cost_params.json"
    cfg = OmegaConf.create(
        {
            "baseline": "ddp",
            "pairs": 1,
            "steps": 3,
            "warmup_steps": 1,
            "threads_per_rank": 1,
            "timeout_s": 10,
            "cost_model": {"enabled": True, "params_file": str(params_file)},
        }
    )
    meta = {"date": "d", "cpu": "c", "cores": 2, "python": "3", "torch": "t", "lightning": "l", "threads_per_rank": 1}
    written = app.run_calibration(cfg, tmp_path / "out", {**meta, "command": "lightning-sync bench mode=calibrate"})
    assert (tmp_path / "out" / "fit.png").stat().st_size > 0 and "## Cost model" in (
        tmp_path / "out" / "calibration.md"
    ).read_text()
    raw = json.loads(params_file.read_text())
    assert raw["format"] == 1 and set(raw["links"]) == set(M.SWEPT) and set(raw["links_at"]) == {"2", "3"}
    assert raw["links_at"]["2"]["backend"]["alpha_s"] == pytest.approx(6e-4)  # the latency of K=2 alone
    loaded = M.load_params(params_file)
    assert loaded.links == {a: replace(link, source=loaded.source) for a, link in written.links.items()}
    assert loaded.links_at[3]["tree"].beta == written.links_at[3]["tree"].beta and loaded.points == written.points
    # a report built afterwards reads the file: the same links in its JSON and in its validation's T_comm
    ranks = [
        [
            Measurement(
                "ddp",
                "m",
                2,
                [0.05] * 3,
                8e6,
                {"all_reduce": 8e6},
                {"all_reduce": 1.0},
                comm_calls=3,
                param_bytes=8_000_000,
            )
        ]
        for _ in range(2)
    ]
    single = [Measurement("single", "m", 1, [0.02] * 3)]
    report = Report({2: ranks}, single, cfg, {**meta, "command": "x"}, M.load_params(cfg.cost_model.params_file))
    fits = report.as_json()["fits"]
    assert {a: (f["alpha_s"], f["beta_s_per_byte"]) for a, f in fits.items()} == {
        a: (link.alpha, link.beta) for a, link in written.links.items()
    }
    (v,) = report.cost_model.validation()
    backend = written.links_at[2]["backend"]
    assert v.links == "K=2" and v.comm_s == pytest.approx(2 * backend.alpha + 8e6 * backend.beta)
    assert M.load_params(tmp_path / "missing.json") is M.DEFAULT_PARAMS
    assert M.DEFAULT_PARAMS.links["backend"].alpha == 571e-6 and set(M.DEFAULT_PARAMS.links) == set(M.SWEPT)
