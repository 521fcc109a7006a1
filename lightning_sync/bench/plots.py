"""The figures of a bench report (:class:`~lightning_sync.bench.report.Report`), one function per file. A figure
measured once per round is drawn as its median with whiskers (or a band) over the rounds; bytes are accounted,
the same every round, and the cost model's figures are computed from medians: their labels say so.

The figures read a report through :class:`PlottedReport`, what they need of one, so that this module imports no
report: the report draws its figures with :func:`write_plots`, and the two modules import in one direction only.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from lightning_sync.bench import style
from lightning_sync.bench.cost_report import CostModel, Validation, plot_fit
from lightning_sync.bench.model import CostParams, Projection
from lightning_sync.bench.rows import Measurement, Row, median, pyplot
from lightning_sync.bench.style import WHISKER, label, legend_below, look, paged, repeats_note, save_fig, whisker

__all__ = ["bucket_sweep", "memory", "predicted_vs_measured", "projection", "scaling", "sharding", "step_time"]
__all__ += ["PlottedReport", "write_plots"]

#: Panels across a figure, and each panel's size in inches (three across: 14.4 in, 1584 px at the style's DPI).
COLUMNS, WIDTH, HEIGHT = 3, 4.8, 3.5
Figures = list[Any]
Of = Callable[[Row], Any]  # a row's figure: its value, its rounds' values or its label
_PT = {"textcoords": "offset points"}  # an annotation's offset from its point, in points


class PlottedReport(Protocol):
    """What the figures read of a bench report (:class:`~lightning_sync.bench.report.Report` is one)."""

    cfg: Any
    """The bench config (``bucket_sweep`` and the like)."""
    baseline: str
    """The strategy the step-time labels are ratios to."""
    reference: str
    """The strategy the sharding figure's labels are ratios to."""
    params: CostParams | None
    """The cost model's calibrated constants (None: no cost model)."""
    cost_model: CostModel | None
    """The cost model built on them."""
    compute: dict[tuple[str, int], float]
    """Compute step time (seconds) per (model, world size)."""

    def rows(self) -> list[Row]: ...

    def sharding_rows(self) -> list[Row]: ...

    def trials(self, row: Row) -> list[Measurement]: ...

    def step_seconds(self, t: Measurement) -> float: ...


def write_plots(
    report: PlottedReport,
    out_dir: Path,
    validation: list[Validation] | None = None,
    projected: list[Projection] | None = None,
) -> dict[str, Figures]:
    """Every figure of ``report`` into ``out_dir``; per file name, the figures drawn (one a page). ``validation``
    and ``projected``: the cost model's results as a finished run recorded them (default: computed afresh)."""
    if (cost := report.cost_model) is not None:
        validation = cost.validation() if validation is None else validation
        projected = cost.projection() if projected is None else projected
    draw = (step_time, memory, scaling, sharding, bucket_sweep)
    figs = {f"{f.__name__}.png": f(report, out_dir / f"{f.__name__}.png") for f in draw}
    if validation:
        measured = {(r.model, r.strategy, r.world): step_ms(report, r) for r in report.rows()}
        name = "predicted_vs_measured.png"
        figs[name] = predicted_vs_measured(validation, measured, out_dir / name)
    if projected:
        figs["projection.png"] = projection(projected, out_dir / "projection.png")
    if report.params is not None:
        figs["fit.png"] = [plot_fit(report.params, out_dir / "fit.png")]
    return figs


def step_ms(report: PlottedReport, row: Row) -> list[float]:
    """The row's step time in each round (ms), as its median is taken."""
    return [1e3 * report.step_seconds(t) for t in report.trials(row)]


def strategy_rows(report: PlottedReport) -> list[Row]:
    """The rows of the strategies (the bucket sweep's model apart: it has its own figure)."""
    sweep = {r.model for r in report.rows() if "cap_mb" in r.extra}
    return [r for r in report.rows() if r.model not in sweep]


