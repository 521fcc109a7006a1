"""The report's cost-model sections (:mod:`lightning_sync.bench.model`): the stored parameters against their
calibration points, each row's step predicted against its measured one, and every strategy projected to K ranks.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lightning_sync.bench import model as M
from lightning_sync.bench.rows import Row, fmt, median, pyplot, strategy_class
from lightning_sync.bench.style import MARKERS, WHISKER, figure, label, legend_below, save_fig, whisker

__all__ = ["FIT_PANELS", "CostModel", "Validation", "params_markdown", "plot_fit", "traffic_of"]

_MIB = 2**20
_DDP_FIRST_BUCKET, _DDP_BUCKET = 1 * _MIB, 25 * _MIB  # torch DDP's first bucket and bucket_cap_mb


def traffic_of(row: Row) -> M.Traffic:
    """A row's per-step traffic: measured through ``comms``, else analytic: torch DDP's 1 MiB then 25 MiB buckets;
    FSDP2 per ``nn.Linear`` unit two all-gathers (one without resharding) and a reduce-scatter."""
    world, s = row.world, float(row.param_bytes)
    if row.measured:
        ops = {op: (float(row.op_calls_per_step.get(op, 0.0)), float(b)) for op, b in row.op_bytes_per_step.items()}
        return M.Traffic(ops, world)
    if strategy_class(row.strategy_node) == "FullyShardStrategy":
        units = max(row.n_linear, 1)
        gathers = 2 if row.strategy_node.get("reshard_after_forward", True) else 1
        ops = {"torch_all_gather": (gathers * units, gathers * s / world), "torch_reduce_scatter": (units, s)}
        return M.Traffic(ops, world, "analytic")
    buckets = 1 + math.ceil(max(0.0, s - _DDP_FIRST_BUCKET) / _DDP_BUCKET) if s else 0
    return M.Traffic({"all_reduce": (buckets, s)} if s else {}, world, "analytic")


@dataclass
class Validation:
    """A row's predicted step time against its measured one (seconds; ``None`` where compute was not measured).
    ``predicted_ck_s`` uses ``c(K)`` times the one-rank step; ``links``: ``K=<k>`` or ``pooled``."""

    model: str
    strategy: str
    world: int
    measured_s: float
    sync_every: int
    compute_s: float | None
    host_s: float
    codec_s: float
    comm_s: float
    traffic: str
    links: str
    predicted_s: float | None
    predicted_ck_s: float
    error_ck: float
    error: float | None


class CostModel:
    """Validates and projects a :class:`~lightning_sync.bench.report.Report`'s rows with stored parameters."""

    def __init__(
        self,
        rows: list[Row],
        compute: dict[tuple[str, int], float],
        params: M.CostParams,
        cores: int | None = None,
        threads_per_rank: int = 1,
        projection: tuple[int, int] = (8, 4096),
        compute_every: dict[tuple[str, int, int], float] | None = None,
        host: dict[tuple[str, str], float] | None = None,
    ) -> None:
        """``compute``: per (model, K) compute under K-way time-sharing (K = 1: T1); ``compute_every``: per
        (model, K, H) the same, synchronizing once in H steps; ``host``: per (model, row) its one-rank step less T1."""
        self.rows = [r for r in rows if (r.model, 1) in compute]  # bucket-sweep rows have no compute of their own
        self.compute, self.compute_every, self.host = compute, dict(compute_every or {}), dict(host or {})
        self.cores, self.threads, self.params = cores or os.cpu_count() or 1, threads_per_rank, params
        self.fits_at = {k: params.fits(k) for k in params.links_at}
        self.worlds = M.projection_worlds(*projection)

    @property
    def link(self) -> M.Link:
        """The backend all-reduce's link: what every strategy's collectives use here."""
        return self.params.links["backend"]

    def compute_at(self, model: str, world: int, every: int = 1) -> float | None:
        """The compute a ``world``-rank row that synchronizes once in ``every`` steps is priced with."""
        return self.compute_every.get((model, world, every)) if every > 1 else self.compute.get((model, world))

    def one_rank(self, model: str, strategy: str) -> float:
        """A row's T_comp at one rank: T1, plus its own host work where it was measured at one rank."""
        return self.compute[(model, 1)] + self.host.get((model, strategy), 0.0)

    def host_at(self, model: str, strategy: str, world: int, every: int = 1) -> float:
        """A row's host work per step at K = ``world``: its one-rank step less T1, scaled by compute(K) / T1 (by
        ``c(K)`` where compute was not measured); 0 for a row not measured at one rank."""
        if (h := self.host.get((model, strategy))) is None:
            return 0.0
        if (compute := self.compute_at(model, world, every)) is None:
            return h * M.contention(world, self.cores, self.threads)
        return h * compute / self.compute[(model, 1)]

    def sharing(self) -> dict[tuple[str, int], float]:
        """Per (model, K > 1): the compute row over ``c(K) T1``; about 1 on an otherwise idle machine."""
        return {
            (m, k): t / (M.contention(k, self.cores, self.threads) * self.compute[(m, 1)])
            for (m, k), t in self.compute.items()
            if k > 1 and (m, 1) in self.compute
        }

    def validation(self) -> list[Validation]:
        """Predicted against measured step time for every row whose model has a T1."""
        out = []
        for r in self.rows:
            k, measured, codec, traffic = r.world, r.step_ms / 1e3, r.codec_ms / 1e3, traffic_of(r)
            own = self.params.links_at.get(k, {})  # the links calibrated at this K, else the pooled ones
            links, source = {**self.params.links, **own}, f"K={k}" if "backend" in own else "pooled"
            comm = M.comm_here(traffic, k, links["backend"], _op_links(links))
            compute = self.compute_at(r.model, k, r.sync_every)
            host = self.host_at(r.model, r.strategy, k, r.sync_every)
            simple = comm + codec + M.contention(k, self.cores, self.threads) * self.one_rank(r.model, r.strategy)
            pred = None if compute is None else compute + host + codec + comm
            err = None if pred is None else pred / measured - 1
            row = (r.model, r.strategy, k, measured, r.sync_every, compute, host, codec, comm, traffic.source, source)
            out.append(Validation(*row, pred, simple, simple / measured - 1, err))
        return out

    def projection(self) -> list[M.Projection]:
        """Every strategy of the largest measured K, projected to each K of ``worlds`` here and on H100_NDR400."""
        top = max((r.world for r in self.rows), default=0)
        here = M.this_machine(self.link, self.cores, self.threads, _op_links(self.params.links))
        out = []
        for r in (r for r in self.rows if r.world == top):
            for fabric in (here, M.H100_NDR400):
                for p in M.project(traffic_of(r), self.one_rank(r.model, r.strategy), fabric, self.worlds):
                    out.append(replace(p, model=r.model, strategy=r.strategy, fabric=fabric.name))
        return out

    def markdown(self) -> list[str]:
        lines = params_markdown(self.params)
        lines += [
            "",
            "### Validation: predicted against measured step time",
            "",
            "Predicted = compute (the plain model alone on each of the K ranks, in step, in the same rounds; the "
            "slowest rank per step, or per window of H steps) + host (one-rank step less T1, times compute / T1) + "
            "codec + T_comm of the row's traffic on the links calibrated at its K, no overlap. The last two columns "
            f"use c(K) (T1 + host) with c = max(1, K / {self.cores} cores) instead.",
            "",
            "| model | strategy | K | H | measured ms | compute ms | host ms | codec ms | T_comm ms "
            "| predicted ms | error | c(K) (T1 + host) + codec + T_comm ms | error |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        val = self.validation()
        for v in val:
            comp, pred = (fmt(math.nan if s is None else s * 1e3, ".1f") for s in (v.compute_s, v.predicted_s))
            err = "n/a" if v.error is None else f"{v.error:+.0%}"
            lines.append(
                f"| {v.model} | {v.strategy} | {v.world} | {v.sync_every} | {v.measured_s * 1e3:.1f} | {comp} | "
                f"{v.host_s * 1e3:.1f} | {v.codec_s * 1e3:.1f} | {v.comm_s * 1e3:.1f} | {pred} | {err} | "
                f"{v.predicted_ck_s * 1e3:.1f} | {v.error_ck:+.0%} |"
            )
        errs: dict[str, list[float]] = {}
        for v in (v for v in val if v.error is not None):
            errs.setdefault(v.strategy, []).append(abs(v.error))
        if errs:
            flat = sorted(e for es in errs.values() for e in es)
            worst = ", ".join(f"{n} {max(es):.0%}" for n, es in errs.items())
            lines += [
                "",
                f"{sum(e <= 0.25 for e in flat)} of {len(flat)} predictions lie within 25 % of the measured step "
                f"time; largest error {max(flat):.0%}, median {flat[len(flat) // 2]:.0%}.",
                "",
                f"Largest |error| per strategy over models and K: {worst}.",
            ]
        if sharing := self.sharing():
            shared = ", ".join(f"{m} K={k} {r:.2f}" for (m, k), r in sorted(sharing.items(), key=lambda x: x[0][::-1]))
            lines += [
                "",
                "Time-sharing check, the compute row over c(K) T1 (about 1.00 where the K ranks had the cores to "
                f"themselves; more where another load shared them during the run): {shared}.",
            ]
        return [*lines, *self._projection_markdown(), ""]

    def _projection_markdown(self) -> list[str]:
        if not (proj := self.projection()):
            return []
        show = [k for k in (8, 64, 512, 4096) if k in self.worlds]
        lines = [
            "",
            "### Projection to K ranks",
            "",
            "Weak scaling: T_comp = the single-process step, T_comm = the row's traffic at the largest measured K "
            "rescaled to K. Efficiency T_comp / T_step, no overlap, ring / tree / hierarchical; the last column is "
            "the compute per step giving 0.9 with the best algorithm (9 T_comm).",
            "",
        ]
        for fabric in dict.fromkeys(p.fabric for p in proj):
            lines += [
                f"**{fabric}**",
                "",
                f"| model | strategy | {_ks(show)} | compute for 0.9 at K={show[-1]} |",
                "|---|---|" + "---:|" * (len(show) + 1),
            ]
            mine = [p for p in proj if p.fabric == fabric]
            for model, name in dict.fromkeys((p.model, p.strategy) for p in mine):
                at = {(p.world, p.algorithm): p for p in mine if (p.model, p.strategy) == (model, name)}
                cells = [" / ".join(f"{at[(k, a)].efficiency:.2f}" for a in M.ALGORITHMS[1:]) for k in show]
                best = min(p.compute_for_90 for (k, _), p in at.items() if k == show[-1])
                best_s = f"{best * 1e3:.1f} ms" if best >= 1e-3 else f"{best * 1e6:.0f} us"
                lines.append(f"| {model} | {name} | " + " | ".join(cells) + f" | {best_s} |")
            lines.append("")
        lines.append(
            f"Fabric links: {M.H100_NDR400.intra.source}; {M.H100_NDR400.inter.source}. This machine: the backend "
            f"link ({self.link.alpha * 1e6:.0f} us, {self.link.bandwidth / 1e9:.2f} GB/s), nodes of "
            f"{max(1, self.cores // self.threads)} ranks."
        )
        return lines


def params_markdown(params: M.CostParams) -> list[str]:
    """Every op's pooled link with its errors against the calibration's points, the links of each K alone, and
    the sweep's span over the slowest rank's time."""
    fits, worlds = params.fits(), sorted({p.world for p in params.points})
    lines = [
        "## Cost model",
        "",
        f"Parameters: {params.source}. Latency a and bandwidth 1/b per op from `lightning-sync bench mode=calibrate`"
        " (stored in `cost_model.params_file`, not refitted here): T = 2(K-1) a + 2(K-1)/K S b (ring, backend), "
        "2 ceil(log2 K)(a + S b) (tree), (K-1) a + (K-1)/K S b (all-gather, reduce-scatter); formulas in "
        "`lightning_sync/bench/model.py`. Errors are against the mean span of each calibration point.",
        "",
        f"| algorithm | a (us) | bandwidth (GB/s) | points | median abs error | error >= 1 MiB | {_ks(worlds)} |",
        "|---|---:|---:|---:|---:|---:|" + "---:|" * len(worlds),
    ]
    for a, fit in fits.items():
        per_k = " | ".join(f"{fit.median_abs_error(k):.0%}" for k in worlds)
        lines.append(
            f"| {a} | {fit.link.alpha * 1e6:.0f} | {fit.link.bandwidth / 1e9:.2f} | {len(fit.points)} | "
            f"{fit.median_abs_error():.0%} | {fit.median_abs_error(min_bytes=_MIB):.0%} | {per_k} |"
        )
    if params.links_at:
        at = {k: params.fits(k) for k in params.links_at}
        lines += [
            "",
            "Calibrated at each K alone (the validation's links), a (us) / bandwidth (GB/s) (median abs error):",
            "",
            f"| algorithm | {_ks(at)} |",
            "|---|" + "---:|" * len(at),
        ]
        for a in fits:
            cells = [
                f"{f.link.alpha * 1e6:.0f} / {f.link.bandwidth / 1e9:.2f} ({f.median_abs_error():.0%})" if f else "-"
                for f in (at[k].get(a) for k in at)
            ]
            lines.append(f"| {a} | " + " | ".join(cells) + " |")
    timed = [p for p in params.points if p.rank_seconds > 0]
    spans = {k: median([p.median_seconds / p.rank_seconds for p in timed if p.world == k]) for k in worlds}
    if spans := ", ".join(f"K={k} {r:.2f}" for k, r in spans.items() if not math.isnan(r)):
        note = "Span against the slowest rank's own time (median over the points, at most 1 by construction)"
        lines += ["", f"{note}: {spans}."]
    return lines


#: The panels of ``fit.png``: the swept ops by what they do (an op not named here gets a panel of its own).
FIT_PANELS = {
    "all-reduce": ("backend", "ring", "tree"),
    "all-gather": ("all_gather", "torch_all_gather"),
    "reduce-scatter": ("reduce_scatter", "torch_reduce_scatter"),
}


def plot_fit(params: M.CostParams, path: Path) -> Any:
    """``fit.png``: the calibration's points (markers by K) against each op's pooled link (lines), a panel per kind
    of op (:data:`FIT_PANELS`); a point stored without its spread at its mean span. Returns the figure, closed."""
    from lightning_sync.bench.sweep import DEFAULT_SIZES

    fits = params.fits()
    named = {op for ops in FIT_PANELS.values() for op in ops}
    groups = {title: [op for op in ops if op in fits] for title, ops in FIT_PANELS.items()}
    groups.update({op: [op] for op in fits if op not in named})
    groups = {t: ops for t, ops in groups.items() if ops}
    worlds = sorted({p.world for p in params.points}) or [2]
    mark = dict(zip(worlds, itertools.cycle(MARKERS)))
    spread = any(_has_spread(p) for p in params.points)
    note = "median, whiskers min-max of the repeats" if spread else "mean span of the repeats"
    note += "" if spread else "; their spread was not stored"
    cmap = pyplot().get_cmap("tab10")
    fig, axes = figure(1, len(groups), 4.8, 3.8)
    for ax, (title, ops) in zip(axes[0], groups.items()):
        for i, op in enumerate(ops):  # the ops of a panel in tab10's first, most distinct colours
            fit, c = fits[op], cmap(i % 10)
            link = f"{op}: a={fit.link.alpha * 1e6:.0f} us, {fit.link.bandwidth / 1e9:.2f} GB/s"
            for n, k in enumerate(worlds):
                pts = sorted((p for p in fit.points if p.world == k), key=lambda p: p.bytes)
                sizes = [p.bytes for p in pts] or DEFAULT_SIZES
                _plot_points(ax, pts, mark[k], c)
                grid = [M.SweepPoint(op, k, s, 1.0) for s in sizes]
                ax.plot(sizes, [fit.predict(p) * 1e3 for p in grid], "-", lw=1, color=c, label=link if n == 0 else None)
        ax.set(xscale="log", yscale="log")
        label(ax, "payload, the whole tensor (bytes)", f"ms (points: {note})", title, legend=6)
    line = pyplot().Line2D
    keys = [line([], [], color="0.3", marker=m, ls="", label=f"K={k} measured") for k, m in mark.items()]
    keys = keys if params.points else []  # the default parameters come without points
    return save_fig(fig, path, rect=legend_below(fig, [*keys, line([], [], color="0.3", label="fitted link")], 6))


def _has_spread(p: M.SweepPoint) -> bool:
    return not any(math.isnan(v) for v in (p.median_seconds, p.min_seconds, p.max_seconds))


def _plot_points(ax: Any, pts: list[M.SweepPoint], marker: str, colour: Any) -> None:
    """Each point at its median span with whiskers from the fastest to the slowest repeat; a point without its
    spread at its mean span (the only figure it kept)."""
    for p in pts:
        if _has_spread(p):
            err = whisker(p.median_seconds * 1e3, (p.min_seconds * 1e3, p.max_seconds * 1e3))
            ax.errorbar([p.bytes], [p.median_seconds * 1e3], yerr=err, fmt=marker, ms=3, color=colour, **WHISKER)
        else:
            ax.plot([p.bytes], [p.seconds * 1e3], marker, ms=3, color=colour)


def _op_links(links: dict[str, M.Link]) -> dict[str, M.Link]:
    """The links of the ops that have their own cost entry (the all-gathers and reduce-scatters)."""
    return {op: link for op, link in links.items() if op in M.OP_COST}


def _ks(worlds: Iterable[int]) -> str:
    return " | ".join(f"K={k}" for k in worlds)
