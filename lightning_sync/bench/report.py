"""Measurements to medians, same-pair ratios, a Markdown report and PNG plots. The machine is noisy, so a ratio is
the median over pairs of two trials run back to back, and a row that synchronizes once in H steps is timed per
H-step window (:func:`sync_every`).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from lightning_sync._checks import check_int
from lightning_sync.bench.cost_report import CostModel
from lightning_sync.bench.model import TORCH_TWINS, WIRE_FACTORS, CostParams
from lightning_sync.bench.plots import write_plots
from lightning_sync.bench.rows import Measurement, Row, fmt, median, strategy_class
from lightning_sync.bench.runner import IN_STEP, SINGLE_ROW

__all__ = ["Report", "analytic_wire_bytes", "load_raw", "measurements", "save_raw", "sync_every", "wire_bytes"]

Results = Mapping[int, list[list[Measurement]]]


def wire_bytes(op_bytes: Mapping[str, float], world: int) -> float:
    """Ring-model bytes one rank sends, from its per-op payload bytes (``{op: bytes}``) over K=``world`` ranks."""
    check_int("world size", world, 1)
    return sum(WIRE_FACTORS.get(op, lambda k: 1.0)(world) * b for op, b in op_bytes.items())


def analytic_wire_factor(strategy: Mapping[str, Any], world: int) -> float:
    """Wire bytes per parameter byte and step: ``3(K-1)/K`` for ZeRO-3 and FSDP2 (two all-gathers, a reduce-scatter;
    ``2(K-1)/K`` without resharding), else ``2(K-1)/K`` (compression is not modelled)."""
    check_int("world size", world, 1)
    cls, stage = strategy_class(dict(strategy)), int(strategy.get("stage", 3))
    if cls == "ShardedStrategy" and stage not in (1, 2, 3):
        raise ValueError(f"ShardedStrategy stage must be one of [1, 2, 3], got {stage!r}")
    sharded = cls == "FullyShardStrategy" or (cls == "ShardedStrategy" and stage == 3)
    return (3 if sharded and strategy.get("reshard_after_forward", True) else 2) * (world - 1) / world


def analytic_wire_bytes(strategy: Mapping[str, Any], param_bytes: float, world: int) -> float:
    """:func:`analytic_wire_factor` times S, the bytes of the trainable parameters (padding aside)."""
    if param_bytes < 0:
        raise ValueError(f"param_bytes must be >= 0, got {param_bytes!r}")
    return analytic_wire_factor(strategy, world) * param_bytes


def window_means(steps: list[float], every: int = 1) -> list[float]:
    """The mean step time of each window of ``every`` consecutive steps (a trailing partial window is dropped)."""
    check_int("every", every, 1)
    return [sum(steps[i : i + every]) / every for i in range(0, len(steps) - every + 1, every)]


def slowest_per_step(ranks: list[list[float]], every: int = 1) -> list[float]:
    """Per step (per window of ``every`` steps: ranks that synchronize once in H steps wait for the slowest one's
    H steps together), the slowest process's time: a synchronous step ends when its slowest rank does."""
    return [max(window) for window in zip(*(window_means(r, every) for r in ranks))]


def sync_every(step_calls: list[int] | None) -> int:
    """H, a trial's synchronization period: timed steps over those that issued collectives (1 if none did)."""
    busy = sum(1 for c in step_calls or [] if c > 0)
    return max(1, round(len(step_calls or []) / busy)) if busy else 1


def save_raw(path: Path, results: Results, single: list[Measurement], params: CostParams | None, meta: dict) -> None:
    """A run's measurements, cost-model parameters and metadata as JSON, for :func:`load_raw`."""
    body = {"meta": meta, "results": {str(k): [[asdict(m) for m in rank] for rank in v] for k, v in results.items()}}
    body |= {"single": [asdict(m) for m in single], "params": params.as_json() if params is not None else None}
    path.write_text(json.dumps(body, default=str))


def load_raw(path: Path) -> tuple[dict[int, list[list[Measurement]]], list[Measurement], CostParams | None, dict]:
    """``(results, single, params, meta)`` as :func:`save_raw` wrote them: ``Report(results, single, cfg, meta,
    params)`` with the run's config rebuilds its report."""
    raw = json.loads(path.read_text())
    params = CostParams.from_json(raw["params"], str(path)) if raw.get("params") else None
    return *measurements(raw), params, raw["meta"]


