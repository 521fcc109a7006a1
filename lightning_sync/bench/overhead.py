"""Per-call overhead of the collectives layer: a 4-byte all-reduce, raw against ``comms`` without and with hooks.

A 4-byte message is all latency, so the differences between ``raw`` (``torch.distributed``), ``bare`` (a context
without hooks) and ``observed`` (a ``CommStats`` observer, a strategy's default) are the layer's own cost per call.
The modes alternate in short blocks, in an order that rotates from round to round, so that a shared machine's
load falls on all three alike; each mode's ratio to raw is taken within each round (against the raw block beside
it) and its median over the rounds reported, which drift between rounds does not move::

    python -m lightning_sync.bench.overhead --world 2 --calls 250 --rounds 120
"""

from __future__ import annotations

import statistics
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
    """One mode's microseconds per call over the rounds, as rank 0 measured them, and its ratio to raw (the median
    over the rounds of the ratio to that round's raw block)."""

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
    for r in range(rounds):
        for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:  # no mode always goes first
            fn = issue[mode]
            dist.barrier()  # every rank starts the mode's block together
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            per_call[mode].append((time.perf_counter() - start) / calls * 1e6)
    return per_call


def _summarize(per_call: dict[str, list[float]]) -> list[OverheadRow]:
    """Rows from each mode's microseconds per call, round by round."""
    raw = per_call["raw"]
    return [OverheadRow(m, *spread(v), statistics.median(x / r for x, r in zip(v, raw))) for m, v in per_call.items()]


def measure(world: int = 2, calls: int = 250, rounds: int = 120, warmup: int = 200) -> list[OverheadRow]:
    """Spawn ``world`` gloo ranks and measure the three modes; rows as rank 0 saw them."""
    from lightning_sync.testing.harness import run_distributed

    # start-up (importing torch and this package in every rank) plus 2 ms a call, 20x what a call should take
    timeout = 300.0 + rounds * calls * len(MODES) * 2e-3
    return _summarize(run_distributed(_rank, world, calls, rounds, warmup, timeout=timeout)[0])


def report(rows: list[OverheadRow]) -> str:
    """A Markdown table of the rows."""
    lines = ["| mode | median us/call | min - max | / raw |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.mode} | {r.median_us:.1f} | {r.min_us:.1f} - {r.max_us:.1f} | {r.ratio_to_raw:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    options = {"world": (2, "gloo ranks"), "calls": (250, "calls per mode and round")}
    options["rounds"] = (120, "alternating rounds")
    args = counts_cli(__doc__, argv, **options)
    print(report(measure(args.world, args.calls, args.rounds)))


if __name__ == "__main__":
    main()
