"""Turn benchmark measurements into medians, ratios, a Markdown report and PNG plots.

Statistics (this machine is noisy, so only medians and same-run ratios are reported):

* a trial's step time is the median of its timed steps on rank 0 (ranks step in lockstep);
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
  (parameters gathered again for backward); torch DDP and FSDP2 bypass ``comms``, so their
  measured figure is n/a;
* exposed communication is the median time still communicating after backward ended, as a share
  of the time the same buckets take to all-reduce alone ("comm alone", measured after the trial);
* scaling efficiency is ``T1(b) / TK(b)``, 1.0 being perfect;
* the sharding table (``sharding_table`` in the config) puts the sharded strategies next to the DDP
  rows: step time and its same-pair ratios to the baseline and to ``sharding_table.reference``
  (FSDP2), peak memory per rank (the largest over ranks), and wire bytes against the analytic ones.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["WIRE_FACTORS", "Report", "analytic_wire_bytes", "analytic_wire_factor", "wire_bytes"]

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


def _is_sharded(strategy: Mapping[str, Any]) -> bool:
    return str(strategy.get("_target_") or "").rpartition(".")[2] in ("ShardedStrategy", "FullyShardStrategy")


class Report:
    """Aggregates ``results[rank][trial]`` (see ``bench.runner``) into tables and plots."""

    def __init__(self, results: list[list[dict[str, Any]]], single: list[dict[str, Any]], cfg: Any,
                 meta: dict[str, Any]) -> None:
        self.meta, self.cfg = meta, cfg
        self.baseline = str(cfg.baseline)
        self._trials: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for i, rank0 in enumerate(results[0]):
            peak = max(r[i]["peak_mib"] for r in results)
            wire = max(wire_bytes(r[i].get("op_bytes_per_step", {}), r[i]["world"]) for r in results)
            self._trials[(rank0["model"], rank0["name"])].append({**rank0, "peak_mib": peak, "wire_bytes": wire})
        self._single = {r["model"]: _median(r["step_s"]) for r in single}

    def _step(self, t: dict[str, Any]) -> float:
        return _median(t["step_s"])

    def _ratio(self, model: str, name: str, reference: str) -> float:
        """Median over pairs of this strategy's step time over ``reference``'s in the same pair."""
        if name == reference:
            return 1.0
        trials, base = self._trials[(model, name)], self._trials.get((model, reference), [])
        return _median([self._step(t) / self._step(b) for t, b in zip(trials, base)])

    def row(self, model: str, name: str) -> dict[str, Any]:
        """Aggregated figures of one strategy on one model."""
        trials = self._trials[(model, name)]
        world = trials[0]["world"]
        grad = trials[0]["grad_bytes"]
        sent = _median([t["bytes_per_step"] for t in trials])
        exposed = _median([_median(t["exposed_s"]) for t in trials if t["exposed_s"]])
        comm = _median([t["comm_s"] for t in trials if t["comm_s"]])
        step = _median([self._step(t) for t in trials])
        single = self._single.get(model)
        measured = any(t.get("comm_calls", 0) for t in trials)  # else the strategy bypasses comms
        wire = _median([t["wire_bytes"] for t in trials]) if measured else float("nan")
        analytic = analytic_wire_bytes(trials[0].get("strategy", {}), trials[0].get("param_bytes", grad), world)
        return {"model": model, "strategy": name, "step_ms": 1e3 * step,
                "ratio": self._ratio(model, name, self.baseline),
                "bytes_mib": sent / 2**20, "x_grad": sent / grad if grad else float("nan"),
                "wire_mib": (wire if measured else 0.0) / 2**20, "measured": measured,
                "wire_measured_mib": wire / 2**20, "wire_analytic_mib": analytic / 2**20,
                "wire_x_analytic": wire / analytic if analytic else float("nan"),
                "exposed_ms": 1e3 * exposed, "exposed_share": exposed / comm if comm else float("nan"),
                "comm_ms": 1e3 * comm,
                "peak_mib": _median([t["peak_mib"] for t in trials]),
                "scaling": single / step if single else float("nan"), "pairs": len(trials), "extra": trials[0]["extra"]}

    def rows(self) -> list[dict[str, Any]]:
        return [self.row(m, n) for (m, n) in self._trials]

    def markdown(self) -> str:
        m = self.meta
        lines = [f"# lightning-sync bench ({m['date']})", "",
                 f"- machine: {m['cpu']}; {m['world_size']} ranks x {m['threads_per_rank']} thread(s)",
                 f"- torch {m['torch']}, lightning {m['lightning']}, python {m['python']}",
                 f"- command: `{m['command']}`",
                 f"- {self.cfg.pairs} alternating pairs x {self.cfg.steps} timed steps (after "
                 f"{self.cfg.warmup_steps} warm-up steps); medians; ratios are to `{self.baseline}` in the same pair", "",
                 "| model | strategy | step ms | x baseline | MiB/step/rank | x grad bytes | ring wire MiB "
                 "| comm alone ms | exposed ms | exposed / comm | peak MiB | T1/TK |",
                 "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in self.rows():
            wire = f"{r['wire_mib']:.2f}" if r["measured"] else "n/a"
            lines.append(f"| {r['model']} | {r['strategy']} | {r['step_ms']:.1f} | {r['ratio']:.3f} | "
                         f"{r['bytes_mib']:.2f} | {r['x_grad']:.3f} | {wire} | {r['comm_ms']:.1f} | "
                         f"{r['exposed_ms']:.1f} | "
                         f"{r['exposed_share']:.2f} | {r['peak_mib']:.0f} | {r['scaling']:.2f} |")
        lines += ["", "Single-process step time T1(b) (ms): "
                  + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in self._single.items()),
                  "", "Overlap check: with perfect overlap a step would take max(T1, comm alone); on a machine "
                  "where communication competes with compute for the same cores it takes about T1 + comm alone.",
                  "", "torch's own DDP sends its gradients outside `lightning_sync.comms`, so its bytes read 0 here; "
                  "its payload is the gradient size (x grad bytes 1.00) by construction. Ring wire MiB converts "
                  "each op's payload with the ring model (all_reduce 2(K-1)/K, reduce_scatter (K-1)/K, "
                  "all_gather K-1); n/a where the strategy bypasses `comms`.", ""]
        lines += self.sharding_markdown()
        return "\n".join(lines)

    def _sharding_cfg(self) -> tuple[list[str], str]:
        node = self.cfg.get("sharding_table") if hasattr(self.cfg, "get") else None
        node = node or {}
        return [str(n) for n in node.get("rows", [])], str(node.get("reference", "fsdp2"))

    def sharding_rows(self) -> list[dict[str, Any]]:
        """Rows of the sharding table: ``sharding_table.rows`` that ran, per model, if a sharded one ran.

        Adds ``ratio_ref``, the same-pair step-time ratio to ``sharding_table.reference``.
        """
        names, reference = self._sharding_cfg()
        out = []
        for model in dict.fromkeys(m for m, _ in self._trials):
            present = [n for n in names if (model, n) in self._trials]
            if not any(_is_sharded(self._trials[(model, n)][0].get("strategy", {})) for n in present):
                continue
            for n in present:
                ratio_ref = self._ratio(model, n, reference) if (model, reference) in self._trials else float("nan")
                out.append({**self.row(model, n), "ratio_ref": ratio_ref})
        return out

    def sharding_markdown(self) -> list[str]:
        """The sharding table (empty when no sharded strategy ran)."""
        rows = self.sharding_rows()
        if not rows:
            return []
        _, reference = self._sharding_cfg()
        lines = ["## Sharding", "",
                 f"Step time and same-pair ratios to `{self.baseline}` and to `{reference}`; peak memory is the "
                 "largest over ranks (mallinfo2 above the level before the model was built); wire bytes per step "
                 "and rank, measured through `comms` with the ring model, against the analytic figure "
                 "(DDP and ZeRO-1/2: 2(K-1)/K x S, ZeRO-3 and FSDP2: 3(K-1)/K x S, S = trainable parameter bytes, "
                 "padding aside). torch DDP and FSDP2 bypass `comms`: measured n/a.", "",
                 f"| model | strategy | step ms | x {self.baseline} | x {reference} | peak MiB/rank "
                 "| wire MiB/step/rank | analytic MiB | wire / analytic |",
                 "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            ref = "n/a" if math.isnan(r["ratio_ref"]) else f"{r['ratio_ref']:.3f}"
            wire = f"{r['wire_measured_mib']:.2f}" if r["measured"] else "n/a"
            x_an = f"{r['wire_x_analytic']:.3f}" if r["measured"] else "n/a"
            lines.append(f"| {r['model']} | {r['strategy']} | {r['step_ms']:.1f} | {r['ratio']:.3f} | {ref} | "
                         f"{r['peak_mib']:.0f} | {wire} | {r['wire_analytic_mib']:.2f} | {x_an} |")
        return [*lines, ""]

    def write(self, out_dir: Path) -> None:
        """Write ``report.md`` and the plots into ``out_dir`` and print the table."""
        out_dir.mkdir(parents=True, exist_ok=True)
        text = self.markdown()
        (out_dir / "report.md").write_text(text)
        print(text)
        self._plots(out_dir)

    def _plots(self, out_dir: Path) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as err:  # pragma: no cover - matplotlib ships with the dev/bench extras
            raise ImportError("lightning-sync bench draws its plots with matplotlib: "
                              "pip install 'lightning-sync[bench]'") from err
        rows = self.rows()
        models = sorted({r["model"] for r in rows})
        fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
        for ax, model in zip(axes[0], models):
            mine = [r for r in rows if r["model"] == model]
            ax.bar([r["strategy"] for r in mine], [r["step_ms"] for r in mine], color="tab:blue")
            for i, r in enumerate(mine):
                ax.text(i, r["step_ms"], f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
            ax.set_title(f"{model}: median step time (x {self.baseline})")
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

    def _sharding_plot(self, out_dir: Path, plt: Any) -> None:
        """``sharding.png``: per model, step time (top) and wire MiB measured vs analytic (bottom)."""
        rows = self.sharding_rows()
        if not rows:
            return
        models = list(dict.fromkeys(r["model"] for r in rows))
        fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 7), squeeze=False)
        for col, model in enumerate(models):
            mine = [r for r in rows if r["model"] == model]
            names = [r["strategy"] for r in mine]
            xs = list(range(len(mine)))
            top, bottom = axes[0][col], axes[1][col]
            top.bar(xs, [r["step_ms"] for r in mine], color="tab:blue")
            for i, r in enumerate(mine):
                top.text(i, r["step_ms"], f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
            top.set_title(f"{model}: median step time (x {self.baseline})")
            top.set_ylabel("ms / step")
            measured = [r["wire_measured_mib"] if r["measured"] else 0.0 for r in mine]
            bottom.bar([x - 0.2 for x in xs], measured, width=0.4, color="tab:orange", label="measured (comms)")
            bottom.bar([x + 0.2 for x in xs], [r["wire_analytic_mib"] for r in mine], width=0.4, color="tab:gray",
                       label="analytic")
            for i, r in enumerate(mine):
                if not r["measured"]:
                    bottom.text(i - 0.2, 0, "n/a", ha="center", va="bottom", fontsize=8)
            bottom.set_title(f"{model}: wire MiB / step / rank")
            bottom.set_ylabel("MiB")
            bottom.legend(fontsize=8)
            for ax in (top, bottom):
                ax.set_xticks(xs)
                ax.set_xticklabels(names, rotation=30, fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "sharding.png", dpi=110)
        plt.close(fig)
