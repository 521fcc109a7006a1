"""Per-call overhead of the collectives layer: a 4-byte all-reduce, raw against ``comms`` with and without observer.

A 4-byte message is all latency, so the differences between ``raw`` (``torch.distributed``), ``bare`` (no
observer) and ``observed`` (a ``CommStats`` observer, a strategy's default) are the layer's own cost per call.
The modes alternate so that a noisy machine's drift falls on all three alike::

    python -m lightning_sync.bench.overhead --world 2 --calls 2000 --rounds 15
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_sync import comms
from lightning_sync.bench.rows import counts_cli, spread

__all__ = ["MODES", "OverheadRow", "measure", "report"]

MODES = ("raw", "bare", "observed")


@dataclass(frozen=True)
class OverheadRow:
    """One mode's microseconds per call over the rounds, as rank 0 measured them."""

    mode: str
    median_us: float
    min_us: float
    max_us: float
    ratio_to_raw: float


def _rank(rank: int, world: int, calls: int, rounds: int, warmup: int) -> dict[str, list[float]]:
    t, bare, observed = torch.ones(1), comms.CommContext(), comms.CommContext(observer=comms.CommStats())
    issue = {"raw": lambda: dist.all_reduce(t), "bare": lambda: bare.all_reduce(t)}
    issue["observed"] = lambda: observed.all_reduce(t)
    for fn in issue.values():
        for _ in range(warmup):
            fn()
    per_call: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(rounds):
        for mode in MODES:
            fn = issue[mode]
            dist.barrier()  # every rank starts the mode's round together
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            per_call[mode].append((time.perf_counter() - start) / calls * 1e6)
    return per_call


def measure(world: int = 2, calls: int = 2000, rounds: int = 15, warmup: int = 200) -> list[OverheadRow]:
    """Spawn ``world`` gloo ranks and measure the three modes; rows as rank 0 saw them."""
    from lightning_sync.testing.harness import run_distributed

    # start-up (importing torch and this package in every rank) plus 2 ms a call, 20x what a call should take
    timeout = 300.0 + rounds * calls * len(MODES) * 2e-3
    per_call = run_distributed(_rank, world, calls, rounds, warmup, timeout=timeout)[0]
    raw = spread(per_call["raw"])[0]
    return [OverheadRow(m, *spread(v), spread(v)[0] / raw) for m, v in per_call.items()]


def report(rows: list[OverheadRow]) -> str:
    """A Markdown table of the rows."""
    lines = ["| mode | median us/call | min - max | / raw |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.mode} | {r.median_us:.1f} | {r.min_us:.1f} - {r.max_us:.1f} | {r.ratio_to_raw:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    options = {"world": (2, "gloo ranks"), "calls": (2000, "calls per mode and round")}
    options["rounds"] = (15, "alternating rounds")
    args = counts_cli(__doc__, argv, **options)
    print(report(measure(args.world, args.calls, args.rounds)))


if __name__ == "__main__":
    main()
