"""The bench's figures, drawn from small synthetic runs (no training): each fits a README (at most 1600 px wide,
at most six panels), shows the spread of what the bench repeats, and gives a strategy one colour everywhere."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_rgb
from matplotlib.container import ErrorbarContainer
from omegaconf import OmegaConf

from lightning_sync.bench import cost_report, plots, style, tradeoff
from lightning_sync.bench import model as M
from lightning_sync.bench.app import COMPUTE_ROW
from lightning_sync.bench.plots import write_plots
from lightning_sync.bench.report import Report
from lightning_sync.bench.rows import Measurement, pyplot
from lightning_sync.bench.runner import IN_STEP, SINGLE_ROW
from lightning_sync.bench.tradeoff import TradeoffResult, plot_bytes_loss, plot_tradeoff

TARGET = {
    "lightning_ddp": {"_target_": "lightning.pytorch.strategies.DDPStrategy"},
    "bucketed_ddp": {"_target_": "lightning_sync.strategies.bucketed_ddp.BucketedDDPStrategy"},
    "fsdp2": {"_target_": "lightning_sync.bench.fsdp2.FullyShardStrategy", "shard_classes": ["torch.nn.Linear"]},
    "zero3": {"_target_": "lightning_sync.strategies.sharded.ShardedStrategy", "stage": 3},
    "local_sgd": {"_target_": "lightning_sync.strategies.local_sgd.LocalSGDStrategy", "sync_every": 1},
}
#: Traffic per step and rank of each row (bytes per op; the torch rows bypass comms and record none).
S = 2**20
OPS = {
    "bucketed_ddp": {"all_reduce": S},
    "zero3": {"all_gather": S, "reduce_scatter": S},
    "local_sgd": {"all_reduce": S},
}
#: Each round's step time of zero3 at K=2 on model "m" (ms): the median 120 with whiskers from 100 to 140.
ZERO3_ROUNDS = (140.0, 100.0, 120.0)
META = {"date": "d", "cpu": "c", "cores": 2, "python": "3", "torch": "t", "lightning": "l", "threads_per_rank": 1}
CFG = {
    "baseline": "lightning_ddp",
    "pairs": 3,
    "steps": 3,
    "warmup_steps": 1,
    "sharding_table": {"rows": ["lightning_ddp", "bucketed_ddp", "fsdp2", "zero3"], "reference": "fsdp2"},
    "bucket_sweep": {"strategy": "bucketed_ddp", "model": "m"},
}


def _trial(name: str, model: str, world: int, ms: float, rnd: int, **kw: Any) -> Measurement:
    ops = OPS.get(name, {})
    return Measurement(
        name=name,
        model=model,
        world=world,
        step_s=[ms / 1e3] * 3,
        bytes_per_step=float(sum(ops.values())),
        op_bytes_per_step=dict(ops),
        op_calls_per_step=dict.fromkeys(ops, 1.0),
        comm_calls=3 if ops else 0,
        step_calls=[1 if ops else 0] * 3,
        exposed_s=[0.002 * (1 + rnd)] * 3 if name == "bucketed_ddp" else [],
        param_bytes=S,
        strategy=TARGET.get(name, TARGET["bucketed_ddp"]),
        peak_mib=50.0 + 5 * rnd + (name == "zero3") * 10,
        trial=rnd,
        **kw,
    )


def _run(rounds: int) -> tuple[dict[int, list[list[Measurement]]], list[Measurement]]:
    """Two models at K = 2 and 3, every strategy once per round; the bucket sweep at K = 2; the cost model's
    compute rows; one-rank T1 rows. A row's step time grows 10 ms per round (zero3's at K=2 on m: ZERO3_ROUNDS)."""
    results = {}
    for world in (2, 3):
        trials = []
        for rnd in range(rounds):
            for model in ("m", "n"):
                for i, name in enumerate(TARGET):
                    ms = 60.0 + 20 * i + 10 * world + 10 * rnd
                    if (name, model, world) == ("zero3", "m", 2):
                        ms = ZERO3_ROUNDS[rnd % 3]
                    trials.append(_trial(name, model, world, ms, rnd))
                compute = _trial(COMPUTE_ROW, model, world, 40.0 + 10 * world, rnd, extra={IN_STEP: True})
                trials.append(compute)
            if world == 2:
                for cap in (1.0, 25.0, 10000.0):
                    extra = {"cap_mb": cap}
                    label = "one bucket" if cap > 1000 else f"cap={cap:g}"  # the bench's names of the sweep rows
                    trials.append(_trial(label, "m (bucket sweep)", 2, 70 + cap / 1e3 + rnd, rnd, extra=extra))
                trials.append(_trial("lightning_ddp", "m (bucket sweep)", 2, 75.0 + rnd, rnd))
        results[world] = [list(trials) for _ in range(world)]
    single = [Measurement(SINGLE_ROW, model, 1, [0.03 + 0.001 * rnd]) for rnd in range(rounds) for model in "mn"]
    return results, single


#: The repeats of a synthetic sweep point span FIT_SPREAD x its time: the fastest 0.7 x, the slowest 1.5 x.
FIT_SPREAD = (0.7, 1.5)


def _params(spread: bool = True) -> M.CostParams:
    """Links fitted to exact synthetic points of every swept op at K = 2 and 3; with ``spread``, each point keeps
    its median (its time) and the fastest and slowest repeat (:data:`FIT_SPREAD`), as a sweep stores them."""
    points = []
    for a in M.SWEPT:
        for k in (2, 3):
            msgs, factor = M.all_reduce_coefficients(a, k)
            for s in (10**3, 10**6, 10**8):
                t = msgs * 3e-4 + factor * s * 1e-9
                kept = (t, math.nan, *(f * t for f in FIT_SPREAD)) if spread else ()
                points.append(M.SweepPoint(a, k, s, t, *kept))
    return M.calibrate(points, "synthetic")


def _tradeoff(rounds: int) -> list[TradeoffResult]:
    out = []
    for rnd in range(rounds):
        for model, names in (
            ("char_gpt", ("bucketed_ddp", "local_sgd", "diloco")),
            ("bow", ("bucketed_ddp", "hogwild")),
            ("gpt2", ("bucketed_ddp", "async_ps")),  # three models: the widest layouts
        ):
            for i, name in enumerate(names):
                mib = 0.0 if name == "hogwild" else 400.0 / (1 + 7 * i)
                for slow in (None, 2.0):
                    loss, wall = 1.5 + 0.01 * i + 0.01 * rnd, 20.0 + 5 * rnd + (slow or 0) * 5
                    out.append(TradeoffResult(name, model, slow, rnd, loss, mib * S, wall, 1000, 1000 / wall, [8, 8]))
    return out


def _draw(out: Path, rounds: int) -> dict[str, list[Any]]:
    out.mkdir(parents=True, exist_ok=True)
    results, single = _run(rounds)
    params = _params(spread=rounds > 1)
    report = Report(results, single, OmegaConf.create({**CFG, "pairs": rounds}), META, params)
    figs = write_plots(report, out)
    figs["tradeoff.png"] = plot_tradeoff(_tradeoff(rounds), out / "tradeoff.png")
    figs["bytes_loss.png"] = plot_bytes_loss(_tradeoff(rounds), out / "bytes_loss.png")
    return figs


@pytest.fixture(scope="module")
def drawn(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[Any]]]:
    out = tmp_path_factory.mktemp("plots")
    return out, _draw(out, 3)


def _whiskers(fig: Any, axes: list[Any] | None = None) -> list[tuple[float, float, float, float]]:
    """Every error-bar segment of nonzero length (in ``axes``, default all): ``(x0, y0, x1, y1)``."""
    out = []
    for ax in fig.axes if axes is None else axes:
        for c in (c for c in ax.containers if isinstance(c, ErrorbarContainer)):
            for lines in c.lines[2]:
                for (x0, y0), (x1, y1) in lines.get_segments():
                    if (x0, y0) != (x1, y1):
                        out.append((x0, y0, x1, y1))
    return out


def _bands(fig: Any) -> list[Any]:
    """The shaded min-to-max bands of a strategy (``fill_between``, tagged with its name)."""
    return [a for ax in fig.axes for a in ax.collections if isinstance(a, PolyCollection) and a.get_gid()]


def _rgb(c: Any) -> tuple[float, ...]:
    return tuple(round(v, 4) for v in to_rgb(c))


def _colours(fig: Any, name: str) -> set[tuple[float, ...]]:
    """The RGB of every artist the figure drew for strategy ``name``."""
    out = set()
    for a in fig.findobj(lambda a: a.get_gid() == name):
        if hasattr(a, "get_color") and not isinstance(a, PolyCollection):
            c = a.get_color()
        else:
            c = a.get_facecolor()
        c = c if isinstance(c, str) or isinstance(c[0], float) else c[0]  # a collection's: one per item
        out.add(_rgb(c))
    return out


EXPECTED = {
    "step_time.png",
    "memory.png",
    "scaling.png",
    "sharding.png",
    "bucket_sweep.png",
    "predicted_vs_measured.png",
    "projection.png",
    "fit.png",
    "tradeoff.png",
    "bytes_loss.png",
}


def test_every_figure_fits_a_readme(drawn: tuple[Path, dict[str, list[Any]]]) -> None:
    out, figs = drawn
    assert {name for name, f in figs.items() if f} == EXPECTED
    for name in EXPECTED:
        (fig,) = figs[name]
        width = matplotlib.image.imread(out / name).shape[1]
        assert 600 <= width <= style.MAX_WIDTH_PX, (name, width)
        assert 1 <= len(fig.axes) <= style.MAX_PANELS, (name, len(fig.axes))


def test_repeated_figures_show_their_spread_and_single_ones_say_they_have_none(
    drawn: tuple[Path, dict[str, list[Any]]],
) -> None:
    _, figs = drawn
    repeated = {n for n in EXPECTED if n not in ("projection.png", "bucket_sweep.png")}
    for name in repeated:
        assert _whiskers(figs[name][0]), f"{name} draws no whiskers over its 3 rounds"
    assert _bands(figs["bucket_sweep.png"][0]), "the bucket sweep draws no band over its 3 rounds"
    # zero3 on m at K=2: its bar stands at the median round, its whisker spans the fastest to the slowest round
    (fig,) = figs["step_time.png"]
    ax = next(ax for ax in fig.axes if ax.get_title().startswith("m:"))
    bar = next(p for p in ax.patches if p.get_gid() == "zero3")  # K=2 is drawn first
    x = bar.get_x() + bar.get_width() / 2
    assert bar.get_height() == pytest.approx(120.0)
    assert [(y0, y1) for x0, y0, _, y1 in _whiskers(fig, [ax]) if x0 == pytest.approx(x)] == [(100.0, 140.0)]
    # a sweep point stands at its median with whiskers from its fastest to its slowest repeat
    (fig,) = figs["fit.png"]
    spans = {round(y0 / y1, 6) for _, y0, _, y1 in _whiskers(fig)}
    assert spans == {round(FIT_SPREAD[0] / FIT_SPREAD[1], 6)}, spans
    assert all("median, whiskers min-max" in ax.get_ylabel() for ax in fig.axes)
    # what is not repeated says so instead of drawing a spread
    (fig,) = figs["projection.png"]
    assert not _whiskers(fig) and not _bands(fig)
    assert any("no spread" in ax.get_ylabel() for ax in fig.axes)
    assert all("accounted" in ax.get_ylabel() for ax in figs["sharding.png"][0].axes[3:])  # wire bytes


def test_sweep_points_stored_without_their_spread_draw_none_and_say_so(tmp_path: Path) -> None:
    # calibration files written before the spread was kept load with NaN there: the figure falls back to the
    # mean span and its axis says the spread is missing, rather than drawing whiskers of zero length
    fig = cost_report.plot_fit(_params(spread=False), tmp_path / "fit.png")
    assert not _whiskers(fig)
    assert all("spread was not stored" in ax.get_ylabel() for ax in fig.axes)
    lines = [ln for ax in fig.axes for ln in ax.lines if ln.get_linestyle() == "None"]  # the measured markers
    assert lines and all(len(ln.get_xdata()) == 1 for ln in lines)


def test_one_round_draws_no_whiskers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def keep(fig: Any, path: Path, rect: Any = None) -> Any:  # the artists are what is checked: no layout, no file
        pyplot().close(fig)
        return fig

    for module in (plots, tradeoff, cost_report):
        monkeypatch.setattr(module, "save_fig", keep)
    figs = _draw(tmp_path, 1)
    for name, (fig,) in figs.items():
        assert not _whiskers(fig) and not _bands(fig), name
    assert "1 round: no spread" in figs["step_time.png"][0].axes[0].get_ylabel()


def test_a_strategy_has_one_colour_in_every_figure(drawn: tuple[Path, dict[str, list[Any]]]) -> None:
    _, figs = drawn
    for name, files in (
        ("zero3", ("step_time.png", "memory.png", "scaling.png", "sharding.png", "predicted_vs_measured.png")),
        ("local_sgd", ("step_time.png", "scaling.png", "projection.png", "tradeoff.png", "bytes_loss.png")),
        ("bucketed_ddp", ("memory.png", "bucket_sweep.png", "predicted_vs_measured.png", "tradeoff.png")),
    ):
        seen = {f: _colours(figs[f][0], name) for f in files}
        assert all(seen.values()), f"{name} is missing from {[f for f, c in seen.items() if not c]}"
        assert set().union(*seen.values()) == {_rgb(style.colour(name))}, (name, seen)
    assert len(set(style.PALETTE.values())) == len(style.PALETTE)  # no two strategies alike
    spare = style.colour("a_row_the_palette_lacks")
    assert spare == style.colour("a_row_the_palette_lacks") and spare not in style.PALETTE.values()


def test_more_models_than_panels_continue_on_a_second_page(tmp_path: Path) -> None:
    results = {2: [[_trial("bucketed_ddp", f"model{i}", 2, 50.0, 0) for i in range(8)]] * 2}
    report = Report(results, [], OmegaConf.create({**CFG, "pairs": 1}), META)
    figs = write_plots(report, tmp_path)
    assert [len(f.axes) for f in figs["step_time.png"]] == [6, 2]
    assert (tmp_path / "step_time_2.png").exists() and (tmp_path / "memory_2.png").exists()
    for png in tmp_path.glob("*.png"):  # three panels across, the widest of the report's layouts
        assert matplotlib.image.imread(png).shape[1] <= style.MAX_WIDTH_PX, png.name
    with pytest.raises(ValueError, match="a bench figure has 1 to 6 panels, got 7 x 1"):
        style.figure(7, 1, 1, 1)
    assert math.isclose(style.MAX_WIDTH_PX, 1600)


def test_replot_redraws_a_finished_run_from_its_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m lightning_sync.bench.replot``: raw.json with the recorded command's config (a Hydra setting left
    out), the trade-off's results, and an older report.json's parameters where raw.json has none."""
    import json
    from dataclasses import asdict

    from lightning_sync.bench import replot
    from lightning_sync.bench.report import save_raw

    drawn: list[str] = []

    def keep(fig: Any, path: Path, rect: Any = None) -> Any:
        pyplot().close(fig)
        drawn.append(path.name)
        return fig

    for module in (plots, tradeoff, cost_report):
        monkeypatch.setattr(module, "save_fig", keep)
    results, single = _run(2)
    meta = {**META, "command": "lightning-sync bench suite=quick pairs=2 hydra.run.dir=/elsewhere"}
    save_raw(tmp_path / "raw.json", results, single, None, meta)
    (tmp_path / "tradeoff.json").write_text(json.dumps([asdict(r) for r in _tradeoff(2)]))
    params = _params()  # the older report.json: pooled links with their points under "fits", no "params"
    fits = {
        a: {"alpha_s": f.link.alpha, "beta_s_per_byte": f.link.beta, "points": [asdict(p) for p in f.points]}
        for a, f in params.fits().items()
    }
    (tmp_path / "report.json").write_text(json.dumps({"meta": meta, "fits": fits}))
    assert replot.run_config(meta["command"]).pairs == 2
    recorded = replot.recorded_params({}, json.loads((tmp_path / "report.json").read_text()))
    assert recorded.links["ring"].alpha == params.links["ring"].alpha and len(recorded.points) == len(params.points)
    paths = replot.replot(tmp_path, tmp_path / "out")
    assert {p.name for p in paths} == EXPECTED
    assert sorted(drawn) == sorted(p.name for p in paths)