def _bars(ax: Any, rows: list[Row], value: Of, rounds: Of, note: Of | None = None) -> dict[tuple[str, int], float]:
    """One bar per strategy in its colour, grouped by K (one hatch per K), whiskers over ``rounds`` where a row
    has two or more, ``note`` above each bar; returns each bar's x."""
    names = list(dict.fromkeys(r.strategy for r in rows))
    worlds = sorted({r.world for r in rows})
    width, at, xs = 0.8 / len(worlds), {(r.strategy, r.world): r for r in rows}, {}
    for j, (k, hatch) in enumerate(zip(worlds, itertools.cycle(style.HATCHES))):
        for i, name in enumerate(names):
            if (r := at.get((name, k))) is None:
                continue
            x = xs[(name, k)] = i + (j - (len(worlds) - 1) / 2) * width
            if math.isnan(y := value(r)):
                continue
            ax.bar(x, y, width, hatch=hatch, edgecolor="white", linewidth=0, **look(name))
            top = y
            if (err := whisker(y, rounds(r))) is not None:
                ax.errorbar([x], [y], yerr=err, fmt="none", ecolor="black", **WHISKER)
                top += err[1][0]
            if note is not None:
                ax.annotate(note(r), (x, top), ha="center", va="bottom", fontsize=6, xytext=(0, 1), **_PT)
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right")
    return xs


def _times(ratio: float) -> str:
    return "" if math.isnan(ratio) else f"{ratio:.2f}x"


def _hatch_key(rows: list[Row]) -> list[Any]:
    """Legend handles naming the hatch of each K in :func:`_bars` (none for a single K)."""
    worlds, patch = sorted({r.world for r in rows}), pyplot().Rectangle
    keys = [
        patch((0, 0), 1, 1, facecolor="0.6", edgecolor="white", hatch=h, label=f"K={k}")
        for k, h in zip(worlds, itertools.cycle(style.HATCHES))
    ]
    return keys if len(worlds) > 1 else []


def _per_model(
    rows: list[Row], path: Path, ylabel: str, title: str, value: Of, rounds: Of, note: Of | None = None
) -> Figures:
    """One panel of :func:`_bars` per model, six to a page."""
    out, key = [], _hatch_key(rows)
    for file, models in paged(path, dict.fromkeys(r.model for r in rows), style.MAX_PANELS):
        fig, axes = style.grid(len(models), WIDTH, HEIGHT, COLUMNS)
        for ax, model in zip(axes, models):
            _bars(ax, [r for r in rows if r.model == model], value, rounds, note)
            label(ax, "", ylabel, f"{model}: {title}", legend=None)
        out.append(save_fig(fig, file, rect=legend_below(fig, key) if key else None))
    return out


def step_time(report: PlottedReport, path: Path) -> Figures:
    """``step_time.png``; with one K each bar is labelled with its same-pair ratio to the baseline."""
    rows = strategy_rows(report)
    one_k = len({r.world for r in rows}) == 1
    note = (lambda r: _times(r.ratio)) if one_k else None
    title = f"step time (labels: x {report.baseline})" if one_k else "step time"
    ylabel = f"ms / step\n({repeats_note(r.pairs for r in rows)})"
    return _per_model(rows, path, ylabel, title, lambda r: r.step_ms, lambda r: step_ms(report, r), note)


def memory(report: PlottedReport, path: Path) -> Figures:
    """``memory.png``: peak memory above the level before the model was built, of the largest rank."""
    rows = strategy_rows(report)
    ylabel = f"peak MiB, the largest rank\n({repeats_note(r.pairs for r in rows)})"
    title = "memory per rank"
    return _per_model(rows, path, ylabel, title, lambda r: r.peak_mib, lambda r: [t.peak_mib for t in report.trials(r)])


def _line(ax: Any, xs: list[float], ys: list[float], rounds: list[list[float]], name: str, fmt: str = "o-") -> None:
    """Strategy ``name``'s medians ``ys`` at ``xs``, with whiskers where a point has two or more rounds."""
    errs = [whisker(y, r) or [[0.0], [0.0]] for y, r in zip(ys, rounds)]
    if any(whisker(y, r) for y, r in zip(ys, rounds)):
        yerr = [[e[0][0] for e in errs], [e[1][0] for e in errs]]
        ax.errorbar(xs, ys, yerr=yerr, fmt=fmt, ms=3, lw=1, label=name, **WHISKER, **look(name))
    else:
        ax.plot(xs, ys, fmt, ms=3, lw=1, label=name, **look(name))