def measurements(raw: dict[str, Any]) -> tuple[dict[int, list[list[Measurement]]], list[Measurement]]:
    """``(results, single)`` of a ``raw.json``'s contents, keys :class:`Measurement` no longer has left out."""
    known = {f.name for f in fields(Measurement)}

    def one(m: dict[str, Any]) -> Measurement:
        return Measurement(**{k: v for k, v in m.items() if k in known})

    results = {int(k): [[one(m) for m in rank] for rank in v] for k, v in raw["results"].items()}
    return results, [one(m) for m in raw["single"]]


class Report:
    """Aggregates the runner's measurements into :class:`~lightning_sync.bench.rows.Row` s, tables and plots."""

    def __init__(
        self,
        results: list[list[Measurement]] | Results,
        single: list[Measurement],
        cfg: Any,
        meta: dict[str, Any],
        params: CostParams | None = None,
    ) -> None:
        """``results``: per world size (or one world size's list), per rank, the trials (compute rows among
        them); ``single``: one-process trials (T1 and host rows); ``params``: None for no cost model."""
        self.meta, self.cfg, self.params, self.baseline = meta, cfg, params, str(cfg.baseline)
        table = cfg.get("sharding_table") or {}
        self.shard_names, self.reference = [str(n) for n in table.get("rows", [])], str(table.get("reference", "fsdp2"))
        by_world = results if isinstance(results, Mapping) else {results[0][0].world if results[0] else 0: results}
        self._trials: dict[tuple[str, str, int], list[Measurement]] = defaultdict(list)
        self._in_step: dict[tuple[str, int], list[list[list[float]]]] = defaultdict(list)  # per round, per rank
        for world, ranks in by_world.items():
            for i, rank0 in enumerate(ranks[0]):
                mine = [r[i] for r in ranks]
                if rank0.extra.get(IN_STEP):
                    self._in_step[(rank0.model, int(world))].append([list(m.step_s) for m in mine])
                    continue
                wire = max(wire_bytes(m.op_bytes_per_step, m.world) for m in mine)
                key = (rank0.model, rank0.name, int(world))
                self._trials[key].append(replace(rank0, peak_mib=max(m.peak_mib for m in mine), wire_bytes=wire))
        solo: dict[tuple[str, str], list[float]] = defaultdict(list)
        for m in single:
            solo[(m.model, m.name)].append(median(m.step_s))
        self._single = {model: median(v) for (model, n), v in solo.items() if n == SINGLE_ROW}  # T1 per model
        hosts = [(k, v) for k, v in solo.items() if k[1] != SINGLE_ROW and k[0] in self._single]
        self.host = {k: median(v) - self._single[k[0]] for k, v in hosts}  # per (model, row): one-rank step less T1
        self.compute = {key: self.compute_every(*key, 1) for key in self._in_step}  # per (model, K); K = 1: T1
        for model, t1 in self._single.items():
            self.compute.setdefault((model, 1), t1)
        self._rows = {key: self._row(*key) for key in self._trials}
        self.cost_model = self._cost_model()

    def compute_every(self, model: str, world: int, every: int) -> float:
        """Compute step time at K ranks that synchronize once in ``every`` steps: the median over windows of the
        slowest in-step rank's mean; NaN where no compute row ran."""
        return median([w for ranks in self._in_step.get((model, world), []) for w in slowest_per_step(ranks, every)])

    @staticmethod
    def step_seconds(t: Measurement) -> float:
        """One trial's step time: the median over its windows of H steps (:func:`sync_every`)."""
        return median(window_means(list(t.step_s), sync_every(t.step_calls)))

    def trials(self, row: Row) -> list[Measurement]:
        """The trials a row aggregates, one per round (with the largest rank's peak memory), for their spread."""
        return list(self._trials.get((row.model, row.strategy, row.world), []))

    def _ratio(self, model: str, name: str, reference: str, world: int) -> float:
        if name == reference or (base := self._trials.get((model, reference, world))) is None:
            return 1.0 if name == reference else math.nan
        pairs = zip(self._trials[(model, name, world)], base)
        return median([self.step_seconds(t) / self.step_seconds(b) for t, b in pairs])

    def _row(self, model: str, name: str, world: int) -> Row:
        trials = self._trials[(model, name, world)]
        first, single, step = trials[0], self._single.get(model), median([self.step_seconds(t) for t in trials])
        grad, sent = first.param_bytes, median([t.bytes_per_step for t in trials])
        exposed = median([median(t.exposed_s) for t in trials if t.exposed_s])
        comm = median([t.comm_s for t in trials if t.comm_s])
        measured = any(t.comm_calls for t in trials)  # else the strategy bypasses comms
        wire = median([t.wire_bytes for t in trials]) if measured else math.nan
        analytic = analytic_wire_bytes(first.strategy, grad, world)

        def per_op(key: str) -> dict[str, float]:  # the median over trials of each op's figure
            ops = dict.fromkeys(op for t in trials for op in getattr(t, key))
            return {op: median([float(getattr(t, key).get(op, 0.0)) for t in trials]) for op in ops}

        return Row(
            model=model,
            strategy=name,
            world=world,
            step_ms=1e3 * step,
            ratio=self._ratio(model, name, self.baseline, world),
            ratio_ref=self._ratio(model, name, self.reference, world),
            bytes_mib=sent / 2**20,
            x_grad=sent / grad if grad else math.nan,
            measured=measured,
            wire_measured_mib=wire / 2**20,
            wire_analytic_mib=analytic / 2**20,
            wire_x_analytic=wire / analytic if analytic else math.nan,
            exposed_ms=1e3 * exposed,
            exposed_share=exposed / comm if comm else math.nan,
            comm_ms=1e3 * comm,
            covered_ms=1e3 * median([median(t.covered_s) for t in trials if t.covered_s]),
            covered_na=not any(op not in TORCH_TWINS and b for op, b in first.op_bytes_per_step.items()),
            codec_ms=1e3 * median([median(t.codec_s or [0.0]) for t in trials]),
            peak_mib=median([t.peak_mib for t in trials]),
            scaling=single / step if single else math.nan,
            pairs=len(trials),
            sync_every=round(median([sync_every(t.step_calls) for t in trials])),
            param_bytes=grad,
            n_linear=first.n_linear,
            op_bytes_per_step=per_op("op_bytes_per_step"),
            op_calls_per_step=per_op("op_calls_per_step"),
            strategy_node=first.strategy,
            extra=first.extra,
        )

    def rows(self) -> list[Row]:
        return list(self._rows.values())

    def _cost_model(self) -> CostModel | None:
        if self.params is None:
            return None
        proj = (self.cfg.get("cost_model") or {}).get("projection") or {}
        every = {(r.model, r.world, r.sync_every) for r in self.rows() if r.sync_every > 1}
        compute_every = {key: self.compute_every(*key) for key in every if key[:2] in self._in_step}
        ks = (int(proj.get("smallest", 8)), int(proj.get("largest", 4096)))
        args = (self.meta.get("cores"), int(self.meta.get("threads_per_rank", 1)), ks, compute_every, self.host)
        return CostModel(self.rows(), self.compute, self.params, *args)

    def _worlds(self) -> list[int]:
        return sorted({k for _, _, k in self._trials})

    def markdown(self) -> str:
        m, ref, base = self.meta, self.reference, self.baseline
        lines = [
            f"# lightning-sync bench ({m['date']})",
            "",
            f"- machine: {m['cpu']}; {', '.join(map(str, self._worlds()))} ranks x {m['threads_per_rank']} thread(s)",
            f"- torch {m['torch']}, lightning {m['lightning']}, python {m['python']}; command: `{m['command']}`",
            f"- {self.cfg.pairs} alternating pairs x {self.cfg.steps} timed steps (after {self.cfg.warmup_steps} "
            f"warm-up steps); medians; ratios are to `{base}` and to `{ref}` in the same pair and world size",
            "",
            f"| model | K | strategy | step ms | x {base} | x {ref} | MiB/step/rank | x grad bytes | ring wire MiB "
            "| analytic MiB | comm alone ms | exposed ms | exposed / comm | covered ms | peak MiB | T1/TK |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in self.rows():
            wire = f"{r.wire_measured_mib:.2f}" if r.measured else "n/a"
            lines.append(
                f"| {r.model} | {r.world} | {r.strategy} | {r.step_ms:.1f} | {r.ratio:.3f} | {fmt(r.ratio_ref, '.3f')} "
                f"| {r.bytes_mib:.2f} | {r.x_grad:.3f} | {wire} | {r.wire_analytic_mib:.2f} | {r.comm_ms:.1f} | "
                f"{r.exposed_ms:.1f} | {r.exposed_share:.2f} | {'n/a' if r.covered_na else f'{r.covered_ms:.1f}'} | "
                f"{r.peak_mib:.0f} | {r.scaling:.2f} |"
            )
        if self._single:
            t1 = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in self._single.items())
            lines += ["", f"Single-process step time T1(b) (ms): {t1}"]
        if self.host:
            host = ", ".join(f"{n} on {m} {1e3 * v:+.1f}" for (m, n), v in self.host.items())
            lines += [
                "",
                f"Host work at one rank, the row's single-process step less T1 (ms; the cost model adds it): {host}",
            ]
        lines += [
            "",
            "Covered ms: compute time with an async `comms` call in flight. torch's DDP and FSDP2 bypass `comms` "
            "(n/a). Ring wire: all_reduce 2(K-1)/K, reduce_scatter (K-1)/K, all_gather K-1 per payload byte.",
            "",
            *self.scaling_markdown(),
            *self.sharding_markdown(),
        ]
        if self.cost_model is not None:
            lines += self.cost_model.markdown()
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        """Every row (each with the run's metadata), compute and host times, and the cost model's results."""
        out: dict[str, Any] = {
            "meta": self.meta,
            "rows": [{**asdict(r), **self.meta} for r in self.rows()],
            "compute_s": [{"model": m, "concurrent": k, "seconds": v} for (m, k), v in self.compute.items()],
            "host_s": [{"model": m, "strategy": n, "seconds": v} for (m, n), v in self.host.items()],
        }
        if self.cost_model is not None and self.params is not None:
            out["params"] = self.params.as_json()
            out["fits"] = {a: {"alpha_s": f.alpha, "beta_s_per_byte": f.beta} for a, f in self.params.links.items()}
            out["validation"] = [asdict(v) for v in self.cost_model.validation()]
            out["projection"] = [asdict(p) for p in self.cost_model.projection()]
        return out

    def scaling_markdown(self) -> list[str]:
        """Scaling efficiency ``T1(b) / TK(b)`` per model and strategy, one column per measured K."""
        worlds = self._worlds()
        names = list(dict.fromkeys((m, n) for m, n, _ in self._trials if m in self._single))
        if not names or not worlds:
            return []
        lines = [
            "## Scaling efficiency",
            "",
            "T1(b) / TK(b) at a fixed per-rank batch b (1.00 is perfect; K ranks beyond the cores time-share them).",
            "",
            "| model | strategy | " + " | ".join(f"K={k}" for k in worlds) + " |",
            "|---|---|" + "---:|" * len(worlds),
        ]
        for model, name in names:
            cells = [f"{r.scaling:.2f}" if (r := self._rows.get((model, name, k))) else "-" for k in worlds]
            lines.append(f"| {model} | {name} | " + " | ".join(cells) + " |")
        return [*lines, ""]

    def sharding_rows(self) -> list[Row]:
        """``sharding_table.rows`` that ran, per model and world size where a sharded one ran."""
        out = []
        for model, world in dict.fromkeys((m, k) for m, _, k in self._trials):
            present = [self._rows[(model, n, world)] for n in self.shard_names if (model, n, world) in self._rows]
            if any(strategy_class(r.strategy_node) in ("ShardedStrategy", "FullyShardStrategy") for r in present):
                out += present
        return out

    def sharding_markdown(self) -> list[str]:
        """The sharding table (empty when no sharded strategy ran)."""
        if not (rows := self.sharding_rows()):
            return []
        lines = [
            "## Sharding",
            "",
            "Peak memory of the largest rank; ring-model wire bytes through `comms` against the analytic figure "
            "(DDP, ZeRO-1/2: 2(K-1)/K x S; ZeRO-3, FSDP2: 3(K-1)/K x S; S = parameter bytes).",
            "",
            f"| model | K | strategy | step ms | x {self.baseline} | x {self.reference} | peak MiB/rank "
            "| wire MiB/step/rank | analytic MiB | wire / analytic |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            wire, x_an = (f"{r.wire_measured_mib:.2f}", f"{r.wire_x_analytic:.3f}") if r.measured else ("n/a", "n/a")
            lines.append(
                f"| {r.model} | {r.world} | {r.strategy} | {r.step_ms:.1f} | {r.ratio:.3f} | "
                f"{fmt(r.ratio_ref, '.3f')} | {r.peak_mib:.0f} | {wire} | {r.wire_analytic_mib:.2f} | {x_an} |"
            )
        return [*lines, ""]

    def write(self, out_dir: Path) -> None:
        """Write ``report.md``, ``report.json`` and the figures into ``out_dir`` and print the report."""
        out_dir.mkdir(parents=True, exist_ok=True)
        text = self.markdown()
        (out_dir / "report.md").write_text(text)
        (out_dir / "report.json").write_text(json.dumps(self.as_json(), indent=1, default=str))
        print(text)
        write_plots(self, out_dir)
