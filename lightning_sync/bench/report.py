"""Turn benchmark measurements into medians, ratios, a Markdown report and PNG plots.

Statistics (this machine is noisy, so only medians and same-run ratios are reported):

* a trial's step time is the median of its timed steps on rank 0 (ranks step in lockstep);
* a strategy's step time is the median over its trials (one per pair);
* the ratio to the baseline is the median over pairs of (trial / the baseline's trial of the same
  pair), so both sides of each ratio ran back to back;
* bytes/step are this rank's payload through ``comms``; ``x grad`` divides by the gradient bytes
  (1.00 = every gradient byte once); ring wire bytes are ``2(K-1)/K`` times the payload;
* exposed communication is the median time still communicating after backward ended, as a share
  of the time the same buckets take to all-reduce alone ("comm alone", measured after the trial);
* scaling efficiency is ``T1(b) / TK(b)``, 1.0 being perfect.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["Report"]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Report:
    """Aggregates ``results[rank][trial]`` (see ``bench.runner``) into tables and plots."""

    def __init__(self, results: list[list[dict[str, Any]]], single: list[dict[str, Any]], cfg: Any,
                 meta: dict[str, Any]) -> None:
        self.meta, self.cfg = meta, cfg
        self.baseline = str(cfg.baseline)
        self._trials: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for i, rank0 in enumerate(results[0]):
            peak = max(r[i]["peak_mib"] for r in results)
            self._trials[(rank0["model"], rank0["name"])].append({**rank0, "peak_mib": peak})
        self._single = {r["model"]: _median(r["step_s"]) for r in single}

    def _step(self, t: dict[str, Any]) -> float:
        return _median(t["step_s"])

    def row(self, model: str, name: str) -> dict[str, Any]:
        """Aggregated figures of one strategy on one model."""
        trials = self._trials[(model, name)]
        base = self._trials.get((model, self.baseline), [])
        ratios = [self._step(t) / self._step(b) for t, b in zip(trials, base)]
        world = trials[0]["world"]
        grad = trials[0]["grad_bytes"]
        sent = _median([t["bytes_per_step"] for t in trials])
        exposed = _median([_median(t["exposed_s"]) for t in trials if t["exposed_s"]])
        comm = _median([t["comm_s"] for t in trials if t["comm_s"]])
        step = _median([self._step(t) for t in trials])
        single = self._single.get(model)
        return {"model": model, "strategy": name, "step_ms": 1e3 * step,
                "ratio": _median(ratios) if name != self.baseline else 1.0,
                "bytes_mib": sent / 2**20, "x_grad": sent / grad if grad else float("nan"),
                "wire_mib": 2 * (world - 1) / world * sent / 2**20,
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
            lines.append(f"| {r['model']} | {r['strategy']} | {r['step_ms']:.1f} | {r['ratio']:.3f} | "
                         f"{r['bytes_mib']:.2f} | {r['x_grad']:.3f} | {r['wire_mib']:.2f} | {r['comm_ms']:.1f} | "
                         f"{r['exposed_ms']:.1f} | "
                         f"{r['exposed_share']:.2f} | {r['peak_mib']:.0f} | {r['scaling']:.2f} |")
        lines += ["", f"Single-process step time T1(b) (ms): "
                  + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in self._single.items()),
                  "", "Overlap check: with perfect overlap a step would take max(T1, comm alone); on a machine "
                  "where communication competes with compute for the same cores it takes about T1 + comm alone.",
                  "", "torch's own DDP sends its gradients outside `lightning_sync.comms`, so its bytes read 0 here; "
                  "its payload is the gradient size (x grad bytes 1.00) by construction.", ""]
        return "\n".join(lines)

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