def scaling(report: PlottedReport, path: Path) -> Figures:
    """``scaling.png``: T1 / TK against K, a panel per model with a T1 (two or more K), whiskers over rounds' TK."""
    rows = strategy_rows(report)
    worlds = sorted({r.world for r in rows})
    models = [m for m in dict.fromkeys(r.model for r in rows) if (m, 1) in report.compute]
    if len(worlds) < 2 or not models:
        return []
    out, names = [], list(dict.fromkeys(r.strategy for r in rows))
    for file, chunk in paged(path, models, style.MAX_PANELS):
        fig, axes = style.grid(len(chunk), WIDTH, HEIGHT, COLUMNS)
        for ax, model in zip(axes, chunk):
            t1, mine = report.compute[(model, 1)], [r for r in rows if r.model == model]
            for name in dict.fromkeys(r.strategy for r in mine):
                rs = sorted((r for r in mine if r.strategy == name), key=lambda r: r.world)
                rounds = [[], *([1e3 * t1 / ms for ms in step_ms(report, r)] for r in rs)]
                _line(ax, [1, *(r.world for r in rs)], [1.0, *(r.scaling for r in rs)], rounds, name)
            ax.set_xticks([1, *worlds])
            ax.set_ylim(0, 1.05)
            ylabel = f"T1 / TK ({repeats_note(r.pairs for r in mine)})"
            label(ax, "ranks K (fixed per-rank batch)", ylabel, f"{model}: scaling efficiency", legend=None)
        out.append(save_fig(fig, file, rect=legend_below(fig, names=names)))
    return out


