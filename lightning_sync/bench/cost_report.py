"""The report's cost-model sections: the fitted links, the validation against measured step times, and
the projection to thousands of ranks (formulas: :mod:`lightning_sync.bench.model`).

* **Fit.** :func:`~lightning_sync.bench.model.fit_alpha_beta` per all-reduce algorithm over every
  world size of the sweep; ``fit.png`` draws the measured points against the fitted lines.
* **Validation.** For every measured row with a compute time: its traffic (``CommStats``, or the
  analytic one for a row that sent nothing through it, torch's DDP: :func:`traffic_of`), the links
  fitted to the sweep points of the row's own K alone (:meth:`CostModel.links_at`: with more ranks
  than cores, time-sharing changes a link's latency and bandwidth with K, so the validation prices a
  K-rank step with the links measured under that same time-sharing; the pooled fit where the sweep
  did not run at that K) and the compute time measured under the same time-sharing of the cores (the
  plain model fitted alone on each of the K ranks, kept in step by a barrier before every step, no
  communication in the step, in the same rounds as the strategy rows; per step its slowest rank, or, for
  a row that synchronizes once in H steps, per window of H steps its slowest rank's mean) give a predicted
  step time, compared with the measured median (over the same windows). Compressing strategies add their
  codec arithmetic, measured in the run itself (``comms`` op ``codec``: casts, PowerSGD's products), a
  compute cost that the model's T_comp of the plain model does not contain. So do the rows measured at one
  rank too (``cost_model.host_rows``: FSDP2), whose step there has no collective in it: their host work
  (DTensor parameters, per-unit hooks and the optimizer on shards), the one-rank step less T1, scaled by the
  compute's measured time-sharing factor (:meth:`CostModel.host_at`).
  A second prediction replaces that compute time with ``c(K) T1`` (:func:`~lightning_sync.bench.model.contention`).
* **Projection.** Every strategy at the largest measured K, projected to K = 8 ... 4096 with this
  machine's link and with :data:`~lightning_sync.bench.model.H100_NDR400`, for ring, tree and
  hierarchical all-reduce, without and with perfect overlap; ``projection.png``.
"""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path
from typing import Any

from lightning_sync.bench import model as M

__all__ = ["CostModel", "traffic_of"]

_MIB = 2**20
_DDP_FIRST_BUCKET, _DDP_BUCKET = 1 * _MIB, 25 * _MIB  # torch DDP's first bucket and bucket_cap_mb


def traffic_of(row: dict[str, Any]) -> M.Traffic:
    """A report row's per-step traffic: measured through ``comms`` (FSDP2's counted by
    :func:`~lightning_sync.bench.runner.torch_collectives_counted`), else the analytic traffic of the
    strategies that bypass it (torch DDP: one all-reduce of the gradients in 1 MiB then 25 MiB buckets;
    FSDP2, in runs from before its collectives were counted: per ``nn.Linear`` unit two all-gathers of its
    shard, one without ``reshard_after_forward``, and one reduce-scatter, with the backend's own ops,
    ``torch_all_gather`` and ``torch_reduce_scatter``)."""
    world, s = int(row["world"]), float(row["param_bytes"])
    if row["measured"]:
        calls = row["op_calls_per_step"]
        return M.Traffic(
            {op: (float(calls.get(op, 0.0)), float(b)) for op, b in row["op_bytes_per_step"].items()}, world
        )
    cls = str(row["strategy_node"].get("_target_") or "").rpartition(".")[2]
    if cls == "FullyShardStrategy":
        units = max(int(row.get("n_linear", 1)), 1)
        gathers = 2 if row["strategy_node"].get("reshard_after_forward", True) else 1
        return M.Traffic(
            {"torch_all_gather": (gathers * units, gathers * s / world), "torch_reduce_scatter": (units, s)},
            world,
            "analytic",
        )
    buckets = 1 + math.ceil(max(0.0, s - _DDP_FIRST_BUCKET) / _DDP_BUCKET) if s else 0
    return M.Traffic({"all_reduce": (buckets, s)} if s else {}, world, "analytic")


