"""Turn benchmark measurements into medians, ratios, a Markdown report and PNG plots.

Statistics (this machine is noisy, so only medians and same-run ratios are reported):

* a trial's step time is the median of its timed steps on rank 0 (ranks step in lockstep); for a
  strategy that communicates on one step in H (:func:`sync_every`: LocalSGD, DiLoCo), the median over
  windows of H consecutive steps of their mean (:func:`window_means`), so every window holds one
  synchronization and its wait, which the median of single steps would leave out;
* a strategy's step time is the median over its trials (one per pair);
* the ratio to the baseline is the median over pairs of (trial / the baseline's trial of the same
  pair), so both sides of each ratio ran back to back;
* bytes/step are this rank's payload through ``comms``; ``x grad`` divides by the gradient bytes
  (1.00 = every gradient byte once);
* wire bytes/step (:func:`wire_bytes`) convert each op's payload with the ring model of
  :mod:`lightning_sync.comms.stats` (:data:`WIRE_FACTORS`): all_reduce ``2(K-1)/K``, reduce_scatter
  ``(K-1)/K`` (its payload is the full padded input), all_gather ``K-1`` (its payload is this rank's
  shard); they are compared with :func:`analytic_wire_bytes`, the textbook figure from the
  parameter bytes S: ``2(K-1)/K * S`` for DDP and ZeRO-1/2, ``3(K-1)/K * S`` for ZeRO-3 and FSDP2
  (parameters gathered again for backward); torch DDP bypasses ``comms``, so its measured figure is
  n/a; FSDP2's all-gathers and reduce-scatters are counted while its trials run
  (:func:`~lightning_sync.bench.runner.torch_collectives_counted`);
* exposed communication is the median time still communicating after backward ended, as a share
  of the time the same buckets take to all-reduce alone ("comm alone", measured after the trial);
* covered is the median per step of the time a rank computed while at least one of its async ``comms``
  calls was in flight (``CommStats.covered_seconds``): the most communication it could hide behind compute;
* scaling efficiency is ``T1(b) / TK(b)``, 1.0 being perfect;
* the sharding table (``sharding_table`` in the config) puts the sharded strategies next to the DDP
  rows: step time and its same-pair ratios to the baseline and to ``sharding_table.reference``
  (FSDP2), peak memory per rank (the largest over ranks), and wire bytes against the analytic ones.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lightning_sync._checks import check_int
from lightning_sync.bench.cost_report import CostModel
from lightning_sync.bench.model import TORCH_TWINS
from lightning_sync.bench.runner import IN_STEP, SINGLE_ROW

__all__ = [
    "WIRE_FACTORS",
    "Report",
    "analytic_wire_bytes",
    "analytic_wire_factor",
    "load_raw",
    "save_raw",
    "slowest_per_step",
    "sync_every",
    "window_means",
    "wire_bytes",
]

#: Bytes a rank puts on the wire per payload byte recorded by ``comms`` (see ``comms/stats.py`` for what
#: each op records), for K ranks, under the ring model. Ops whose payload is one rank's share of a
#: one-to-many pattern (broadcast, gather, scatter) use the per-rank average ``(K-1)/K``; ``send``
#: counts once and ``recv`` not at all (the sender's entry already holds those bytes); ``metadata``
#: (shape exchanges, all-gathered or broadcast) is bounded by ``K-1``. An op not listed counts its
#: payload once.
WIRE_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda k: 2 * (k - 1) / k,
    "reduce_scatter": lambda k: (k - 1) / k,
    "all_gather": lambda k: float(k - 1),
    "broadcast": lambda k: (k - 1) / k,
    "gather": lambda k: (k - 1) / k,
    "scatter": lambda k: (k - 1) / k,
    "metadata": lambda k: float(k - 1),
    "send": lambda k: 1.0,
    "recv": lambda k: 0.0,
    "barrier": lambda k: 0.0,
}
WIRE_FACTORS.update({op: WIRE_FACTORS[twin] for op, twin in TORCH_TWINS.items()})  # FSDP2's, counted by bench.runner


def _check_world(world: int) -> None:
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world size must be an int >= 1, got {world!r}")


def wire_bytes(op_bytes: Mapping[str, float], world: int) -> float:
    """Ring-model bytes one rank sends, from its per-op payload bytes (``{op: bytes}``) over K=``world`` ranks."""
    _check_world(world)
    return sum(WIRE_FACTORS.get(op, lambda k: 1.0)(world) * b for op, b in op_bytes.items())


def analytic_wire_factor(strategy: Mapping[str, Any], world: int) -> float:
    """Wire bytes per parameter byte, per rank and step, that the strategy node's algorithm needs.

    * ``ShardedStrategy`` stage 3 and ``FullyShardStrategy`` (FSDP2): all-gather for forward, again
      for backward, reduce-scatter the gradients: ``3(K-1)/K`` (``2(K-1)/K`` with
      ``reshard_after_forward: false``, the parameters stay gathered until backward);
    * ``ShardedStrategy`` stages 1 and 2: reduce-scatter the gradients, all-gather the updated
      parameters: ``2(K-1)/K``;
    * anything else (DDP, ``BucketedDDPStrategy``): one ring all-reduce of the gradients, ``2(K-1)/K``.
      Compression is deliberately not modelled: measured / analytic then shows its saving.
    """
    _check_world(world)
    cls = str(strategy.get("_target_") or "").rpartition(".")[2]
    rounds = 2
    if cls == "ShardedStrategy":
        stage = int(strategy.get("stage", 3))
        if stage not in (1, 2, 3):
            raise ValueError(f"ShardedStrategy stage must be one of [1, 2, 3], got {stage!r}")
        rounds = 3 if stage == 3 and strategy.get("reshard_after_forward", True) else 2
    elif cls == "FullyShardStrategy":
        rounds = 3 if strategy.get("reshard_after_forward", True) else 2
    return rounds * (world - 1) / world


def analytic_wire_bytes(strategy: Mapping[str, Any], param_bytes: float, world: int) -> float:
    """:func:`analytic_wire_factor` times S, the bytes of the trainable parameters (padding aside)."""
    if param_bytes < 0:
        raise ValueError(f"param_bytes must be >= 0, got {param_bytes!r}")
    return analytic_wire_factor(strategy, world) * param_bytes


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def window_means(steps: list[float], every: int = 1) -> list[float]:
    """The mean step time of each window of ``every`` consecutive steps (a trailing partial window is
    dropped; ``every`` = 1: the steps themselves)."""
    check_int("every", every, 1)
    return [sum(steps[i : i + every]) / every for i in range(0, len(steps) - every + 1, every)]


def slowest_per_step(ranks: list[list[float]], every: int = 1) -> list[float]:
    """Per step, the slowest of the processes' times (``ranks``: each process's step times, in step
    order): a synchronous step ends when its slowest rank does. With ``every`` = H, per window of H
    steps the slowest process's mean step time: ranks that synchronize once in H steps wait for the
    slowest one's H steps together, not for its slowest single step."""
    return [max(window) for window in zip(*(window_means(r, every) for r in ranks))]