def sharding(report: PlottedReport, path: Path) -> Figures:
    """``sharding.png``: per model, the sharding rows' step time (top) and wire MiB per step and rank through
    ``comms`` with the analytic figure marked (bottom); three models to a page."""
    rows = report.sharding_rows()
    out, key = [], _hatch_key(rows)
    for file, models in paged(path, dict.fromkeys(r.model for r in rows), style.MAX_PANELS // 2):
        fig, axes = style.figure(2, len(models), WIDTH, HEIGHT)
        for col, model in enumerate(models):
            mine = [r for r in rows if r.model == model]
            one_k = len({r.world for r in mine}) == 1
            note = (lambda r: _times(r.ratio_ref)) if one_k else None
            _bars(axes[0][col], mine, lambda r: r.step_ms, lambda r: step_ms(report, r), note)
            title = f"{model}: step time" + (f" (labels: x {report.reference})" if one_k else "")
            label(axes[0][col], "", f"ms / step\n({repeats_note(r.pairs for r in mine)})", title, legend=None)
            bottom = axes[1][col]
            xs = _bars(bottom, mine, lambda r: r.wire_measured_mib if r.measured else math.nan, lambda r: [])
            for r in mine:
                x = xs[(r.strategy, r.world)]
                bottom.plot([x], [r.wire_analytic_mib], marker="_", color="black", ms=9, mew=1.5, ls="")
                if not r.measured:
                    bottom.annotate("n/a", (x, 0), ha="center", va="bottom", fontsize=6, xytext=(0, 1), **_PT)
            ylabel = "wire MiB / step / rank\n(accounted: same every round)"
            label(bottom, "", ylabel, f"{model}: wire bytes, measured (bar) vs analytic (-)", legend=None)
        out.append(save_fig(fig, file, rect=legend_below(fig, key) if key else None))
    return out


def bucket_sweep(report: PlottedReport, path: Path) -> Figures:
    """``bucket_sweep.png``: step time and exposed communication against the bucket cap (bands: min to max
    over the rounds), the baseline's step time as a line."""
    sweep = sorted((r for r in report.rows() if "cap_mb" in r.extra), key=lambda r: r.extra["cap_mb"])
    if not sweep:
        return []
    cfg, model = report.cfg.get("bucket_sweep") or {}, sweep[0].model
    name, shown = str(cfg.get("strategy", "bucketed_ddp")), str(cfg.get("model", model))
    caps = [r.extra["cap_mb"] for r in sweep]
    fig, ((ax,),) = style.figure(1, 1, 6, 4)
    exposed = [[1e3 * median(t.exposed_s) for t in report.trials(r) if t.exposed_s] for r in sweep]
    for what, ys, rounds, fmt in (
        ("step time", [r.step_ms for r in sweep], [step_ms(report, r) for r in sweep], "o-"),
        ("exposed communication", [r.exposed_ms for r in sweep], exposed, "s--"),
    ):
        ax.plot(caps, ys, fmt, ms=4, label=f"{name}: {what}", **look(name))
        if any(whisker(y, r) for y, r in zip(ys, rounds)):
            lo = [min(r, default=y) for y, r in zip(ys, rounds)]
            hi = [max(r, default=y) for y, r in zip(ys, rounds)]
            ax.fill_between(caps, lo, hi, alpha=0.2, linewidth=0, **look(name))
    base = next((r for r in report.rows() if (r.model, r.strategy) == (model, report.baseline)), None)
    if base is not None:
        ax.axhline(base.step_ms, ls=":", lw=1, label=f"{base.strategy}: step time", **look(base.strategy))
        if whisker(base.step_ms, rounds := step_ms(report, base)):
            ax.axhspan(min(rounds), max(rounds), alpha=0.12, linewidth=0, **look(base.strategy))
    ax.set_xscale("log")
    note = repeats_note(r.pairs for r in sweep)
    label(ax, "bucket_cap_mb (largest = one bucket)", f"ms ({note}: bands)", f"bucket size sweep ({shown})")
    return [save_fig(fig, path)]


def predicted_vs_measured(
    validation: Sequence[Validation], measured: Mapping[tuple[str, str, int], list[float]], path: Path
) -> Figures:
    """``predicted_vs_measured.png``: per model, each row's measured step time (its rounds in ``measured``, ms)
    against the cost model's prediction, a marker per K, the band the report's 25 % bound."""
    rows = [v for v in validation if v.predicted_s is not None]
    mark = dict(zip(sorted({v.world for v in rows}), itertools.cycle(style.MARKERS)))  # per K
    out = []
    for file, chunk in paged(path, dict.fromkeys(v.model for v in rows), style.MAX_PANELS):
        fig, axes = style.grid(len(chunk), WIDTH, 4.4, COLUMNS)
        for ax, model in zip(axes, chunk):
            mine = [v for v in rows if v.model == model]
            for v in mine:
                x, y = 1e3 * v.predicted_s, 1e3 * v.measured_s
                err = whisker(y, measured.get((model, v.strategy, v.world), []))
                ax.errorbar([x], [y], yerr=err, fmt=mark[v.world], ms=4, **WHISKER, **look(v.strategy))
            span = [1e3 * t for v in mine for t in (v.predicted_s, v.measured_s)]
            lo, hi = min(span) / 1.4, max(span) * 1.4
            ax.fill_between([lo, hi], [lo / 1.25, hi / 1.25], [lo / 0.75, hi / 0.75], color="0.88", linewidth=0)
            ax.plot([lo, hi], [lo, hi], color="0.4", lw=0.8)
            ax.set(xlim=(lo, hi), ylim=(lo, hi))
            style.log_axis(ax, "xy")
            note = repeats_note(len(measured.get((model, v.strategy, v.world), [])) for v in mine)
            ylabel = f"measured ms / step\n({note})"
            label(ax, "predicted ms / step (cost model, from medians)", ylabel, model, legend=None)
        line = pyplot().Line2D
        keys = [line([], [], color="0.3", marker=m, ls="", label=f"K={k}") for k, m in mark.items()]
        keys += [line([], [], color="0.4", lw=0.8, label="measured = predicted")]
        keys += [pyplot().Rectangle((0, 0), 1, 1, color="0.88", label="within 25 %")]
        out.append(save_fig(fig, file, rect=legend_below(fig, keys, names=dict.fromkeys(v.strategy for v in rows))))
    return out


def projection(projected: Sequence[Projection], path: Path) -> Figures:
    """``projection.png``: per fabric (rows) and model (columns) the efficiency of every strategy at K ranks with
    the best algorithm; a projection, not a measurement, so without spread."""
    fabrics = list(dict.fromkeys(p.fabric for p in projected))
    models = list(dict.fromkeys(p.model for p in projected))
    out, names = [], list(dict.fromkeys(p.strategy for p in projected))
    for file, chunk in paged(path, models, max(1, style.MAX_PANELS // max(1, len(fabrics)))):
        fig, axes = style.figure(len(fabrics), len(chunk), WIDTH, HEIGHT)
        for i, fabric in enumerate(fabrics):
            for ax, model in zip(axes[i], chunk):
                mine = [p for p in projected if p.fabric == fabric and p.model == model]
                for name in dict.fromkeys(p.strategy for p in mine):
                    ks = list(dict.fromkeys(p.world for p in mine if p.strategy == name))
                    best = [max(p.efficiency for p in mine if (p.strategy, p.world) == (name, k)) for k in ks]
                    ax.plot(ks, best, "o-", ms=3, lw=1, **look(name))
                ax.set_xscale("log", base=2)
                ax.set_ylim(0, 1.05)
                ylabel = "efficiency, best algorithm\n(projected: no spread)"
                label(ax, "ranks K", ylabel, f"{model}\n{fabric}", size=7, legend=None)
        out.append(save_fig(fig, file, rect=legend_below(fig, names=names)))
    return out