class CostModel:
    """Fits, validates and projects from a :class:`~lightning_sync.bench.report.Report`'s rows."""

    def __init__(
        self,
        rows: list[dict[str, Any]],
        compute: dict[tuple[str, int], float],
        sweep: list[dict[str, Any]],
        cores: int | None = None,
        threads_per_rank: int = 1,
        projection: tuple[int, int] = (8, 4096),
        compute_every: dict[tuple[str, int, int], float] | None = None,
        host: dict[tuple[str, str], float] | None = None,
    ) -> None:
        """``compute``: per (model, K) the compute step time under K-way time-sharing (K = 1: T1);
        ``compute_every``: per (model, K, H) the same for ranks that synchronize once in H steps (the rows
        whose ``sync_every`` is H > 1; :meth:`~lightning_sync.bench.report.Report.compute_every`);
        ``host``: per (model, strategy row) the row's step at one rank less T1 (:meth:`host_at`)."""
        self.rows = [r for r in rows if (r["model"], 1) in compute]  # bucket-sweep rows have no compute of their own
        self.compute = compute
        self.compute_every = dict(compute_every or {})
        self.host = dict(host or {})
        self.cores = cores or os.cpu_count() or 1
        self.threads = threads_per_rank
        self.fits = {
            a: M.fit_alpha_beta(sweep, a)
            for a in M.SWEPT
            if sum(p["algorithm"] == a and p["world"] > 1 for p in sweep) >= 2
        }
        """Per op, one fit to the sweep points of every world size together (the projection's link)."""
        self.fits_at: dict[int, dict[str, M.Fit]] = {}
        """Per world size K, per op, a fit to the sweep points of that K alone (the validation's links)."""
        self.span_ratio: dict[int, float] = {}
        """Per world size K, the median over sweep points of the span / the slowest rank's own time, both
        medians over the repeats (points from before the sweep recorded ``rank_seconds`` have none; before it
        recorded ``median_seconds`` their ``seconds`` was the median)."""
        for k in sorted({int(p["world"]) for p in sweep if int(p["world"]) > 1}):
            mine = [p for p in sweep if int(p["world"]) == k]
            ratios = [p.get("median_seconds", p["seconds"]) / p["rank_seconds"] for p in mine if p.get("rank_seconds")]
            if ratios:
                self.span_ratio[k] = statistics.median(ratios)
            self.fits_at[k] = {
                a: M.fit_alpha_beta(mine, a) for a in M.SWEPT if sum(p["algorithm"] == a for p in mine) >= 2
            }
        self.worlds = M.projection_worlds(*projection)

    @property
    def link(self) -> M.Link:
        """The backend all-reduce's fitted link: what every strategy's collectives use here."""
        return self.fits["backend"].link

    @property
    def op_links(self) -> dict[str, M.Link]:
        """The fitted links of the swept all-gathers and reduce-scatters (``comms``' and the backend's own)."""
        return _op_links(self.fits)

    def links_at(self, world: int) -> tuple[M.Link, dict[str, M.Link], str]:
        """The backend's link, the other swept ops' links and their source (``"K=<world>"`` or ``"pooled"``)
        for a ``world``-rank step: the fits to the sweep at that K alone, else the pooled fits."""
        own = self.fits_at.get(world, {})
        fits = {**self.fits, **own}
        source = f"K={world}" if "backend" in own else "pooled"
        return fits["backend"].link, _op_links(fits), source

    def compute_at(self, model: str, world: int, every: int = 1) -> float | None:
        """The compute a ``world``-rank row that synchronizes once in ``every`` steps is priced with (None
        where it was not measured)."""
        return self.compute_every.get((model, world, every)) if every > 1 else self.compute.get((model, world))

    def one_rank(self, model: str, strategy: str) -> float:
        """A row's T_comp at one rank: T1, plus its own host work where it was measured at one rank."""
        return self.compute[(model, 1)] + self.host.get((model, strategy), 0.0)

    def host_at(self, model: str, strategy: str, world: int, every: int = 1) -> float:
        """Seconds per step of a row's own host work at K = ``world``: its one-rank step less T1, scaled like
        the compute, by the measured time-sharing factor compute(K) / T1 (0 for a row not measured at one rank).

        A row earns the term only where its one-rank step has no collective in it (FSDP2 skips its all-gathers
        and reduce-scatters on one rank): our strategies still run their one-rank collectives through the
        backend there, and T_comm prices those again at K."""
        h = self.host.get((model, strategy))
        if h is None:
            return 0.0
        compute = self.compute_at(model, world, every)
        return h * (
            compute / self.compute[(model, 1)] if compute is not None else M.contention(world, self.cores, self.threads)
        )

    def sharing(self) -> dict[tuple[str, int], float]:
        """Per (model, K > 1): the compute row's time over ``c(K) T1``, what K ranks time-sharing the cores
        alone would give; about 1 on an otherwise idle machine, more where another load shared the cores while
        the rows ran (the strategy rows of that K then ran under it too, and the sweep, run once before them,
        did not)."""
        return {
            (m, k): t / (M.contention(k, self.cores, self.threads) * self.compute[(m, 1)])
            for (m, k), t in self.compute.items()
            if k > 1 and (m, 1) in self.compute
        }

    def validation(self) -> list[dict[str, Any]]:
        """Predicted against measured step time for every row whose K has a compute measurement."""
        out = []
        for r in self.rows:
            k = int(r["world"])
            traffic = traffic_of(r)
            link, op_links, source = self.links_at(k)
            comm = M.comm_here(traffic, k, link, op_links)
            measured = r["step_ms"] / 1e3
            every = int(r.get("sync_every", 1))
            compute = self.compute_at(r["model"], k, every)
            codec = float(r.get("codec_ms", 0.0)) / 1e3
            host = self.host_at(r["model"], r["strategy"], k, every)
            simple = comm + codec + M.contention(k, self.cores, self.threads) * self.one_rank(r["model"], r["strategy"])
            row = {
                "model": r["model"],
                "strategy": r["strategy"],
                "world": k,
                "measured_s": measured,
                "sync_every": every,
                "compute_s": compute,
                "host_s": host,
                "codec_s": codec,
                "comm_s": comm,
                "traffic": traffic.source,
                "links": source,
                "predicted_s": None if compute is None else compute + host + codec + comm,
                "predicted_ck_s": simple,
                "error_ck": simple / measured - 1,
            }
            row["error"] = None if compute is None else row["predicted_s"] / measured - 1
            out.append(row)
        return out

    def projection(self) -> list[dict[str, Any]]:
        """Every strategy of the largest measured K, projected on both fabrics (see module docstring)."""
        top = max((int(r["world"]) for r in self.rows), default=0)
        fabrics = [M.this_machine(self.link, self.cores, self.threads, self.op_links), M.H100_NDR400]
        out = []
        for r in self.rows:
            if int(r["world"]) != top:
                continue
            t1 = self.one_rank(r["model"], r["strategy"])
            for fabric in fabrics:
                for p in M.project(traffic_of(r), t1, fabric, self.worlds):
                    out.append({"model": r["model"], "strategy": r["strategy"], "fabric": fabric.name, **p})
        return out

    # ------------------------------------------------------------------------------------ markdown
    def markdown(self) -> list[str]:
        lines = [
            "## Cost model",
            "",
            "Latency a and bandwidth 1/b fitted by least squares (relative error) to the measured all-reduce "
            "sweep, every world size together, with T = 2(K-1) a + 2(K-1)/K S b (ring and backend all-reduce), "
            "T = 2 ceil(log2 K)(a + S b) (tree), T = (K-1) a + (K-1)/K S b (the backend's all-gather and "
            "reduce-scatter of a whole of S bytes). Formulas: `lightning_sync/bench/model.py`. A point is the mean "
            "over repeats of the collective's span, from its last rank's start to its last rank's end (the "
            "wait for a late starter is the compute term's, which takes each step's slowest rank); the mean, "
            "not the median, since a step pays the sum of its calls and the span is heavy tailed here "
            "(`lightning_sync/bench/sweep.py`).",
            "",
            "| algorithm | a (us) | bandwidth (GB/s) | points | median abs error | error >= 1 MiB | "
            + " | ".join(f"K={k}" for k in self._sweep_worlds())
            + " |",
            "|---|---:|---:|---:|---:|---:|" + "---:|" * len(self._sweep_worlds()),
        ]
        for a, fit in self.fits.items():
            per_k = " | ".join(f"{fit.median_abs_error(k):.0%}" for k in self._sweep_worlds())
            lines.append(
                f"| {a} | {fit.link.alpha * 1e6:.0f} | {fit.link.bandwidth / 1e9:.2f} | {len(fit.points)} | "
                f"{fit.median_abs_error():.0%} | {fit.median_abs_error(min_bytes=_MIB):.0%} | {per_k} |"
            )
        if self.fits_at:
            worlds = list(self.fits_at)
            lines += [
                "",
                "Fitted at each K alone (the validation's links: a K-rank step is priced with the links "
                "measured under the same time-sharing of the cores), a (us) / bandwidth (GB/s) and the median "
                "abs error:",
                "",
                "| algorithm | " + " | ".join(f"K={k}" for k in worlds) + " |",
                "|---|" + "---:|" * len(worlds),
            ]
            for a in self.fits:
                cells = [
                    f"{f.link.alpha * 1e6:.0f} / {f.link.bandwidth / 1e9:.2f} ({f.median_abs_error():.0%})"
                    if (f := self.fits_at[k].get(a))
                    else "-"
                    for k in worlds
                ]
                lines.append(f"| {a} | " + " | ".join(cells) + " |")
        if self.span_ratio:
            lines += [
                "",
                "Span against the slowest rank's own time (median over the points, at most 1 by "
                "construction): " + ", ".join(f"K={k} {r:.2f}" for k, r in self.span_ratio.items()) + ".",
            ]
        lines += [
            "",
            "### Validation: predicted against measured step time",
            "",
            "Predicted = compute measured under the same time-sharing (the plain model fitted alone on each "
            "of the K ranks, no communication in the step, kept in step by a barrier before every step, in "
            "the same rounds as the strategy rows; per step the slowest rank's time, since a synchronous "
            "step waits for its slowest rank; the median over steps; for a row that synchronizes once in H "
            "steps, H in the table, per window of H steps the slowest rank's mean, since the ranks wait for "
            "each other once per window, and the row's measured time is the median window mean too) + host "
            "(a row's own host work, for the rows measured at one rank too, whose step there has no collective: "
            "that step less T1, times the time-sharing factor compute / T1) + codec "
            "(compression arithmetic, measured in the run: `comms` op `codec`) + T_comm from the row's per-step traffic "
            "(`CommStats`; analytic where a row sent nothing through `comms`: torch DDP) and the links fitted "
            "at the row's K (the "
            "backend's all-reduce; `comms`' all-gather and reduce-scatter; gloo's own ones for FSDP2), no "
            "overlap. The last two "
            f"columns use c(K) (T1 + host at one rank) (c = max(1, K / {self.cores} cores)) instead of the "
            "measured compute and host.",
            "",
            "| model | strategy | K | H | measured ms | compute ms | host ms | codec ms | T_comm ms "
            "| predicted ms | error | c(K) (T1 + host) + codec + T_comm ms | error |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        val = self.validation()
        for v in val:
            comp = "n/a" if v["compute_s"] is None else f"{v['compute_s'] * 1e3:.1f}"
            pred = "n/a" if v["predicted_s"] is None else f"{v['predicted_s'] * 1e3:.1f}"
            err = "n/a" if v["error"] is None else f"{v['error']:+.0%}"
            lines.append(
                f"| {v['model']} | {v['strategy']} | {v['world']} | {v['sync_every']} | "
                f"{v['measured_s'] * 1e3:.1f} | {comp} | {v['host_s'] * 1e3:.1f} | "
                f"{v['codec_s'] * 1e3:.1f} | {v['comm_s'] * 1e3:.1f} | {pred} | {err} | {v['predicted_ck_s'] * 1e3:.1f} | "
                f"{v['error_ck']:+.0%} |"
            )
        errs = [abs(v["error"]) for v in val if v["error"] is not None]
        if errs:
            within = sum(e <= 0.25 for e in errs)
            lines += [
                "",
                f"{within} of {len(errs)} predictions lie within 25 % of the measured step time; largest "
                f"error {max(errs):.0%}, median {sorted(errs)[len(errs) // 2]:.0%}.",
                "",
                "Largest |error| per strategy over models and K: "
                + ", ".join(
                    f"{name} {max(abs(v['error']) for v in val if v['strategy'] == name and v['error'] is not None):.0%}"
                    for name in dict.fromkeys(v["strategy"] for v in val if v["error"] is not None)
                )
                + ".",
            ]
        if sharing := self.sharing():
            lines += [
                "",
                "Time-sharing check, the compute row over c(K) T1 (about 1.00 where the K ranks had the "
                "cores to themselves; more where another load shared them during the run): "
                + ", ".join(f"{m} K={k} {r:.2f}" for (m, k), r in sorted(sharing.items(), key=lambda x: x[0][::-1]))
                + ".",
            ]
        lines += self._projection_markdown()
        return [*lines, ""]

    def _sweep_worlds(self) -> list[int]:
        return sorted({int(p["world"]) for fit in self.fits.values() for p in fit.points})

    def _projection_markdown(self) -> list[str]:
        proj = self.projection()
        if not proj:
            return []
        show = [k for k in (8, 64, 512, 4096) if k in self.worlds]
        lines = [
            "",
            "### Projection to K ranks",
            "",
            "Weak scaling at the measured per-rank batch: T_comp = the measured single-process step time "
            "(this machine's CPU compute), T_comm from the row's traffic at the largest measured K rescaled to K "
            "(shards shrink as 1/K). Efficiency T_comp / T_step without overlap, as ring / tree / hierarchical "
            "all-reduce; the last column is the compute per step that would give 0.9 with the best algorithm "
            "at the largest K (9 T_comm): what a faster accelerator may not undercut.",
            "",
        ]
        for fabric in dict.fromkeys(p["fabric"] for p in proj):
            lines += [
                f"**{fabric}**",
                "",
                "| model | strategy | " + " | ".join(f"K={k}" for k in show) + f" | compute for 0.9 at K={show[-1]} |",
                "|---|---|" + "---:|" * (len(show) + 1),
            ]
            mine = [p for p in proj if p["fabric"] == fabric]
            for model, name in dict.fromkeys((p["model"], p["strategy"]) for p in mine):
                cells = []
                for k in show:
                    effs = {
                        p["algorithm"]: p["efficiency"]
                        for p in mine
                        if (p["model"], p["strategy"], p["world"]) == (model, name, k)
                    }
                    cells.append(" / ".join(f"{effs[a]:.2f}" for a in ("ring", "tree", "hierarchical")))
                best = min(
                    p["compute_for_90"]
                    for p in mine
                    if (p["model"], p["strategy"], p["world"]) == (model, name, show[-1])
                )
                lines.append(f"| {model} | {name} | " + " | ".join(cells) + f" | {_fmt_s(best)} |")
            lines.append("")
        lines += [
            f"Fabric links: {M.H100_NDR400.intra.source}; {M.H100_NDR400.inter.source}. This machine: "
            f"the backend fit ({self.link.alpha * 1e6:.0f} us, {self.link.bandwidth / 1e9:.2f} GB/s), nodes of "
            f"{max(1, self.cores // self.threads)} ranks."
        ]
        return lines

    # --------------------------------------------------------------------------------------- plots
    def plots(self, out_dir: Path, plt: Any) -> None:
        """``fit.png`` (sweep against fit) and ``projection.png`` (efficiency against K)."""
        fig, axes = plt.subplots(1, len(self.fits), figsize=(5 * len(self.fits), 4), squeeze=False)
        for ax, (a, fit) in zip(axes[0], self.fits.items()):
            for k in self._sweep_worlds():
                pts = sorted((p for p in fit.points if p["world"] == k), key=lambda p: p["bytes"])
                line = ax.plot(
                    [p["bytes"] for p in pts], [p["seconds"] * 1e3 for p in pts], "o", ms=4, label=f"K={k} measured"
                )
                ax.plot(
                    [p["bytes"] for p in pts],
                    [p["predicted"] * 1e3 for p in pts],
                    "-",
                    color=line[0].get_color(),
                    label=f"K={k} fit",
                )
            ax.set_xscale("log")
            ax.set_yscale("log")
            _label(
                ax,
                "payload, the whole tensor (bytes)",
                "ms",
                f"{a}: a={fit.link.alpha * 1e6:.0f} us, {fit.link.bandwidth / 1e9:.2f} GB/s",
            )
        _save(fig, out_dir / "fit.png", plt)
        proj = self.projection()
        if not proj:
            return
        fabrics = list(dict.fromkeys(p["fabric"] for p in proj))
        models = list(dict.fromkeys(p["model"] for p in proj))
        fig, axes = plt.subplots(len(fabrics), len(models), figsize=(5 * len(models), 4 * len(fabrics)), squeeze=False)
        for i, fabric in enumerate(fabrics):
            for j, model in enumerate(models):
                ax = axes[i][j]
                mine = [p for p in proj if p["fabric"] == fabric and p["model"] == model]
                for name in dict.fromkeys(p["strategy"] for p in mine):
                    best = {}
                    for p in mine:
                        if p["strategy"] == name and p["efficiency"] > best.get(p["world"], -1):
                            best[p["world"]] = p["efficiency"]
                    ax.plot(list(best), list(best.values()), "o-", ms=3, label=name)
                ax.set_xscale("log", base=2)
                ax.set_ylim(0, 1.05)
                _label(ax, "ranks K", "efficiency (best algorithm, no overlap)", f"{model}\n{fabric}")
        _save(fig, out_dir / "projection.png", plt)


def _op_links(fits: dict[str, M.Fit]) -> dict[str, M.Link]:
    """The links of the fitted ops that have their own cost entry (all-gathers and reduce-scatters)."""
    return {op: fits[op].link for op in M.SWEPT if op in fits and op in M.OP_COST}


def _label(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=6)


def _save(fig: Any, path: Path, plt: Any) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"