def sync_every(step_calls: list[int] | None) -> int:
    """H, the synchronization period of a trial in steps, from the collectives it issued in each timed step
    (``step_calls``): the timed steps over those that communicated, rounded; 1 when every step (or none,
    or nothing through ``comms``: torch's DDP and FSDP2) communicated."""
    if not step_calls:
        return 1
    busy = sum(1 for c in step_calls if c > 0)
    return max(1, round(len(step_calls) / busy)) if busy else 1


def _median_ops(trials: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Per op, the median over trials of ``trial[key][op]`` (0 where a trial lacks the op)."""
    ops = dict.fromkeys(op for t in trials for op in t.get(key, {}))
    return {op: _median([float(t.get(key, {}).get(op, 0.0)) for t in trials]) for op in ops}


def _is_sharded(strategy: Mapping[str, Any]) -> bool:
    return str(strategy.get("_target_") or "").rpartition(".")[2] in ("ShardedStrategy", "FullyShardStrategy")


def save_raw(
    path: Path,
    results: Mapping[int, list[list[dict[str, Any]]]],
    single: list[dict[str, Any]],
    sweep: list[dict[str, Any]],
    meta: dict[str, Any],
) -> None:
    """Write a run's raw measurements (per world size, per rank, every trial; the single-process trials; the
    sweep points; the run's metadata) as JSON, for :func:`load_raw`."""
    path.write_text(
        json.dumps(
            {"meta": meta, "results": {str(k): v for k, v in results.items()}, "single": single, "sweep": sweep},
            default=str,
        )
    )


def load_raw(
    path: Path,
) -> tuple[dict[int, list[list[dict[str, Any]]]], list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """``(results, single, sweep, meta)`` as :func:`save_raw` wrote them: ``Report(results, single, cfg, meta,
    sweep=sweep)`` with the run's config rebuilds its report."""
    raw = json.loads(path.read_text())
    return {int(k): v for k, v in raw["results"].items()}, raw["single"], raw["sweep"], raw["meta"]


class Report:
    """Aggregates ``results[rank][trial]`` (see ``bench.runner``) into tables and plots."""

    def __init__(
        self,
        results: list[list[dict[str, Any]]] | Mapping[int, list[list[dict[str, Any]]]],
        single: list[dict[str, Any]],
        cfg: Any,
        meta: dict[str, Any],
        sweep: list[dict[str, Any]] | None = None,
    ) -> None:
        """``results``: per world size (or one world size's list), per rank, the trials' measurements (the
        in-step compute rows, ``extra`` :data:`~lightning_sync.bench.runner.IN_STEP`, among them: compute
        under K-way time-sharing); ``single``: one-process trials (T1); ``sweep``: all-reduce sweep points."""
        self.meta, self.cfg = meta, cfg
        self.baseline = str(cfg.baseline)
        by_world = results if isinstance(results, Mapping) else {results[0][0]["world"] if results[0] else 0: results}
        self._trials: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
        self._in_step: dict[tuple[str, int], list[list[list[float]]]] = defaultdict(list)
        """Per (model, K), per round, every in-step rank's compute step times."""
        for world, ranks in by_world.items():
            for i, rank0 in enumerate(ranks[0]):
                if rank0["extra"].get(IN_STEP):
                    self._in_step[(rank0["model"], int(world))].append([list(r[i]["step_s"]) for r in ranks])
                    continue
                peak = max(r[i]["peak_mib"] for r in ranks)
                wire = max(wire_bytes(r[i].get("op_bytes_per_step", {}), r[i]["world"]) for r in ranks)
                self._trials[(rank0["model"], rank0["name"], int(world))].append(
                    {**rank0, "peak_mib": peak, "wire_bytes": wire}
                )
        solo: dict[tuple[str, str], list[float]] = defaultdict(list)
        for r in single:
            solo[(r["model"], r["name"])].append(_median(r["step_s"]))
        self._single = {m: _median(v) for (m, n), v in solo.items() if n == SINGLE_ROW}
        """T1 per model: the median over rounds of the single-process trials' median step."""
        self.host = {
            (m, n): _median(v) - self._single[m] for (m, n), v in solo.items() if n != SINGLE_ROW and m in self._single
        }
        """Per (model, strategy row): the row's step at one rank less T1 (the cost model's host rows)."""
        self.compute = {key: self.compute_every(*key, 1) for key in self._in_step}
        """Compute step time per (model, K) under K-way time-sharing: the median over steps (of every round)
        of the slowest of the K in-step ranks (:func:`slowest_per_step`; K = 1: T1)."""
        for model, t1 in self._single.items():
            self.compute.setdefault((model, 1), t1)
        self.sweep = list(sweep or [])

    def compute_every(self, model: str, world: int, every: int) -> float:
        """Compute step time under K-way time-sharing for ranks that synchronize once in ``every`` steps: the
        median over windows of ``every`` steps (of every round) of the slowest in-step rank's mean
        (:func:`slowest_per_step`); NaN where no compute row ran."""
        return _median([w for ranks in self._in_step.get((model, world), []) for w in slowest_per_step(ranks, every)])

    @staticmethod
    def _every(t: dict[str, Any]) -> int:
        return sync_every(t.get("step_calls"))

    def _step(self, t: dict[str, Any]) -> float:
        return _median(window_means(list(t["step_s"]), self._every(t)))

    def _ratio(self, model: str, name: str, reference: str, world: int) -> float:
        """Median over pairs of this strategy's step time over ``reference``'s in the same pair."""
        if name == reference:
            return 1.0
        trials, base = self._trials[(model, name, world)], self._trials.get((model, reference, world), [])
        return _median([self._step(t) / self._step(b) for t, b in zip(trials, base)])

    def row(self, model: str, name: str, world: int) -> dict[str, Any]:
        """Aggregated figures of one strategy on one model at one world size."""
        trials = self._trials[(model, name, world)]
        grad = trials[0]["grad_bytes"]
        sent = _median([t["bytes_per_step"] for t in trials])
        exposed = _median([_median(t["exposed_s"]) for t in trials if t["exposed_s"]])
        covered = _median([_median(t["covered_s"]) for t in trials if t.get("covered_s")])
        comm = _median([t["comm_s"] for t in trials if t["comm_s"]])
        step = _median([self._step(t) for t in trials])
        single = self._single.get(model)
        measured = any(t.get("comm_calls", 0) for t in trials)  # else the strategy bypasses comms
        wire = _median([t["wire_bytes"] for t in trials]) if measured else float("nan")
        analytic = analytic_wire_bytes(trials[0].get("strategy", {}), trials[0].get("param_bytes", grad), world)
        reference = self._reference()
        ratio_ref = (
            self._ratio(model, name, reference, world) if (model, reference, world) in self._trials else float("nan")
        )
        return {
            "model": model,
            "strategy": name,
            "world": world,
            "step_ms": 1e3 * step,
            "ratio": self._ratio(model, name, self.baseline, world),
            "ratio_ref": ratio_ref,
            "bytes_mib": sent / 2**20,
            "x_grad": sent / grad if grad else float("nan"),
            "wire_mib": (wire if measured else 0.0) / 2**20,
            "measured": measured,
            "wire_measured_mib": wire / 2**20,
            "wire_analytic_mib": analytic / 2**20,
            "wire_x_analytic": wire / analytic if analytic else float("nan"),
            "exposed_ms": 1e3 * exposed,
            "exposed_share": exposed / comm if comm else float("nan"),
            "comm_ms": 1e3 * comm,
            "covered_ms": 1e3 * covered,
            "covered_na": not any(op not in TORCH_TWINS and b for op, b in trials[0]["op_bytes_per_step"].items()),
            "codec_ms": 1e3 * _median([_median(t.get("codec_s") or [0.0]) for t in trials]),
            "peak_mib": _median([t["peak_mib"] for t in trials]),
            "scaling": single / step if single else float("nan"),
            "pairs": len(trials),
            "extra": trials[0]["extra"],
            "op_bytes_per_step": _median_ops(trials, "op_bytes_per_step"),
            "op_calls_per_step": _median_ops(trials, "op_calls_per_step"),
            "param_bytes": trials[0].get("param_bytes", grad),
            "n_linear": trials[0].get("n_linear", 0),
            "sync_every": round(_median([self._every(t) for t in trials])),
            "strategy_node": trials[0].get("strategy", {}),
        }

    def rows(self) -> list[dict[str, Any]]:
        return [self.row(m, n, k) for (m, n, k) in self._trials]

    def _reference(self) -> str:
        """The second ratio's reference row (``sharding_table.reference``, FSDP2 by default)."""
        return self._sharding_cfg()[1]

    def markdown(self) -> str:
        m = self.meta
        ref = self._reference()
        worlds = sorted({k for _, _, k in self._trials})
        lines = [
            f"# lightning-sync bench ({m['date']})",
            "",
            f"- machine: {m['cpu']}; {', '.join(map(str, worlds))} ranks x {m['threads_per_rank']} thread(s)",
            f"- torch {m['torch']}, lightning {m['lightning']}, python {m['python']}",
            f"- command: `{m['command']}`",
            f"- {self.cfg.pairs} alternating pairs x {self.cfg.steps} timed steps (after "
            f"{self.cfg.warmup_steps} warm-up steps); medians; ratios are to `{self.baseline}` and to `{ref}` "
            "in the same pair and world size",
            "",
            f"| model | K | strategy | step ms | x {self.baseline} | x {ref} | MiB/step/rank | x grad bytes "
            "| ring wire MiB | analytic MiB | comm alone ms | exposed ms | exposed / comm | covered ms | peak MiB "
            "| T1/TK |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in self.rows():
            wire = f"{r['wire_mib']:.2f}" if r["measured"] else "n/a"
            x_ref = "n/a" if math.isnan(r["ratio_ref"]) else f"{r['ratio_ref']:.3f}"
            covered = "n/a" if r["covered_na"] else f"{r['covered_ms']:.1f}"
            lines.append(
                f"| {r['model']} | {r['world']} | {r['strategy']} | {r['step_ms']:.1f} | {r['ratio']:.3f} | "
                f"{x_ref} | {r['bytes_mib']:.2f} | {r['x_grad']:.3f} | {wire} | {r['wire_analytic_mib']:.2f} | "
                f"{r['comm_ms']:.1f} | {r['exposed_ms']:.1f} | "
                f"{r['exposed_share']:.2f} | {covered} | {r['peak_mib']:.0f} | {r['scaling']:.2f} |"
            )
        if self._single:
            lines += [
                "",
                "Single-process step time T1(b) (ms): "
                + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in self._single.items()),
            ]
        if self.host:
            lines += [
                "",
                "Host work at one rank, the row's single-process step less T1 (ms; the cost model adds it): "
                + ", ".join(f"{n} on {m} {1e3 * v:+.1f}" for (m, n), v in self.host.items()),
            ]
        lines += [
            "",
            "Overlap check: with perfect overlap a step would take max(T1, comm alone); on a machine "
            "where communication competes with compute for the same cores it takes about T1 + comm alone. "
            "Covered ms: per step, the time a rank computed with at least one of its async `comms` calls in "
            "flight (n/a: torch's DDP and FSDP2, whose calls bypass `comms`; nan: raw data from before it "
            "was recorded), the most communication it could hide behind compute.",
            "",
            "torch's own DDP sends its gradients outside `lightning_sync.comms`, so its bytes read 0 here; "
            "its payload is the gradient size (x grad bytes 1.00) by construction. Ring wire MiB converts "
            "each op's payload with the ring model (all_reduce 2(K-1)/K, reduce_scatter (K-1)/K, "
            "all_gather K-1); n/a where the strategy bypasses `comms`. Analytic MiB is the textbook figure "
            "(DDP 2(K-1)/K x S, ZeRO-3 and FSDP2 3(K-1)/K x S; compression and periodic syncs not modelled).",
            "",
        ]
        lines += self.scaling_markdown()
        lines += self.sharding_markdown()
        cost = self.cost_model
        if cost is not None:
            lines += cost.markdown()
        return "\n".join(lines)

    @functools.cached_property
    def cost_model(self) -> CostModel | None:
        """The fitted cost model (None without a sweep); built once, the report is final after ``__init__``."""
        if not self.sweep:
            return None
        node = self.cfg.get("cost_model") if hasattr(self.cfg, "get") else None
        proj = (node or {}).get("projection") or {}
        rows = self.rows()
        every = {(r["model"], int(r["world"]), int(r["sync_every"])) for r in rows if int(r["sync_every"]) > 1}
        periodic = {key: self.compute_every(*key) for key in every if key[:2] in self._in_step}
        return CostModel(
            rows,
            self.compute,
            self.sweep,
            compute_every=periodic,
            host=self.host,
            cores=self.meta.get("cores"),
            threads_per_rank=int(self.meta.get("threads_per_rank", 1)),
            projection=(int(proj.get("smallest", 8)), int(proj.get("largest", 4096))),
        )

    def as_json(self) -> dict[str, Any]:
        """Every row (each carrying the run's versions, CPU, date and command), and the cost model's fits,
        validation and projection."""
        rows = [{**r, **self.meta} for r in self.rows()]
        out: dict[str, Any] = {
            "meta": self.meta,
            "rows": rows,
            "compute_s": [{"model": m, "concurrent": k, "seconds": v} for (m, k), v in self.compute.items()],
            "host_s": [{"model": m, "strategy": n, "seconds": v} for (m, n), v in self.host.items()],
        }
        cost = self.cost_model
        if cost is not None:
            out["sweep"] = self.sweep
            out["fits"] = {
                a: {"alpha_s": f.link.alpha, "beta_s_per_byte": f.link.beta, "points": f.points}
                for a, f in cost.fits.items()
            }
            out["validation"] = cost.validation()
            out["projection"] = cost.projection()
        return out

    def scaling_markdown(self) -> list[str]:
        """Scaling efficiency ``T1(b) / TK(b)`` per model and strategy, one column per measured K."""
        worlds = sorted({k for _, _, k in self._trials})
        names = list(dict.fromkeys((m, n) for m, n, _ in self._trials if m in self._single))
        if not names or not worlds:
            return []
        lines = [
            "## Scaling efficiency",
            "",
            "T1(b) / TK(b) at a fixed per-rank batch b: one process against K ranks (1.00 is perfect). "
            "On this machine K ranks beyond its cores time-share them.",
            "",
            "| model | strategy | " + " | ".join(f"K={k}" for k in worlds) + " |",
            "|---|---|" + "---:|" * len(worlds),
        ]
        for model, name in names:
            cells = [
                f"{self.row(model, name, k)['scaling']:.2f}" if (model, name, k) in self._trials else "-"
                for k in worlds
            ]
            lines.append(f"| {model} | {name} | " + " | ".join(cells) + " |")
        return [*lines, ""]

    def _sharding_cfg(self) -> tuple[list[str], str]:
        node = self.cfg.get("sharding_table") if hasattr(self.cfg, "get") else None
        node = node or {}
        return [str(n) for n in node.get("rows", [])], str(node.get("reference", "fsdp2"))

    def sharding_rows(self) -> list[dict[str, Any]]:
        """Rows of the sharding table: ``sharding_table.rows`` that ran, per model and world size, if a
        sharded one ran (``ratio_ref``: the same-pair step-time ratio to ``sharding_table.reference``)."""
        names, _ = self._sharding_cfg()
        out = []
        for model, world in dict.fromkeys((m, k) for m, _, k in self._trials):
            present = [n for n in names if (model, n, world) in self._trials]
            if not any(_is_sharded(self._trials[(model, n, world)][0].get("strategy", {})) for n in present):
                continue
            out += [self.row(model, n, world) for n in present]
        return out

    def sharding_markdown(self) -> list[str]:
        """The sharding table (empty when no sharded strategy ran)."""
        rows = self.sharding_rows()
        if not rows:
            return []
        _, reference = self._sharding_cfg()
        lines = [
            "## Sharding",
            "",
            f"Step time and same-pair ratios to `{self.baseline}` and to `{reference}`; peak memory is the "
            "largest over ranks (mallinfo2 above the level before the model was built); wire bytes per step "
            "and rank, measured through `comms` with the ring model, against the analytic figure "
            "(DDP and ZeRO-1/2: 2(K-1)/K x S, ZeRO-3 and FSDP2: 3(K-1)/K x S, S = trainable parameter bytes, "
            "padding aside). torch DDP bypasses `comms`: measured n/a. FSDP2's all-gathers and reduce-scatters "
            "are counted while its trials run (bench.runner.torch_collectives_counted).",
            "",
            f"| model | K | strategy | step ms | x {self.baseline} | x {reference} | peak MiB/rank "
            "| wire MiB/step/rank | analytic MiB | wire / analytic |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            ref = "n/a" if math.isnan(r["ratio_ref"]) else f"{r['ratio_ref']:.3f}"
            wire = f"{r['wire_measured_mib']:.2f}" if r["measured"] else "n/a"
            x_an = f"{r['wire_x_analytic']:.3f}" if r["measured"] else "n/a"
            lines.append(
                f"| {r['model']} | {r['world']} | {r['strategy']} | {r['step_ms']:.1f} | {r['ratio']:.3f} | "
                f"{ref} | {r['peak_mib']:.0f} | {wire} | {r['wire_analytic_mib']:.2f} | {x_an} |"
            )
        return [*lines, ""]

    def write(self, out_dir: Path) -> None:
        """Write ``report.md`` and the plots into ``out_dir`` and print the table."""
        out_dir.mkdir(parents=True, exist_ok=True)
        text = self.markdown()
        (out_dir / "report.md").write_text(text)
        (out_dir / "report.json").write_text(json.dumps(self.as_json(), indent=1, default=str))
        print(text)
        self._plots(out_dir)

    def _plots(self, out_dir: Path) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as err:  # pragma: no cover - matplotlib ships with the dev/bench extras
            raise ImportError(
                "lightning-sync bench draws its plots with matplotlib: pip install 'lightning-sync[bench]'"
            ) from err
        rows = self.rows()
        panels = list(dict.fromkeys((r["model"], r["world"]) for r in rows))
        cols = min(len(panels), 3)
        fig, axes = plt.subplots(
            math.ceil(len(panels) / cols), cols, figsize=(5.5 * cols, 4 * math.ceil(len(panels) / cols)), squeeze=False
        )
        for ax in axes.flat[len(panels) :]:
            ax.axis("off")
        for ax, (model, world) in zip(axes.flat, panels):
            mine = [r for r in rows if (r["model"], r["world"]) == (model, world)]
            ax.bar([r["strategy"] for r in mine], [r["step_ms"] for r in mine], color="tab:blue")
            for i, r in enumerate(mine):
                ax.text(i, r["step_ms"], f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
            ax.set_title(f"{model}, K={world}: median step time (x {self.baseline})", fontsize=9)
            ax.set_ylabel("ms / step")
            ax.tick_params(axis="x", rotation=30, labelsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "step_time.png", dpi=110)
        plt.close(fig)
        sweep = [r for r in rows if "cap_mb" in r["extra"]]
        if sweep:
            sweep.sort(key=lambda r: r["extra"]["cap_mb"])
            fig, ax = plt.subplots(figsize=(6, 4))
            caps = [r["extra"]["cap_mb"] for r in sweep]
            ax.plot(caps, [r["step_ms"] for r in sweep], "o-", label="step time (ms)")
            ax.plot(caps, [r["exposed_ms"] for r in sweep], "s--", label="exposed comm (ms)")
            ax.set_xscale("log")
            ax.set_xlabel("bucket_cap_mb (largest = one bucket)")
            ax.set_title(f"bucket size sweep ({sweep[0]['model']})")
            ax.legend()
            fig.tight_layout()
            fig.savefig(out_dir / "bucket_sweep.png", dpi=110)
            plt.close(fig)
        self._sharding_plot(out_dir, plt)
        self._scaling_plot(out_dir, plt)
        cost = self.cost_model
        if cost is not None:
            cost.plots(out_dir, plt)

    def _scaling_plot(self, out_dir: Path, plt: Any) -> None:
        """``scaling.png``: T1/TK against K per strategy, one panel per model (only with 2+ world sizes)."""
        worlds = sorted({k for _, _, k in self._trials})
        models = [m for m in dict.fromkeys(m for m, _, _ in self._trials) if m in self._single]
        if len(worlds) < 2 or not models:
            return
        fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
        for ax, model in zip(axes[0], models):
            for name in dict.fromkeys(n for m, n, _ in self._trials if m == model):
                ks = [k for k in worlds if (model, name, k) in self._trials]
                ax.plot([1, *ks], [1.0, *(self.row(model, name, k)["scaling"] for k in ks)], "o-", label=name, ms=3)
            ax.set_xticks([1, *worlds])
            ax.set_ylim(0, 1.05)
            ax.set_xlabel("ranks K (fixed per-rank batch)")
            ax.set_ylabel("T1 / TK")
            ax.set_title(f"{model}: scaling efficiency")
            ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out_dir / "scaling.png", dpi=110)
        plt.close(fig)

    def _sharding_plot(self, out_dir: Path, plt: Any) -> None:
        """``sharding.png``: per model, step time (top) and wire MiB measured vs analytic (bottom)."""
        rows = self.sharding_rows()
        if not rows:
            return
        models = list(dict.fromkeys((r["model"], r["world"]) for r in rows))
        fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 7), squeeze=False)
        for col, (model, world) in enumerate(models):
            mine = [r for r in rows if (r["model"], r["world"]) == (model, world)]
            names = [r["strategy"] for r in mine]
            xs = list(range(len(mine)))
            top, bottom = axes[0][col], axes[1][col]
            top.bar(xs, [r["step_ms"] for r in mine], color="tab:blue")
            for i, r in enumerate(mine):
                top.text(i, r["step_ms"], f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
            top.set_title(f"{model}, K={world}: median step time (x {self.baseline})", fontsize=9)
            top.set_ylabel("ms / step")
            measured = [r["wire_measured_mib"] if r["measured"] else 0.0 for r in mine]
            bottom.bar([x - 0.2 for x in xs], measured, width=0.4, color="tab:orange", label="measured (comms)")
            bottom.bar(
                [x + 0.2 for x in xs],
                [r["wire_analytic_mib"] for r in mine],
                width=0.4,
                color="tab:gray",
                label="analytic",
            )
            for i, r in enumerate(mine):
                if not r["measured"]:
                    bottom.text(i - 0.2, 0, "n/a", ha="center", va="bottom", fontsize=8)
            bottom.set_title(f"{model}, K={world}: wire MiB / step / rank", fontsize=9)
            bottom.set_ylabel("MiB")
            bottom.legend(fontsize=8)
            for ax in (top, bottom):
                ax.set_xticks(xs)
                ax.set_xticklabels(names, rotation=30, fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "sharding.png", dpi=110)
        plt.close(fig)
